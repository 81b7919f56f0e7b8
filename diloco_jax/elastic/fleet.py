"""The islands' processes of an elastic run, and what the driver keeps of
each between rounds: which died (its next call waits for Ray's restart,
whether it died during its call or just after it sent its result), which
is still training an earlier round (kept for the staleness rule), whether
its last result reached x (its error-feedback residual moves on only
then), and which process it is (its pid, host and Ray node, how often Ray
restarted it).
"""

import os

from absl import logging
import numpy as np
import ray
import ray.exceptions

from diloco_jax.config import run_config as run_config_lib
from diloco_jax.elastic import fetches as fetches_lib
from diloco_jax.elastic import island as island_lib
from diloco_jax.elastic import quorum
from diloco_jax.elastic import settings as settings_lib


# How long a ping of an idle island may take before it is taken as alive.
_PING_SECONDS = 30.0


class Fleet:
  """The member islands' Ray actors, round by round."""

  def __init__(self, run_config: run_config_lib.RunConfig,
               settings: settings_lib.ElasticSettings, workdir: str):
    self._launch = _launcher(run_config, settings, workdir)
    self._stale_rounds = settings.stale_rounds
    self._programs = {}  # slot -> its process's actor
    self._rejoining = set()  # islands whose call failed last round
    # island -> how often Ray had restarted its actor at its last answer
    self._restarts = {}
    self._in_flight = {}  # island -> (its late call, the round it trains)
    self._applied = {}  # island -> whether its last result reached x
    self.nodes = {}  # island -> the Ray node its last result came from
    self._pids = {}  # island -> the process id last recorded
    # island -> which process it is, as of the last round's close
    self.processes = {}
    self._hosts = {}  # Ray node id -> its host name
    self.calls = {}  # this round's calls: ObjectRef -> island
    self._started = {}  # ObjectRef -> the round its call trains
    # island -> its call for the next round, sent before this one closed
    # (pipelined rounds: `start_ahead`).
    self._ahead = {}
    # Every call's result, pulled from the moment it is sent.
    self.fetches = fetches_lib.Fetches()

  def set_members(self, members: list[int]) -> tuple[list[int], list[int]]:
    """Starts a process for each slot that joins and ends the process of
    each that leaves (between rounds: nothing of theirs is in flight but a
    late round, dropped with it). Returns (joined, left)."""
    joined = [i for i in members if i not in self._programs]
    left = [i for i in self._programs if i not in members]
    for i in left:
      ray.kill(self._programs.pop(i))
      self._ahead.pop(i, None)
      self._rejoining.discard(i)
      self._restarts.pop(i, None)
      self._pids.pop(i, None)
      self._in_flight.pop(i, None)
    for i in joined:
      self._programs[i] = self._launch(i)
    return joined, left

  def start_round(self, starts: dict, round_number: int, data_states: list,
                  steps: int, first_step: int,
                  island_steps: dict[int, int] | None = None) -> dict:
    """This round's calls (ObjectRef -> island): a new one per member
    from its start (`starts`: island -> the params it starts from), for
    `steps` inner steps after the run's `first_step` (with `island_steps`,
    a time-budgeted round's, each island's own count, its schedule at the
    run's step), but for an island still training an earlier round,
    whose late result counts in this one."""
    self.calls = {ref: i for i, (ref, _) in self._in_flight.items()}
    self._started = {ref: r for ref, r in self._in_flight.values()}
    for i, ref in self._ahead.items():
      self.calls[ref], self._started[ref] = i, round_number
    self._ahead = {}
    self.fetches.keep_only(self.calls)
    idle = [i for i in self._programs
            if i not in self._in_flight and i not in self.calls.values()]
    self._rejoining.update(self._found_dead(idle))
    for i in idle:
      ref = self.call(i, starts[i], round_number, data_states[i],
                      steps if island_steps is None
                      else island_steps.get(i, steps),
                      first_step, island_steps is not None)
      self.calls[ref], self._started[ref] = i, round_number
    return self.calls

  def call(self, i: int, start, round_number: int, data_state,
           steps: int, first_step: int, budgeted: bool):
    """Island i's call (an ObjectRef) to train `steps` inner steps from
    `start` on the batches after `data_state`, its schedule at the run's
    `first_step` where `budgeted` (its steps its own, speeds.py); it waits
    for Ray's restart of a process that died."""
    ref = _train_call(self._programs[i], self._restarting(i)).remote(
        start, round_number, data_state, steps, self._applied.get(i, False),
        first_step, budgeted)
    self.fetches.watch(ref)
    return ref

  def answered(self, i: int, result: dict, applied: bool) -> None:
    """Island i's call came back with `result`, which reached x or not
    (the asynchronous mode: each answer on its own)."""
    self._rejoining.discard(i)
    self._applied[i] = applied
    self.nodes[i] = result["node"]

  def failed(self, i: int) -> None:
    """Island i's call failed: its process died (its next call waits for
    the restart)."""
    self._rejoining.add(i)
    self._applied[i] = False

  def _found_dead(self, idle: list[int]) -> list[int]:
    """The islands of `idle` (none of their calls running) whose process
    does not answer: killed since its last result, maybe so recently that
    Ray's records still call it alive (a call sent to it without retries
    would fail at once, and the island miss the round instead of waiting
    for its restart). One ping each, at once."""
    pings = {self._programs[i].pid.remote(): i for i in idle
             if i not in self._rejoining}
    ready, _ = ray.wait(list(pings), num_returns=len(pings),
                        timeout=_PING_SECONDS)
    dead = []
    for ref in ready:
      try:
        ray.get(ref)
      except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
        dead.append(pings[ref])
    return dead

  def start_ahead(self, start, round_number: int, steps: int,
                  first_step: int,
                  island_steps: dict[int, int] | None = None) -> None:
    """Pipelined rounds: each member's call for round `round_number`, sent
    while the round before it still runs. Ray queues it behind the
    island's current call, so the island starts it the moment that one
    ends, while its result travels and the round closes. It starts from
    `start` (x as the round will start from it, known a round early
    under the one-step delay) and goes on from where the island's stream
    and residual stand after its current call: `settle` takes it back
    (cancelled) from an island whose current call does not reach x, and
    that island gets a call of its own in the round, from its last
    contributed position. An island whose process is being restarted
    gets none ahead."""
    for i, program in self._programs.items():
      if i in self._rejoining or i in self._in_flight:
        continue
      self._ahead[i] = _train_call(program, False).remote(
          start, round_number, None,
          steps if island_steps is None else island_steps.get(i, steps),
          True, first_step, island_steps is not None)
      self.fetches.watch(self._ahead[i])

  def measure_step_seconds(self, starts: dict) -> dict[int, float]:
    """island -> its seconds per inner step, each member timed on its own
    (speeds.py: a time-budgeted run's first round); an island whose
    process fails it is left out. Twice, the first discarded: the
    islands compile their steps at once, and a step timed while another
    island compiles beside it would be slowed by that."""
    measured = {}
    for _ in range(2):
      refs = {self._programs[i].measure_step_seconds.remote(starts[i]): i
              for i in self._programs}
      measured = {}
      for ref, i in refs.items():
        try:
          seconds = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
          continue
        if seconds is not None:
          measured[i] = seconds
    return measured

  def new_calls(self, round_number: int) -> list[int]:
    """The islands whose calls of this round started in it."""
    return [self.calls[ref] for ref, r in self._started.items()
            if r == round_number]

  def _restarting(self, i: int) -> bool:
    """Whether island i's process died since its last answer: its call
    failed last round, or Ray is restarting its process or restarted it
    since (killed just after it sent its result)."""
    if i in self._rejoining:
      return True
    actor = _actor_table(self._programs[i])
    restarts = actor.get("NumRestarts")
    return actor.get("State") == "RESTARTING" or (
        restarts is not None and restarts > self._restarts.get(i, 0))

  def identify(self, results: dict) -> None:
    """Sets `processes`, island -> which process it is, for each member
    as of `results` (island -> its last result): its "pid", "host"
    (name), "ip", "node" (Ray's node id) and "restarts". The process that
    trained the island's result, or for a member without one
    (its call failed or is late) the one Ray has for it at the round's
    close (pid None while Ray restarts it). restarts: how often Ray has
    restarted the member's actor (a slot that joins again gets a new
    actor, counted from 0; None where Ray does not say). A process new to
    an island is said in the log."""
    processes = {}
    for i, program in self._programs.items():
      actor = _actor_table(program)
      result = results.get(i)
      if result is not None and "process" in result:
        process = dict(result["process"])
      else:
        address = actor.get("Address") or {}
        process = {"pid": (actor.get("Pid") or None
                           if actor.get("State") == "ALIVE" else None),
                   "host": self._host(address.get("NodeID")),
                   "ip": address.get("IPAddress"),
                   "node": address.get("NodeID")}
      process["restarts"] = actor.get("NumRestarts")
      if result is not None and process["restarts"] is not None:
        self._restarts[i] = process["restarts"]
      if process["pid"] is not None and process["pid"] != self._pids.get(i):
        self._pids[i] = process["pid"]
        logging.info("island %d: process %s on %s (%s, Ray node %s), "
                     "restarted %s times", i, process["pid"],
                     process["host"], process["ip"], process["node"],
                     process["restarts"])
      processes[i] = process
    self.processes = processes

  def _host(self, node: str | None) -> str | None:
    """The host name of Ray node `node` (None if Ray does not know it)."""
    if node and node not in self._hosts:
      self._hosts.update({n["NodeID"]: n.get("NodeManagerHostname")
                          for n in ray.nodes()})
    return self._hosts.get(node)

  def settle(self, came_back: quorum.RoundResults, included: np.ndarray,
             round_number: int) -> None:
    """What the round's close tells each island's next call, and which
    process each member is (`processes`)."""
    self._rejoining = set(came_back.failed)
    for i, result in came_back.results.items():
      self._applied[i] = bool(included[i])
      self.nodes[i] = result["node"]
    for i in (*came_back.failed, *came_back.late):
      self._applied[i] = False
    # A call sent ahead goes on from this round's: where this round's did
    # not reach x, it is taken back (an island still training this round
    # has not started it) and the island starts the next round anew.
    for i in [i for i in self._ahead if not self._applied.get(i)]:
      ray.cancel(self._ahead.pop(i))
    self.identify(came_back.results)
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
  # Rounds after whose result the island's process is killed (tests).
  kill_after = [[] for _ in range(run_config.islands)]
  for island, round_number in settings.kill_after:
    kill_after[island].append(round_number)
  slow_rounds = [{} for _ in range(run_config.islands)]
  for island, round_number in settings.slow_islands:
    slow_rounds[island][round_number] = settings.slow_seconds
  # Islands are failure domains: Ray is asked to spread them over the
  # nodes. Best effort: on a two-node test cluster it sometimes placed
  # both on one node (so did soft node affinity), measured.
  actor = ray.remote(num_cpus=0, max_restarts=settings.max_restarts,
                     max_task_retries=0, scheduling_strategy="SPREAD",
                     **_resources(config))(island_lib.IslandProgram)
  speeds = settings.speeds or (1.0,) * run_config.islands

  def launch(i):
    # Pinned: the island needs its slot's resource, which only the
    # nodes meant for it offer.
    pinned = (actor.options(resources={island_resource(i): 1})
              if settings.pin_islands else actor)
    return pinned.remote(run_config, i, workdir, kill_steps[i],
                         slow_rounds[i], speeds[i],
                         kill_after=tuple(kill_after[i]))

  return launch


