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

from diloco_jax.config import problems as problems_lib
from diloco_jax.config import run_config as run_config_lib
from diloco_jax.data import sources
from diloco_jax.elastic import arrivals
from diloco_jax.elastic import coordinator as coordinator_lib
from diloco_jax.elastic import fleet as fleet_lib
from diloco_jax.elastic import island_nodes
from diloco_jax.elastic import membership
from diloco_jax.elastic import ray_watch
from diloco_jax.elastic import round_records
from diloco_jax.elastic import round_steps
from diloco_jax.elastic import rounds as rounds_lib
from diloco_jax.elastic import settings as settings_lib
from diloco_jax.elastic import speeds
from diloco_jax.model import transformer as model_lib
from diloco_jax.storage import workdir as workdir_lib


# The key run() adds to the summary it returns (not to summary.json) for
# a run that had finished already.
ALREADY_FINISHED = "already_finished"


def run(run_config: run_config_lib.RunConfig, workdir: str,
        ray_address: str | None = None) -> dict:
  """Trains `run_config` on elastic islands; returns the summary written to
  workdir/summary.json. `ray_address`: a running Ray cluster's, or None to
  start one on this machine (bound to 127.0.0.1).

  The workdir is locked for the call (storage/workdir.py's claim: a second
  coordinator on it is refused with workdir.WorkdirError before it writes
  anything; the lock goes with the process however it ends). A run that
  finished already (its last round checkpointed, its summary written) is
  left as it is: its summary is returned, with ALREADY_FINISHED: True."""
  settings = settings_lib.check(run_config)
  if settings.link_mbit and ray_address is not None:
    raise problems_lib.ConfigError(
        f"config.elastic.link_mbit={settings.link_mbit:g} with "
        f"--ray_address={ray_address!r}: shaped links put each island on a "
        "Ray node this run starts on this machine; leave --ray_address out, "
        "or shape the links between your cluster's hosts yourself")
  if ray_address not in (None, "auto"):
    settings_lib.check_answers(ray_address)
  claim = workdir_lib.claim(str(pathlib.Path(workdir).resolve()),
                            checkpoints=_CHECKPOINTS)
  try:
    workdir = claim.workdir
    finished = _finished_summary(run_config, workdir)
    if finished is not None:
      return {**finished, ALREADY_FINISHED: True}
    return _run_on_ray(run_config, settings, workdir, ray_address)
  finally:
    claim.release()


def _run_on_ray(run_config, settings, workdir, ray_address) -> dict:
  # Ray starts its processes by forking: before this process starts JAX's
  # threads (forking a multithreaded process can deadlock the child).
  started_ray = not ray.is_initialized()
  watch = nodes = None
  if started_ray:
    if settings.link_mbit:  # each island its own node behind its link
      nodes = island_nodes.IslandNodes(run_config.islands, settings.link_mbit,
                                       settings.link_delay_ms).create()
    # Pinned islands on this run's own Ray: this node offers every slot
    # (but those of island nodes).
    own = ({fleet_lib.island_resource(i): 1
            for i in range(run_config.islands)}
           if settings.pin_islands and ray_address is None and nodes is None
           else None)
    try:
      # "local": a Ray of this run's own, never one a `ray start` on this
      # machine left in /tmp/ray/ray_current_cluster (Ray's default).
      ray.init(address=ray_address or "local", include_dashboard=False,
               configure_logging=False, resources=own,
               _node_ip_address=None if nodes is None else nodes.head_address)
    except BaseException:
      if nodes is not None:
        nodes.close()
      raise
    if ray_address is None:
      # This run's own Ray: every process of it ends within a second of
      # this one, however this one ends (ray_watch.py).
      context = ray.get_runtime_context()
      watch = ray_watch.start(
          os.path.join(context.get_temp_dir(), context.get_session_name()),
          *(() if nodes is None else (nodes.nodes_dir, nodes.network.ns,
                                      nodes.network.bridge)))
  coordinator = None
  try:
    if nodes is not None:
      nodes.join(ray.get_runtime_context().gcs_address)
    unplaceable = (fleet_lib.unplaceable_islands(run_config.islands)
                   if settings.pin_islands else [])
    if unplaceable:
      raise problems_lib.ConfigError(
          f"config.elastic.pin_islands=True but no node of the Ray cluster "
          f"offers {fleet_lib.island_resource(unplaceable[0])} (islands "
          f"{unplaceable} would wait forever): start the host meant for "
          f"island {unplaceable[0]} with ray start --resources="
          f"'{{\"{fleet_lib.island_resource(unplaceable[0])}\": 1}}'")
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(run_config.config.to_json_best_effort(indent=2))
    coordinator = coordinator_lib.Coordinator(run_config, workdir)
    resumed = coordinator.restore()
    return _train(run_config, settings, coordinator,
                  _evaluator(run_config), workdir, resumed, links=nodes)
  finally:
    if coordinator is not None:
      coordinator.close()
    if started_ray:
      ray.shutdown()
    if nodes is not None:
      nodes.close()
    if watch is not None:
      ray_watch.stop(watch)


# Where the coordinator checkpoints, in the workdir (coordinator.py).
_CHECKPOINTS = "coordinator"


def _finished_summary(run_config, workdir: str) -> dict | None:
  """The summary of the run in `workdir` if it finished already: written
  for this config's rounds, with the last round's checkpoint beside it.
  (A summary whose goodput is null, as a rerun of a finished run wrote it
  before that was fixed, is written again.)"""
  try:
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
  except (OSError, ValueError):
    return None
  rounds = len(round_steps.round_ends(run_config))
  if (isinstance(summary, dict) and summary.get("rounds") == rounds
      and summary.get("total_steps") == run_config.config.total_steps
      and summary.get("goodput") is not None
      and os.path.isdir(os.path.join(workdir, _CHECKPOINTS, str(rounds)))):
    return summary
  return None


