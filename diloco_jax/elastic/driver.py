"""An elastic run: the coordinator in this process, each island a Ray
actor (its own process, restarted by Ray when it dies), rounds closed by
the quorum rule, the coordinator checkpointed every round.

A dead island is left out of its round and rejoins at the next one with
the x it is handed; rerunning the same command after the coordinator's
process died resumes from its last round.
"""

import dataclasses
import functools
import json
import os
import pathlib
import time

from absl import logging
import jax
import numpy as np
import ray

from diloco_jax.config import run_config as run_config_lib
from diloco_jax.data import sources
from diloco_jax.elastic import coordinator as coordinator_lib
from diloco_jax.elastic import island as island_lib
from diloco_jax.elastic import membership
from diloco_jax.elastic import quorum
from diloco_jax.elastic import settings as settings_lib
from diloco_jax.model import transformer as model_lib


def run(run_config: run_config_lib.RunConfig, workdir: str,
        ray_address: str | None = None) -> dict:
  """Trains `run_config` on elastic islands; returns the summary written to
  workdir/summary.json. `ray_address`: a running Ray cluster's, or None to
  start one on this machine (bound to 127.0.0.1)."""
  settings = settings_lib.check(run_config)
  if ray_address not in (None, "auto"):
    settings_lib.check_answers(ray_address)
  config = run_config.config
  workdir = str(pathlib.Path(workdir).resolve())
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  # Ray starts its processes by forking: before this process starts JAX's
  # threads (forking a multithreaded process can deadlock the child).
  started_ray = not ray.is_initialized()
  if started_ray:
    ray.init(address=ray_address, include_dashboard=False,
             configure_logging=False)
  coordinator = None
  try:
    coordinator = coordinator_lib.Coordinator(run_config, workdir)
    resumed = coordinator.restore()
    return _train(run_config, settings, coordinator,
                  _evaluator(run_config), workdir, resumed)
  finally:
    if coordinator is not None:
      coordinator.close()
    if started_ray:
      ray.shutdown()


@dataclasses.dataclass
class _Tally:
  """What this run's rounds added up to (island-steps, bytes)."""
  possible: int = 0  # island-steps the rounds' members could have used
  contributed: int = 0  # island-steps whose work reached x
  comm_bytes: int = 0  # what one island sent through the codec
  ray_bytes: int = 0  # what the islands' results took through Ray (up)

  def add(self, possible: int, contributed: int, round_bytes: int,
          ray_bytes: int) -> None:
    self.possible += possible
    self.contributed += contributed
    self.comm_bytes += round_bytes
    self.ray_bytes += ray_bytes


def _island_launcher(run_config, settings, workdir):
  """launch(slot) -> a new Ray actor training that slot, restarted by Ray
  when its process dies."""
  config = run_config.config
  kill_steps = [{} for _ in range(run_config.islands)]
  for island, round_number in settings.kill_islands:
    # A moment of the round drawn from the run's seed: the same on a rerun.
    kill_steps[island][round_number] = int(np.random.default_rng(
        [config.seed, island, round_number]).integers(
            config.diloco.inner_steps))
  slow_rounds = [{} for _ in range(run_config.islands)]
  for island, round_number in settings.slow_islands:
    slow_rounds[island][round_number] = settings.slow_seconds
  # SPREAD: islands are failure domains, each on another node where the
  # cluster has several.
  actor = ray.remote(num_cpus=0, max_restarts=settings.max_restarts,
                     max_task_retries=0, scheduling_strategy="SPREAD",
                     **_island_resources(config))(island_lib.IslandProgram)
  return lambda i: actor.remote(run_config, i, workdir, kill_steps[i],
                                slow_rounds[i])


def _island_resources(config) -> dict:
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


def _change_members(programs: dict, members: list[int],
                    launch) -> tuple[list[int], list[int]]:
  """Starts a process for each slot that joins and ends the process of
  each that leaves (between rounds: nothing of theirs is in flight but a
  late round, dropped already). Returns (joined, left)."""
  joined = [i for i in members if i not in programs]
  left = [i for i in programs if i not in members]
  for i in left:
    ray.kill(programs.pop(i))
  for i in joined:
    programs[i] = launch(i)
  return joined, left


