"""train_and_evaluate: runs one configured training job.

The run reads as its steps: validate the config once (config/validation.py)
and claim the workdir; pretrain if asked (the DiLoCo paper's protocol);
build the mesh, data and state layout (setup.py); restore the newest
checkpoint or start fresh (start.py) while the programs compile from shapes
(compiled/programs.py); run the loop (loop.py); write the summary.

Modes share one loop: every mode takes inner steps on all islands at once;
`diloco` synchronizes as its schedule says (an outer step at the end of
each round of H steps, delayed by one round with one-step-delay overlap, or
Streaming DiLoCo's fragments); `ddp` averages gradients across islands
inside every inner step; `single` is one island on its own.

Runs are resumable and never lose work or report what did not happen:
rerunning the same command in the same workdir continues from the newest
readable checkpoint, replaying exactly what an uninterrupted run would do;
one run holds a workdir at a time (storage/workdir.py); a NaN or inf
stops the run or rolls it back and is never saved; SIGTERM and Ctrl-C save before exiting
(stops.py); any error waits for the checkpoint in flight; resuming under a
config that changes the run's meaning is refused (config/changes.py).
"""

import concurrent.futures
import json
import os
import time

import jax
from absl import logging

from diloco_jax.analysis import flops
from diloco_jax.analysis import workloads
from diloco_jax.compiled import background
from diloco_jax.config import changes as config_changes
from diloco_jax.config import run_config as run_config_lib
from diloco_jax.config import validation
from diloco_jax.data import sources
from diloco_jax.model import transformer as model_lib
from diloco_jax.parallel import outer_devices as outer_devices_lib
from diloco_jax.run import loop as loop_lib
from diloco_jax.run import setup as setup_lib
from diloco_jax.run import start as start_lib
from diloco_jax.run import stops
from diloco_jax.storage import checkpoints as checkpoints_lib
from diloco_jax.storage import files
from diloco_jax.storage import resume
from diloco_jax.storage import warm_start
from diloco_jax.storage import workdir as workdir_lib
from diloco_jax.telemetry import metrics_files as metrics_lib
from diloco_jax.telemetry import reports


