"""train_and_evaluate: runs one configured training job.

Modes share one loop (loop.py): every mode takes inner steps on all islands
at once; `diloco` synchronizes as its schedule says (schedule.py: an outer
step at the end of each round of H steps, delayed by one round with
one-step-delay overlap, or Streaming DiLoCo's fragments); `ddp` averages
gradients across islands inside every inner step; `single` is one island on
its own. The programs compile from shapes while the state is initialized or
restored (programs.py, run_setup.py), and per-step metrics are fetched one
step late so the host never waits on the device.

Runs are resumable: the state is checkpointed (see checkpointing.py) and
rerunning the same command in the same workdir continues from the newest
readable checkpoint, replaying exactly what an uninterrupted run would do.

Runs never lose work or report what did not happen: one run holds a workdir
at a time (workdir.py); a NaN or inf stops the run or rolls it back
(guards.py) and is never saved; SIGTERM and Ctrl-C save before exiting
(stops.py); any error waits for the checkpoint in flight; resuming under a
config that changes the run's meaning is refused (config_changes.py).
"""

import json
import os
import time

import jax
from absl import logging

from diloco_jax.run import checkpoints as checkpointing
from diloco_jax.config import changes as config_changes
from diloco_jax.analysis import flops
from diloco_jax.run import loop as loop_lib
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.run import metrics as metrics_lib
from diloco_jax.model import transformer as model_lib
from diloco_jax.parallel import multihost
from diloco_jax.analysis import workloads
from diloco_jax.parallel import outer_devices as outer_devices_lib
from diloco_jax.run import records
from diloco_jax.run import resume
from diloco_jax.run import setup as run_setup
from diloco_jax.run import stops
from diloco_jax.config import validation
from diloco_jax.run import warm_start
from diloco_jax.run import workdir as workdir_lib


def train_and_evaluate(config, workdir: str, devices=None,
                       launch_time: float | None = None) -> dict:
  """Trains as `config` says, writing metrics, checkpoints and a summary.

  Rerunning with the same workdir resumes from the newest checkpoint; a run
  that already finished returns its summary. The workdir is locked for the
  call's duration; SIGTERM and SIGINT (in the main thread) end the run at
  the next step with a checkpoint and StopRequested.

  Args:
    config: a config built from config_schema.base_config().
    workdir: where outputs and checkpoints go.
    devices: the devices to place islands on (default: all). Islands fold
      onto them: d of the k islands' slots, d the largest divisor of k that
      fits, each slot holding k / d islands.
    launch_time: time.time() when the process started, for `startup_s`
      (default: when this function was called).

  Returns:
    The summary dict also written to `workdir/summary.json`.

  Raises:
    validation.ConfigError, workdir.WorkdirError, data.DataError,
    checkpointing.IncompatibleCheckpointError (resume.ConfigChangedError):
      before anything is compiled or written, where they can be known
      then.
    guards.NonFiniteError: NaN or inf under config.nonfinite='stop' (or
      after config.max_rollbacks rollbacks).
    stops.StopRequested: a signal stopped the run after saving.
  """
  launch_time = time.time() if launch_time is None else launch_time
  devices = jax.devices() if devices is None else list(devices)
  outer_devices = None
  if config.diloco.get("outer_placement") == "host":
    try:
      devices, outer_devices = outer_devices_lib.split_devices(devices)
    except ValueError as e:
      raise validation.ConfigError(str(e)) from None
  validation.validate_config(config, num_devices=len(devices))
  _check_every_process_holds_islands(config, devices)
  source = (warm_start.parse_source(config.init_from) if config.init_from
            else None)
  if source is not None and source.workdir == os.path.abspath(workdir):
    raise validation.ConfigError(
        f"config.init_from={config.init_from!r} is this run's own workdir; "
        "rerunning the command resumes it without init_from")
  if source is not None and not warm_start.has_checkpoints(workdir):
    warm_start.check(source, config)
  workdir, lock = workdir_lib.claim(workdir,
                                    lock=jax.process_index() == 0)
  try:
    with stops.StopSignals() as signals:
      if config.pretrain_steps:
        source, launch_time = _pretrain(config, workdir, devices,
                                        launch_time)
      return _train(config, workdir, devices, launch_time, signals, source,
                    outer_devices)
  finally:
    if lock is not None:
      lock.release()


