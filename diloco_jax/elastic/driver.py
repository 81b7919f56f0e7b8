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
from diloco_jax.elastic import fleet as fleet_lib
from diloco_jax.elastic import membership
from diloco_jax.elastic import quorum
from diloco_jax.elastic import round_steps
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


def _train(run_config, settings, coordinator, evaluate, workdir,
           resumed) -> dict:
  config = run_config.config
  slots = run_config.islands
  # Each round's last step: every H steps, or under streaming each
  # fragment's send (round_steps.py).
  ends = round_steps.round_ends(run_config)
  rounds = len(ends)
  fleet = fleet_lib.Fleet(run_config, settings, workdir)
  tally = _Tally()
  start_time = time.monotonic()
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  _keep_records_up_to(metrics_path, coordinator.rounds_done)
  with open(metrics_path, "a") as metrics:
    while coordinator.rounds_done < rounds:
      round_number = coordinator.rounds_done + 1
      first_step = ends[round_number - 2] if round_number > 1 else 0
      steps = ends[round_number - 1] - first_step
      members, problem = membership.members(
          workdir, slots, run_config.diloco.island_schedule,
          round_number - 1, rounds)
      if problem:
        logging.warning("%s", problem)
      joined, left = fleet.set_members(members)
      calls = fleet.start_round(_start_refs(coordinator, members),
                                round_number, coordinator.data_states,
                                steps, first_step)
      came_back = quorum.collect(calls, settings.min_islands,
                                 settings.grace_seconds)
      included = coordinator.close_round(came_back.results, round_number)
      fleet.settle(came_back, included, round_number)
      # Island-steps this round's calls set out to run, and those whose
      # work reached x (a late result's counted in the round it lands in).
      run_steps = fleet.new_calls(round_number) * steps
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
      if round_number == rounds:
        # The mean still in flight applied, or eager islands settled,
        # before the last round's eval (as the SPMD runs do); checkpointed
        # with the round.
        coordinator.finish()
      # Evaluated where the SPMD runs evaluate: the ends of every
      # eval.every_rounds-th run's round, and the last step.
      if run_config.schedule.evaluates(first_step + steps):
        record["eval_loss"] = evaluate(coordinator.model())
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
      "island_nodes": {str(i): node
                       for i, node in sorted(fleet.nodes.items())},
      "wall_seconds": round(time.monotonic() - start_time, 3)}
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  return summary


def _start_refs(coordinator, members: list[int]) -> dict:
  """island -> the Ray object its round starts from: x put once for all,
  or each member's own point."""
  if coordinator.shared_start:
    x = ray.put(coordinator.x)
    return {i: x for i in members}
  return {i: ray.put(coordinator.start(i)) for i in members}


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