def train_and_evaluate(config, workdir: str, devices=None,
                       launch_time: float | None = None,
                       started=None) -> dict:
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
    started: called (with no arguments, maybe more than once) when the run
      has started writing in its workdir: its state restored or made,
      config.json and the metrics files written (main.py prints its log
      lines from then on, so that a run refused before prints one line).

  Returns:
    The summary dict also written to `workdir/summary.json`.

  Raises:
    validation.ConfigError, workdir.WorkdirError, data.DataError,
    checkpoints.IncompatibleCheckpointError (resume.ConfigChangedError):
      before anything is compiled or written, where they can be known
      then.
    guards.NonFiniteError: NaN or inf under config.nonfinite='stop' (or
      after config.max_rollbacks rollbacks).
    stops.StopRequested: a signal stopped the run after saving.
  """
  launch_time = time.time() if launch_time is None else launch_time
  workdir_lib.refuse_url(workdir)  # before the data is read
  devices = jax.devices() if devices is None else list(devices)
  outer_devices = None
  if config.diloco.get("outer_placement") == "host":
    try:
      devices, outer_devices = outer_devices_lib.split_devices(
          devices, per_process=max(config.mesh.get("stage", 1), 1))
    except ValueError as e:
      raise validation.ConfigError(str(e)) from None
  run_config = validation.validate_config(config, num_devices=len(devices))
  if run_config.outer_step:
    logging.info("%s", run_config.outer_step)
  setup_lib.check_processes(run_config, devices)
  source = _warm_start_source(run_config, workdir)
  # Reads the data: what cannot be read is reported before the workdir is
  # claimed.
  setup = setup_lib.build(run_config, devices, outer_devices)
  claim = workdir_lib.claim(workdir, lock=jax.process_index() == 0)
  removed = False
  try:
    with stops.StopSignals() as signals:
      if config.pretrain_steps:
        source, launch_time = _pretrain(config, claim.workdir, devices,
                                        launch_time, started)
      return _train(setup, claim.workdir, launch_time, signals, source,
                    started)
  except files.StorageError as e:
    removed = e.removed  # maybe the whole workdir: see Claim.release
    raise
  finally:
    claim.release(after_a_removal=removed)


def _warm_start_source(run_config: run_config_lib.RunConfig,
                       workdir: str) -> warm_start.Source | None:
  """The checkpoint config.init_from names (None: none), checked cheaply
  before anything is written unless the run began already."""
  init_from = run_config.config.init_from
  if not init_from:
    return None
  source = warm_start.parse_source(init_from)
  if source.workdir == os.path.abspath(workdir):
    raise validation.ConfigError(
        f"config.init_from={init_from!r} is this run's own workdir; "
        "rerunning the command resumes it without init_from")
  if not warm_start.has_checkpoints(workdir):
    warm_start.check(source, run_config.config)
  return source


def _pretrain(config, workdir: str, devices, launch_time: float,
              started=None):
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
                               pretrain_dir, devices, launch_time,
                               started=started)
  logging.info("pretrained: eval loss %.4f at step %d; %s starts from it",
               summary["final_eval_loss"], config.pretrain_steps,
               config.mode)
  # workdir/metrics.jsonl starts with the pretraining's records, marked
  # phase 'pretrain', so one file holds the whole run (the main phase has
  # not checkpointed, so whatever it logged is taken again).
  metrics_lib.write_metrics(workdir, [
      {**record, "phase": "pretrain"}
      for record in metrics_lib.read_metrics(pretrain_dir)])
  return warm_start.Source(pretrain_dir), time.time()


def _close_after_error(checkpointer, writer, error: BaseException) -> None:
  """Waits for the checkpoint in flight so an error loses nothing saved.

  A failure of that save is logged, not raised: the error being handled is
  the one to report. After a failed write (files.StorageError) nothing
  more is waited for or written: the partial save is removed where it can
  be (orbax removes what is left when the run starts again).
  """
  if isinstance(error, files.StorageError):
    checkpointer.abandon()
  else:
    try:
      checkpointer.close()
    except Exception as e:  # pylint: disable=broad-except
      logging.error("the checkpoint being saved could not be finished: %s",
                    e)
      checkpointer.abandon()
  if writer is not None:
    try:
      writer.close()
    except files.StorageError as e:
      logging.error("%s", e)


def _train(setup: setup_lib.RunSetup, workdir: str, launch_time: float,
           signals: stops.StopSignals,
           source: warm_start.Source | None, started=None) -> dict:
  """train_and_evaluate's body, in a locked workdir with signals caught;
  a first start begins from `source`'s model when given; `started` as
  train_and_evaluate's."""
  wall_start = time.perf_counter()
  config = setup.config
  checkpointer = checkpoints_lib.Checkpointer(
      workdir, max_to_keep=config.checkpoint.max_to_keep,
      async_save=config.checkpoint.async_save)
  summary_path = os.path.join(workdir, "summary.json")
  writer = None
  try:
    # A warm start is read (and refused) before anything compiles.
    # The state loads (or initializes: a compile) in a thread, so a stop
    # signal meanwhile is answered at once.
    start = _until_stopped(background.submit(
        "start", lambda: (_resume(setup, checkpointer)
                          or start_lib.first_start(setup, source))), signals)
    if checkpointer.started_over_from:
      start.progress.started_over.append({
          str(step): why
          for step, why in checkpointer.started_over_from.items()})
    if (start.restored and start.step == config.total_steps
        and os.path.exists(summary_path)):
      logging.info("the run in %s already finished", workdir)
      checkpointer.close()
      with open(summary_path) as f:
        return json.load(f)
    # The programs compile from shapes in the background while the state is
    # laid out for the islands and the rest is set up.
    compiling = setup.compile_in_background()
    start.state = setup.islands_side(start.state)
    _prepare_workdir(setup, start, workdir)
    writer = metrics_lib.MetricsWriter(workdir, config.total_steps,
                                       config.log_every_seconds,
                                       setup.islands, start_step=start.step)
    if started is not None:
      started()
    loop = loop_lib.TrainingLoop(setup, start, checkpointer, writer, signals,
                                 source, launch_time)
    programs = _until_stopped(compiling, signals)
    _log_plan(setup, loop, programs, launch_time)
    finished = loop.run(programs)
    checkpointer.close()
    writer.close()
  except BaseException as error:
    _close_after_error(checkpointer, writer, error)
    raise
  finally:
    sources.close(setup.data.batches)  # a streamed corpus's read-ahead
  summary = _summary(setup, start, finished, programs.compile_s,
                     time.perf_counter() - wall_start, workdir)
  if jax.process_index() == 0:
    metrics_lib.write_json_atomically(summary_path, summary)
  logging.info("done: final eval loss %.4f, %.0f tokens/s, %.1f MB sent",
               finished.eval_loss, summary["tokens_per_s"],
               finished.progress.comm_bytes / 1e6)
  return summary