def _check_every_process_holds_islands(config, devices) -> None:
  """ConfigError (on every process alike) if a process of a multi-process
  run would have no device in the mesh of the run or of its pretraining."""
  if jax.process_count() == 1:
    return
  islands = validation.effective_islands(config)
  mesh = mesh_lib.build_mesh(islands, config.mesh.data, config.mesh.stage,
                             devices)
  idle = multihost.idle_processes(mesh)
  if idle:
    raise validation.ConfigError(
        f"{islands} island(s) x mesh.data={config.mesh.data} x mesh.stage="
        f"{config.mesh.stage} use {mesh.devices.size} of the "
        f"{len(devices)} devices, leaving process(es) {idle} of "
        f"{jax.process_count()} without any: use more islands or spread "
        "each island over the processes with config.mesh.data")
  split = (outer_devices_lib.islands_across_processes(mesh)
           if config.diloco.outer_placement == "host" and config.mesh.fsdp
           else [])
  if split:
    raise validation.ConfigError(
        "config.diloco.outer_placement='host' with config.mesh.fsdp gathers "
        "each island on its own process's outer device, but island slot(s) "
        f"{split} span processes (config.mesh.data={config.mesh.data}); "
        "keep each island's devices in one process, or use "
        "outer_placement='device'")
  if config.pretrain_steps and len(multihost.idle_processes(
      mesh_lib.build_mesh(1, config.mesh.data, config.mesh.stage,
                          devices))):
    raise validation.ConfigError(
        f"config.pretrain_steps={config.pretrain_steps}: the pretraining is "
        f"one worker, on mesh.data x mesh.stage = {config.mesh.data} x "
        f"{config.mesh.stage} devices, which leaves processes of this "
        f"{jax.process_count()}-process run idle; pretrain in a run of its "
        "own (e.g. one process, config.mode=single) and start this one "
        "from it with config.init_from=THAT_WORKDIR")


def _pretrain(config, workdir: str, devices, launch_time: float):
  """Runs (or resumes) the pretraining phase unless the main phase began.

  Returns:
    (the Source the main phase starts from, the main phase's launch time).
  """
  pretrain_dir = warm_start.pretrain_workdir(workdir)
  if warm_start.has_checkpoints(workdir):  # the main phase began
    return warm_start.Source(pretrain_dir), launch_time
  logging.info("pretraining: steps 1..%d as one worker in %s",
               config.pretrain_steps, pretrain_dir)
  summary = train_and_evaluate(warm_start.pretrain_config(config),
                               pretrain_dir, devices, launch_time)
  logging.info("pretrained: eval loss %.4f at step %d; %s starts from it",
               summary["final_eval_loss"], config.pretrain_steps,
               config.mode)
  _mark_pretrain_metrics(pretrain_dir, workdir)
  return warm_start.Source(pretrain_dir), time.time()


def _mark_pretrain_metrics(pretrain_dir: str, workdir: str) -> None:
  """Starts workdir/metrics.jsonl with the pretraining records, marked
  phase 'pretrain', so one file holds the whole run (the main phase has
  not checkpointed, so whatever it logged is taken again)."""
  records = [{**record, "phase": "pretrain"}
             for record in metrics_lib.read_metrics(pretrain_dir)]
  metrics_lib.write_metrics(workdir, records)


def _close_after_error(checkpointer, writer) -> None:
  """Waits for the checkpoint in flight so an error loses nothing saved.

  A failure of that save is logged, not raised: the error being handled is
  the one to report.
  """
  try:
    checkpointer.close()
  except Exception as e:  # pylint: disable=broad-except
    logging.error("the checkpoint being saved could not be finished: %s", e)
  if writer is not None:
    writer.close()