@dataclasses.dataclass
class _Tally:
  """What the run's rounds added up to (island-steps, bytes), over every
  command that ran them: checkpointed with each round."""
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


def _restored_tally(coordinator, metrics_path: str) -> _Tally:
  """The tally of the rounds the coordinator restored: from its
  checkpoint, or, from a checkpoint written before the tally was kept,
  the island-steps of their records in metrics.jsonl (the bytes then
  count from this command on)."""
  if coordinator.counters is not None:
    return _Tally(**coordinator.counters["tally"])
  tally = _Tally()
  if os.path.exists(metrics_path):
    with open(metrics_path) as f:
      for line in f:
        steps = json.loads(line).get("island_steps") if line.strip() else None
        if steps:
          tally.add(steps["run"], steps["applied"], 0, 0)
  return tally


def _train(run_config, settings, coordinator, evaluate, workdir,
           resumed, links=None) -> dict:
  slots = run_config.islands
  # Each round's last step: every H steps, or under streaming each
  # fragment's send (round_steps.py).
  ends = round_steps.round_ends(run_config)
  rounds = len(ends)
  fleet = fleet_lib.Fleet(run_config, settings, workdir)
  members_of = membership.Members(
      workdir, slots, run_config.diloco.island_schedule, rounds)
  round_steps_of = speeds.RoundSteps(settings.round_budget)
  start_time = time.monotonic()
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  round_records.keep_records_up_to(metrics_path, coordinator.rounds_done)
  tally = _restored_tally(coordinator, metrics_path)
  # Where each island ran last, over the run's commands.
  nodes = dict((coordinator.counters or {}).get("island_nodes", {}))
  rounds_of = (
      arrivals.ArrivalRounds(coordinator, fleet, round_steps_of, slots,
                             rounds) if settings.asynchronous
      else rounds_lib.QuorumRounds(coordinator, fleet, round_steps_of,
                                   settings, ends))
  # Asynchronous islands train on while a window is evaluated and
  # checkpointed: that work goes to a thread of its own.
  closer = round_records.Closer(background=settings.asynchronous)
  with open(metrics_path, "a") as metrics:
    try:
      while coordinator.rounds_done < rounds:
        round_number = coordinator.rounds_done + 1
        first_step = ends[round_number - 2] if round_number > 1 else 0
        steps = ends[round_number - 1] - first_step
        members, problem = members_of.of_round(round_number - 1)
        if problem:  # once per bad content of the control file
          logging.warning("%s", problem)
        joined, left = fleet.set_members(members)
        closed = rounds_of.run(round_number, members, first_step, steps)
        tally.add(closed.run_steps, closed.applied_steps,
                  coordinator.round_bytes, closed.sent_bytes)
        record = round_records.round_record(
            round_number, first_step + steps, closed.included,
            closed.came_back)
        record.update(closed.record)
        record.update(
            members=members, joined=joined, left=left,
            pipelined=rounds_of.pipelined,
            island_steps={"run": closed.run_steps,
                          "applied": closed.applied_steps},
            seconds_per_step={i: round(s, 6) for i, s in
                              round_steps_of.seconds_per_step.items()},
            # Which process each member is: pid, host, IP, Ray node,
            # restarts.
            processes=fleet.processes)
        if links is not None:  # behind shaped links: what crossed them
          record["link_bytes"] = links.link_bytes()
        if round_number == rounds:
          # The mean still in flight applied, or eager islands settled,
          # before the last round's eval (as the SPMD runs do);
          # checkpointed with the round.
          coordinator.finish()
        # Evaluated where the SPMD runs evaluate: the ends of every
        # eval.every_rounds-th run's round, and the last step.
        model = (coordinator.model()
                 if run_config.schedule.evaluates(first_step + steps)
                 else None)
        nodes.update({str(i): node for i, node in fleet.nodes.items()})
        coordinator.counters = {"tally": dataclasses.asdict(tally),
                                "island_nodes": dict(nodes)}
        closer.submit(round_records.write_and_save, metrics, record, model,
                      evaluate, coordinator, coordinator.snapshot())
    finally:
      closer.wait()
  summary = _summary(run_config, coordinator, evaluate, resumed, tally,
                     nodes, time.monotonic() - start_time)
  if links is not None:  # where the island nodes ran, removed at the end
    summary["links"] = {"mbit": links.mbit, "delay_ms": links.delay_ms,
                        "namespaces": links.network.ns,
                        "nodes_dir": links.nodes_dir}
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  return summary


def _summary(run_config, coordinator, evaluate, resumed, tally: _Tally,
             nodes: dict, seconds: float) -> dict:
  """The run's summary.json."""
  return {
      "total_steps": run_config.config.total_steps,
      "rounds": coordinator.rounds_done,
      "final_eval_loss": evaluate(coordinator.x),
      "resumed": resumed,
      # Island-steps whose work reached x, of those the rounds' calls set
      # out to run, over the whole run (every command's rounds).
      "goodput": (tally.contributed / tally.possible if tally.possible
                  else None),
      # Where each island's data stream stands: after the batches it
      # contributed, none it trained in a round it was left out of.
      "data_states": coordinator.data_states,
      # What one island sent through the codec over the run, counted as
      # the SPMD runs count it, and what all islands sent through Ray.
      "comm_bytes": tally.comm_bytes, "ray_bytes": tally.ray_bytes,
      # Where each island ran last (Ray node ids).
      "island_nodes": dict(sorted(nodes.items(), key=lambda n: int(n[0]))),
      "wall_seconds": round(seconds, 3)}


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