def _until_stopped(future: concurrent.futures.Future,
                   signals: stops.StopSignals):
  """`future`'s result once it is done; a stop signal meanwhile ends a
  one-process run at once, abandoning the work (loading the state or
  compiling, before the first step: there is nothing new to save). The
  processes of a multi-process run agree on a stop at their next step."""
  while True:
    try:
      return future.result(timeout=0.1)
    except concurrent.futures.TimeoutError:
      if signals.requested and jax.process_count() == 1:
        raise stops.StopRequested(signals.signal_name, 0,
                                  saved=False) from None


def _say_missing_metrics(start: start_lib.Start, workdir: str) -> None:
  """Warns in one line if metrics.jsonl lacks records of steps before the
  checkpoint resumed from (removed while no run held it): a resume does
  not take those steps again, so the gap stays."""
  source = start.progress.initialized_from  # the run's first step after it
  first = (source or {}).get("step", 0) + 1
  missing = metrics_lib.missing_steps(workdir, first, start.step)
  if missing:
    logging.warning(
        "%s lacks the records of steps %s, before the checkpoint at step %d "
        "this run resumes from; those steps are not taken again, so their "
        "records stay missing", os.path.join(workdir, "metrics.jsonl"),
        metrics_lib.describe_ranges(missing), start.step)


def _prepare_workdir(setup: setup_lib.RunSetup, start: start_lib.Start,
                     workdir: str) -> None:
  """Waits for the start's state, drops the metrics logged after it, puts
  the data streams where it left them and records the config."""
  phase_start = time.perf_counter()
  jax.block_until_ready(start.state)
  logging.info("state %s in %.1fs",
               "restored" if start.restored else "initialized",
               time.perf_counter() - phase_start)
  dropped = metrics_lib.truncate_metrics(workdir, start.step)
  if dropped:
    logging.info("dropped %d metrics records logged after step %d; they are "
                 "taken again", dropped, start.step)
  if start.restored:
    _say_missing_metrics(start, workdir)
  resume.restore_data_positions(setup.data.batches, start.meta, setup.islands)
  if jax.process_index() == 0:
    metrics_lib.write_json_atomically(os.path.join(workdir, "config.json"),
                                      resume.config_record(setup.config))


def _resume(setup: setup_lib.RunSetup, checkpointer) -> start_lib.Start | None:
  """The run's newest readable checkpoint (None: none), with the config
  changes resume.allow_changes let through logged and counted."""
  config = setup.config
  start = start_lib.restore(setup, checkpointer)
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


def _log_plan(setup: setup_lib.RunSetup, loop, programs,
              launch_time: float) -> None:
  config = setup.config
  logging.info("compiled in %.1fs, %.1fs after launch", programs.compile_s,
               time.time() - launch_time)
  logging.info("mode=%s islands=%d H=%d params=%s tokens/step=%d sync=%.2fMB",
               config.mode, setup.islands,
               setup.run_config.diloco.inner_steps,
               f"{setup.num_params:,}",
               setup.islands * config.data.batch_size
               * config.data.sequence_length, loop.sync_bytes() / 1e6)
  logging.info("placement: %s; attention: %s", setup.describe_placement(),
               model_lib.attention_implementation(config.model))
  if setup.host_outer is not None:
    logging.info("outer step on its own device(s): %s", ", ".join(
        str(d) for d in setup.host_outer.mesh.devices.flat))


def _summary(setup: setup_lib.RunSetup, start: start_lib.Start,
             finished: loop_lib.Finished, compile_s: float, wall_s: float,
             workdir: str) -> dict:
  """The run's summary, with the network model's estimate for the step
  time measured: this process's steps, or, resumed at the end (a run
  killed before its summary), the steps metrics.jsonl timed."""
  config = setup.config
  if finished.steps_taken:
    timed = (finished.steps_taken,
             finished.progress.tokens_seen - finished.start_tokens,
             finished.train_s)
  else:
    timed = reports.timed_steps(metrics_lib.read_metrics(workdir))
  flops_per_token = flops.training_flops_per_token(
      config.model, config.data.sequence_length)
  summary = reports.summary(
      setup.run_config, finished.progress, num_params=setup.num_params,
      start_step=start.step, timed=timed,
      timings={"compile_s": compile_s, "startup_s": finished.startup_s,
               "train_s": finished.train_s, "wall_s": wall_s,
               "data_wait_s": finished.data_wait_s},
      flops_per_token=flops_per_token, mesh=setup.mesh,
      eval_loss=finished.eval_loss,
      island_mean_loss=finished.island_mean_loss,
      entropy_rate=setup.data.batches.info.entropy_rate)
  steps, _, seconds = timed
  if steps:
    summary.update(workloads.run_estimate(
        config, step_time_s=seconds / steps,
        bandwidth_bits_per_s=config.network.bandwidth_bits_per_s,
        latency_s=config.network.latency_s,
        params=setup.abstract_state.global_params))
  return summary
