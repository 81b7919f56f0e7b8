"""The islands' processes of an elastic run, and what the driver keeps of
each between rounds: which died (its next call waits for Ray's restart),
which is still training an earlier round (kept for the staleness rule),
whether its last result reached x (its error-feedback residual moves on
only then), and the Ray node it runs on.
"""

import os

import numpy as np
import ray

from diloco_jax.config import run_config as run_config_lib
from diloco_jax.elastic import island as island_lib
from diloco_jax.elastic import quorum
from diloco_jax.elastic import settings as settings_lib


class Fleet:
  """The member islands' Ray actors, round by round."""

  def __init__(self, run_config: run_config_lib.RunConfig,
               settings: settings_lib.ElasticSettings, workdir: str):
    self._launch = _launcher(run_config, settings, workdir)
    self._stale_rounds = settings.stale_rounds
    self._programs = {}  # slot -> its process's actor
    self._rejoining = set()  # islands whose process died last round
    self._in_flight = {}  # island -> (its late call, the round it trains)
    self._applied = {}  # island -> whether its last result reached x
    self.nodes = {}  # island -> the Ray node its last result came from
    self.calls = {}  # this round's calls: ObjectRef -> island
    self._started = {}  # ObjectRef -> the round its call trains

  def set_members(self, members: list[int]) -> tuple[list[int], list[int]]:
    """Starts a process for each slot that joins and ends the process of
    each that leaves (between rounds: nothing of theirs is in flight but a
    late round, dropped with it). Returns (joined, left)."""
    joined = [i for i in members if i not in self._programs]
    left = [i for i in self._programs if i not in members]
    for i in left:
      ray.kill(self._programs.pop(i))
      self._rejoining.discard(i)
      self._in_flight.pop(i, None)
    for i in joined:
      self._programs[i] = self._launch(i)
    return joined, left

  def start_round(self, starts: dict, round_number: int, data_states: list,
                  steps: int, first_step: int) -> dict:
    """This round's calls (ObjectRef -> island): a new one per member
    from its start (`starts`: island -> the params it starts from), for
    `steps` inner steps after the run's `first_step`, but for an island
    still training an earlier round, whose late result counts in this
    one."""
    self.calls = {ref: i for i, (ref, _) in self._in_flight.items()}
    self._started = {ref: r for ref, r in self._in_flight.values()}
    for i in self._programs:
      if i not in self._in_flight:
        ref = _train_call(self._programs[i], i in self._rejoining).remote(
            starts[i], round_number, data_states[i], steps,
            self._applied.get(i, False), first_step)
        self.calls[ref], self._started[ref] = i, round_number
    return self.calls

  def new_calls(self, round_number: int) -> int:
    """How many of this round's calls started in it."""
    return sum(r == round_number for r in self._started.values())

  def settle(self, came_back: quorum.RoundResults, included: np.ndarray,
             round_number: int) -> None:
    """What the round's close tells each island's next call."""
    self._rejoining = set(came_back.failed)
    for i, result in came_back.results.items():
      self._applied[i] = bool(included[i])
      self.nodes[i] = result["node"]
    for i in (*came_back.failed, *came_back.late):
      self._applied[i] = False
    # A late call is kept while its result could still be applied.
    self._in_flight = {
        self.calls[ref]: (ref, self._started[ref])
        for ref in came_back.pending
        if round_number + 1 - self._started[ref] <= self._stale_rounds}


def _launcher(run_config, settings, workdir):
  """launch(slot) -> a new Ray actor training that slot, restarted by Ray
  when its process dies."""
  config = run_config.config
  kill_steps = [{} for _ in range(run_config.islands)]
  for island, round_number in settings.kill_islands:
    # A moment of the round drawn from the run's seed: the same on a rerun.
    kill_steps[island][round_number] = int(np.random.default_rng(
        [config.seed, island, round_number]).integers(
            run_config.diloco.inner_steps))
  slow_rounds = [{} for _ in range(run_config.islands)]
  for island, round_number in settings.slow_islands:
    slow_rounds[island][round_number] = settings.slow_seconds
  # Islands are failure domains: Ray is asked to spread them over the
  # nodes. Best effort: on a two-node test cluster it sometimes placed
  # both on one node (so did soft node affinity), measured.
  actor = ray.remote(num_cpus=0, max_restarts=settings.max_restarts,
                     max_task_retries=0, scheduling_strategy="SPREAD",
                     **_resources(config))(island_lib.IslandProgram)
  return lambda i: actor.remote(run_config, i, workdir, kill_steps[i],
                                slow_rounds[i])


def _resources(config) -> dict:
  """What each island's process asks Ray for: its own accelerators where
  the cluster has GPUs (Ray then shows each process only its own), and on
  CPU hosts as many host devices as the island's mesh needs."""
  devices = config.mesh.data * config.mesh.stage
  if ray.cluster_resources().get("GPU", 0):
    return {"num_gpus": devices}
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in xla_flags:
    xla_flags += f" --xla_force_host_platform_device_count={devices}"
  return {"runtime_env": {"env_vars": {"XLA_FLAGS": xla_flags.strip()}}}


def _train_call(program, rejoining: bool):
  """The island's train_round method for this round's call. An island
  whose process died is being restarted by Ray: its call waits for the
  restart (the round's quorum and grace window still decide whether it is
  in time); any other island's call fails at once if its process dies,
  leaving it out of the round."""
  return program.train_round.options(
      max_task_retries=-1 if rejoining else 0)