def _train(run_config, settings, coordinator, evaluate, workdir,
           resumed) -> dict:
  config = run_config.config
  slots = run_config.islands
  inner_steps = config.diloco.inner_steps
  rounds = -(-config.total_steps // inner_steps)
  launch = _island_launcher(run_config, settings, workdir)
  programs = {}  # slot -> its process's actor, for this round's members
  tally = _Tally()
  rejoining = set()  # islands whose process died last round
  in_flight = {}  # island -> (its late call, the round it trains)
  applied = {}  # island -> whether its last result reached x
  nodes = {}  # island -> the Ray node its last result came from
  start_time = time.monotonic()
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  _keep_records_up_to(metrics_path, coordinator.rounds_done)
  with open(metrics_path, "a") as metrics:
    while coordinator.rounds_done < rounds:
      round_number = coordinator.rounds_done + 1
      first_step = coordinator.rounds_done * inner_steps
      steps = min(inner_steps, config.total_steps - first_step)
      members, problem = membership.members(
          workdir, slots, config.diloco.island_schedule, round_number - 1,
          rounds)
      if problem:
        logging.warning("%s", problem)
      joined, left = _change_members(programs, members, launch)
      rejoining -= set(left)
      for i in left:
        in_flight.pop(i, None)
      x = ray.put(coordinator.x)
      # An island still training an earlier round (kept for the staleness
      # rule) gets no new call: its late result is this round's.
      calls = {ref: i for i, (ref, _) in in_flight.items()}
      started = {ref: r for ref, r in in_flight.values()}
      for i in members:
        if i not in in_flight:
          ref = _train_call(programs[i], i in rejoining).remote(
              x, round_number, coordinator.data_states[i], steps,
              applied.get(i, False))
          calls[ref], started[ref] = i, round_number
      came_back = quorum.collect(calls, settings.min_islands,
                                 settings.grace_seconds)
      included = coordinator.close_round(came_back.results, round_number)
      rejoining = set(came_back.failed)
      for i, result in came_back.results.items():
        applied[i] = bool(included[i])
        nodes[i] = result["node"]
      for i in (*came_back.failed, *came_back.late):
        applied[i] = False
      # A late call is kept while its result could still be applied.
      in_flight = {calls[ref]: (ref, started[ref])
                   for ref in came_back.pending
                   if round_number + 1 - started[ref] <= settings.stale_rounds}
      # Island-steps this round's calls set out to run, and those whose
      # work reached x (a late result's counted in the round it lands in).
      run_steps = sum(started[ref] == round_number for ref in calls) * steps
      applied_steps = sum(len(result["losses"]) for i, result in
                          came_back.results.items() if included[i])
      tally.add(run_steps, applied_steps, coordinator.round_bytes,
                sum(r["sent_bytes"] for r in came_back.results.values()))
      record = _round_record(round_number, first_step + steps, included,
                             came_back)
      record.update(members=members, joined=joined, left=left,
                    island_steps={"run": run_steps, "applied": applied_steps},
                    stale={i: round_number - result["round"] for i, result
                           in came_back.results.items()
                           if included[i] and result["round"] < round_number})
      every = config.eval.every_rounds
      if round_number == rounds or (every and round_number % every == 0):
        record["eval_loss"] = evaluate(coordinator.x)
      # The record first, then the checkpoint: a rerun after a kill in
      # between drops the records of rounds it did not checkpoint.
      metrics.write(json.dumps(record) + "\n")
      metrics.flush()
      coordinator.save()
  summary = {
      "total_steps": config.total_steps, "rounds": coordinator.rounds_done,
      "final_eval_loss": evaluate(coordinator.x),
      "resumed": resumed,
      # Island-steps whose work reached x, of those possible, this run.
      "goodput": (tally.contributed / tally.possible if tally.possible
                  else None),
      # Where each island's data stream stands: after the batches it
      # contributed, none it trained in a round it was left out of.
      "data_states": coordinator.data_states,
      # What one island sent through the codec this run, counted as the
      # SPMD runs count it, and what all islands sent through Ray.
      "comm_bytes": tally.comm_bytes, "ray_bytes": tally.ray_bytes,
      # Where each island ran last (Ray node ids).
      "island_nodes": {str(i): node for i, node in sorted(nodes.items())},
      "wall_seconds": round(time.monotonic() - start_time, 3)}
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  return summary


def _keep_records_up_to(path: str, rounds_done: int) -> None:
  """Drops the records of rounds after the last checkpointed one (a rerun
  trains them again) and a line cut short, replacing the file in one
  rename."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  kept = []
  for line in lines:
    try:
      if json.loads(line)["round"] <= rounds_done:
        kept.append(line)
    except ValueError:  # the last line, cut short by the kill
      pass
  if len(kept) < len(lines):
    with open(path + ".partial", "w") as f:
      f.writelines(kept)
    os.replace(path + ".partial", path)


def _round_record(round_number: int, step: int, included: np.ndarray,
                  came_back: quorum.RoundResults) -> dict:
  """The round's line of metrics.jsonl, also said in the log."""
  results = came_back.results.values()
  record = {
      "round": round_number, "step": step,
      "included": included.astype(int).tolist(),
      "failed": came_back.failed, "late": came_back.late,
      "round_seconds": round(came_back.seconds, 3),
      "train_loss": (float(np.mean([r["losses"][-1] for r in results]))
                     if results else None)}
  logging.info("round %d: islands %s took part%s%s", round_number,
               record["included"],
               f"; failed {sorted(came_back.failed)}" if came_back.failed
               else "",
               f"; late {came_back.late}" if came_back.late else "")
  return record


def _train_call(program, rejoining: bool):
  """The island's train_round method for this round's call. An island
  whose process died is being restarted by Ray: its call waits for the
  restart (the round's quorum and grace window still decide whether it is
  in time); any other island's call fails at once if its process dies,
  leaving it out of the round."""
  return program.train_round.options(
      max_task_retries=-1 if rejoining else 0)


def _evaluator(run_config: run_config_lib.RunConfig):
  """eval(x) -> the mean eval loss of x on the run's held-out batches."""
  config = run_config.config
  # x is logical (whole layers, whatever the islands' stages): the
  # model's own loss, on one device.
  loss_fn = jax.jit(functools.partial(model_lib.next_token_loss,
                                      model_lib.graphdef(config.model)))
  batches = sources.make_eval_batches(run_config.data,
                                      config.eval.batch_size,
                                      config.eval.num_batches)
  return lambda x: float(np.mean([loss_fn(x, batch) for batch in batches]))