def _train(config, workdir: str, devices, launch_time: float,
           signals: stops.StopSignals,
           source: warm_start.Source | None, outer_devices=None) -> dict:
  """train_and_evaluate's body, in a locked workdir with signals caught;
  a first start begins from `source`'s model when given; with
  `outer_devices` (outer_placement='host') the outer step runs there."""
  wall_start = time.perf_counter()
  setup = run_setup.build(config, devices, outer_devices)
  phase_start = time.perf_counter()
  checkpointer = checkpointing.Checkpointer(
      workdir, max_to_keep=config.checkpoint.max_to_keep,
      async_save=config.checkpoint.async_save)
  summary_path = os.path.join(workdir, "summary.json")
  writer = None
  try:
    # A warm start is read (and refused) before anything compiles.
    start = _resume(config, setup, checkpointer) or setup.first_start(source)
    start.state = setup.islands_side(start.state)
    if (start.restored and start.step == config.total_steps
        and os.path.exists(summary_path)):
      logging.info("the run in %s already finished", workdir)
      checkpointer.close()
      with open(summary_path) as f:
        return json.load(f)
    # The programs compile from shapes in the background while the state is
    # initialized and the rest is set up.
    compiling = setup.compile_in_background()
    jax.block_until_ready(start.state)
    logging.info("state %s in %.1fs",
                 "restored" if start.restored else "initialized",
                 time.perf_counter() - phase_start)
    dropped = metrics_lib.truncate_metrics(workdir, start.step)
    if dropped:
      logging.info("dropped %d metrics records logged after step %d; they are "
                   "taken again", dropped, start.step)
    resume.restore_data_positions(setup.batches, start.meta, setup.islands)
    if jax.process_index() == 0:
      metrics_lib.write_json_atomically(os.path.join(workdir, "config.json"),
                                        resume.config_record(config))
    writer = metrics_lib.MetricsWriter(workdir, config.total_steps,
                                       config.log_every_seconds,
                                       setup.islands)
    loop = loop_lib.TrainingLoop(setup, start, checkpointer, writer, signals,
                                 source, launch_time)
    programs = compiling.result()
    _log_plan(config, setup, loop, programs, launch_time)
    finished = loop.run(programs)
    checkpointer.close()
    writer.close()
  except BaseException:
    _close_after_error(checkpointer, writer)
    raise
  summary = _summary(config, setup, start, finished, programs.compile_s,
                     time.perf_counter() - wall_start)
  if jax.process_index() == 0:
    metrics_lib.write_json_atomically(summary_path, summary)
  logging.info("done: final eval loss %.4f, %.0f tokens/s, %.1f MB sent",
               finished.eval_loss, summary["tokens_per_s"],
               finished.progress.comm_bytes / 1e6)
  return summary


def _resume(config, setup: run_setup.RunSetup,
            checkpointer) -> run_setup.Start | None:
  """The run's newest readable checkpoint (None: none), with the config
  changes resume.allow_changes let through logged and counted."""
  start = setup.restore(checkpointer)
  if start is None:
    return None
  if start.step > config.total_steps:
    raise validation.ConfigError(
        f"config.total_steps={config.total_steps} is before the checkpoint "
        f"at step {start.step} in {checkpointer.directory}")
  logging.info("resuming from the checkpoint at step %d", start.step)
  if "config" in start.meta:
    changed = config_changes.changes(start.meta["config"],
                                     resume.config_record(config))
    if changed:
      logging.warning("resuming with config changes allowed by "
                      "config.resume.allow_changes: %s",
                      config_changes.describe(changed))
      start.progress.config_changes += [{"step": start.step, **c}
                                        for c in changed]
  return start


def _log_plan(config, setup: run_setup.RunSetup, loop, programs,
              launch_time: float) -> None:
  logging.info("compiled in %.1fs, %.1fs after launch", programs.compile_s,
               time.time() - launch_time)
  logging.info("mode=%s islands=%d H=%d params=%s tokens/step=%d sync=%.2fMB",
               config.mode, setup.islands, config.diloco.inner_steps,
               f"{setup.num_params:,}",
               setup.islands * config.data.batch_size
               * config.data.sequence_length, loop.sync_bytes() / 1e6)
  logging.info("placement: %s; attention: %s", setup.describe_placement(),
               model_lib.attention_implementation(config.model))
  if setup.host_outer is not None:
    logging.info("outer step on its own device(s): %s", ", ".join(
        str(d) for d in setup.host_outer.mesh.devices.flat))


def _summary(config, setup: run_setup.RunSetup, start: run_setup.Start,
             finished: loop_lib.Finished, compile_s: float,
             wall_s: float) -> dict:
  """The run's summary, with the network model's estimate for the step
  time this process measured."""
  flops_per_token = flops.training_flops_per_token(
      config.model, config.data.sequence_length)
  summary = records.summary(
      config, finished.progress, num_params=setup.num_params,
      start_step=start.step, start_tokens=finished.start_tokens,
      timings={"compile_s": compile_s, "startup_s": finished.startup_s,
               "train_s": finished.train_s, "wall_s": wall_s},
      flops_per_token=flops_per_token, mesh=setup.mesh,
      eval_loss=finished.eval_loss,
      island_mean_loss=finished.island_mean_loss,
      entropy_rate=setup.batches.info.entropy_rate)
  if finished.steps_taken:  # the step time of this process's steps
    summary.update(workloads.run_estimate(
        config, step_time_s=finished.train_s / finished.steps_taken,
        bandwidth_bits_per_s=config.network.bandwidth_bits_per_s,
        latency_s=config.network.latency_s,
        params=setup.abstract_state.global_params))
  return summary