def island_resource(island: int) -> str:
  """The Ray resource a node offers to take island `island` when the
  islands are pinned (config.elastic.pin_islands): `ray start
  --resources='{"diloco_island_0": 1}'` on the host meant for island 0."""
  return f"diloco_island_{island}"


def unplaceable_islands(islands: int) -> list[int]:
  """The islands that no node of the Ray cluster offers its pinned
  resource for (they would wait for a node forever)."""
  offered = ray.cluster_resources()
  return [i for i in range(islands) if offered.get(island_resource(i), 0) < 1]


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


def _train_call(program, restarting: bool):
  """The island's train_round method for this round's call. An island
  whose process died (during its last call, or just after it sent its
  result) is being restarted by Ray: its call waits for the restart (the
  round's quorum and grace window still decide whether it is in time;
  sent with no retry, a call to a process being restarted fails at once,
  ActorUnavailableError, and the island would miss one more round); any
  other island's call fails at once if its process dies, leaving it out
  of the round."""
  return program.train_round.options(
      max_task_retries=-1 if restarting else 0)


def _actor_table(program) -> dict:
  """Ray's record of an island's actor (its state, process id, node and
  restart count; from Ray's developer API), or {} where Ray does not
  say."""
  try:
    from ray._private import state  # pylint: disable=import-outside-toplevel
    actor_id = program._actor_id.hex()  # pylint: disable=protected-access
    return state.actors(actor_id) or {}
  except Exception:  # pylint: disable=broad-except
    return {}
