"""The training loop: a run's inner steps and, after each, what its
schedule says (synchronizations, evaluation, a checkpoint).

`TrainingLoop.run` is the page to read: a loop over the steps, each one an
inner step on every island, then the schedule's syncs (syncs.py), its
record (step_exchange.py, finished a step late so the host queues the next
step before it waits on the last one), an evaluation and a checkpoint when
they are due. A NaN or inf rolls the run back to its last checkpoint or
stops it, and a signal stops it at the next step with a checkpoint
(rollback.py).
"""

import dataclasses
import math
import time

import jax
import numpy as np
from absl import logging

from diloco_jax.algorithm import guards
from diloco_jax.algorithm import optimizers
from diloco_jax.algorithm import state as state_lib
from diloco_jax.config import run_config as run_config_lib
from diloco_jax.data import errors as data_errors
from diloco_jax.data import read_ahead
from diloco_jax.data import sources
from diloco_jax.parallel import multihost
from diloco_jax.run import rollback
from diloco_jax.run import setup as setup_lib
from diloco_jax.run import start as start_lib
from diloco_jax.run import step_exchange
from diloco_jax.run import stops
from diloco_jax.run import syncs as syncs_lib
from diloco_jax.storage import checkpoints as checkpoints_lib
from diloco_jax.storage import layout_records
from diloco_jax.storage import resume
from diloco_jax.telemetry import counters as progress_lib
from diloco_jax.telemetry import reports
from diloco_jax.telemetry import rising_loss


@dataclasses.dataclass(frozen=True)
class Finished:
  """What a loop that reached config.total_steps leaves.

  Attributes:
    state: the islands' side of the final state.
    progress: the run's counters.
    steps_taken: the steps this process took (0 when resumed at the end).
    start_tokens: progress.tokens_seen when this process began.
    eval_loss: the final eval loss.
    island_mean_loss: the islands' average's eval loss
      (config.eval.island_mean), else None.
    startup_s: launch to the first inner step's result (None: no step).
    train_s: the loop's wall-clock.
    data_wait_s: of train_s, the time spent waiting for batches.
  """
  state: state_lib.TrainState
  progress: progress_lib.Progress
  steps_taken: int
  start_tokens: int
  eval_loss: float
  island_mean_loss: float | None
  startup_s: float | None
  train_s: float
  data_wait_s: float


class BatchFeed:
  """The training batches, each placed on the devices a step ahead.

  A wait for a batch ends early when a stop is requested (the batch is
  then not taken: the loop stops first), and a source that fails while
  the next batch is prepared (a DataError: a stalled read, a file gone or
  changed) keeps the error in `failure` until the step in flight is done,
  so the loop can save that step before it raises it.

  Attributes:
    position: the data streams' state after the last batch taken (what a
      checkpoint saves).
    waited_s: seconds the loop spent in the source's next_batch since
      `start_clock` (waiting for data, not computing).
    failure: the DataError that preparing the next batch raised, if any.
  """

  def __init__(self, setup: setup_lib.RunSetup, signals):
    self._setup = setup
    self.waited_s = 0.0
    self.failure = None
    self.position = setup.data.batches.state()
    sources.interrupt_waits(setup.data.batches, lambda: signals.requested)
    self._next = None
    self.prepare()

  def start_clock(self) -> None:
    """Counts waits from now: the first batch was read while the
    programs compiled."""
    self.waited_s = 0.0

  def _place_next(self) -> jax.Array:
    start = time.perf_counter()
    try:
      batch = self._setup.data.batches.next_batch()
    finally:
      self.waited_s += time.perf_counter() - start
    return self._setup.place_batch(batch)

  def take(self) -> jax.Array:
    """The prepared batch (or, when it went to a step rolled back, the
    stream's next).

    Raises:
      read_ahead.WaitInterrupted: a stop was requested while it waited.
      DataError: the source failed.
    """
    if self.failure is not None:
      raise self.failure
    batch = self._next if self._next is not None else self._place_next()
    self._next = None
    self.position = self._setup.data.batches.state()
    return batch

  def prepare(self) -> None:
    """Places the next batch while the device computes."""
    try:
      self._next = self._place_next()
    except read_ahead.WaitInterrupted:
      self._next = None  # the loop stops before it needs one
    except data_errors.DataError as error:
      self._next, self.failure = None, error


class TrainingLoop:
  """Takes a run from its Start to config.total_steps.

  Construct it while the programs compile: it places the eval batches and
  the first training batch. Then `run(programs)`.
  """

  def __init__(self, setup: setup_lib.RunSetup, start: start_lib.Start,
               checkpointer: checkpoints_lib.Checkpointer, writer, signals,
               source, launch_time: float):
    """`start.state` is the islands' side (setup.islands_side); `source`
    is where a rollback with no checkpoint starts again (None: fresh
    params)."""
    config, diloco = setup.config, setup.run_config.diloco
    self._setup, self._config = setup, config
    self._rising_loss = rising_loss.RisingLossWatch(
        diloco.overlap_mode, diloco.outer_optimizer)
    self._checkpointer, self._writer = checkpointer, writer
    self._signals, self._source = signals, source
    self._launch_time = launch_time
    self._syncs = syncs_lib.Syncs(setup)
    self._records = step_exchange.StepRecords(writer, signals,
                                             config.mode == "diloco")
    self._learning_rates = optimizers.learning_rate_table(
        run_config_lib.inner_optimizer(config.inner_optimizer),
        config.total_steps)
    self._tokens_per_island_step = (config.data.batch_size
                                    * config.data.sequence_length)
    # What every checkpoint saves beside the state.
    self._checkpoint_meta = {
        "param_shapes": layout_records.param_shapes_record(
            setup.abstract_state.global_params),
        "state_layout": layout_records.state_layout_record(
            setup.abstract_state),
        "config": resume.config_record(config),
    }
    self._start_step = start.step
    self.state, self.progress = start.state, start.progress
    # The newest step this run's checkpoints hold (None: none yet).
    self.saved_step = start.step if start.restored else None
    self._eval_arrays = [multihost.place(b, setup.eval_shape.sharding)
                         for b in setup.data.eval_set]
    self._batches = BatchFeed(setup, signals)
    self._eval_loss = float("nan")
    self._island_mean_loss = None
    self._startup_s = None
    self._programs = None

  def run(self, programs) -> Finished:
    """Takes the steps with the compiled `programs`.

    Raises:
      guards.NonFiniteError: under config.nonfinite='stop', or after
        config.max_rollbacks rollbacks.
      stops.StopRequested: a process was signalled (after saving).
    """
    self._programs = programs
    start_tokens = self.progress.tokens_seen
    self._writer.start_clock(start_tokens, self._start_step)
    self._records.start_clock()
    self._batches.start_clock()
    step = self._start_step
    while step < self._config.total_steps:
      if self._records.stop_requested():
        self._stop(step)
      if self._batches.failure is not None:
        self._stop_on_data_error(step, self._batches.failure)
      step += 1
      try:
        self._take_step(step)
      except guards.NonFiniteError as error:
        self._records.drop_pending()
        step = self._roll_back(error, step)
      except read_ahead.WaitInterrupted:  # waiting for this step's batch
        self._stop(step - 1)
    self._records.finish_pending()
    if math.isnan(self._eval_loss):  # resumed from the final checkpoint
      self._eval_loss = self._mean_eval_loss(settled=True)
    jax.block_until_ready(self.state)
    return Finished(
        state=self.state, progress=self.progress,
        steps_taken=step - self._start_step, start_tokens=start_tokens,
        eval_loss=self._eval_loss,
        island_mean_loss=(self._island_mean_loss
                          if programs.evaluate_island_mean is not None
                          else None),
        startup_s=self._startup_s, train_s=self._records.elapsed_s(),
        data_wait_s=self._batches.waited_s)

  def sync_bytes(self) -> int:
    """What one island sends in one sync of every param, at this round's
    ranks."""
    return self._syncs.sync_bytes(self.state)

  def _take_step(self, step: int) -> None:
    """Inner step `step`, then what the schedule runs after it."""
    schedule, progress = self._setup.run_config.schedule, self.progress
    step_metrics = self._inner_step(step)
    synced = self._setup.run_config.participation(step)
    self._count_step(synced)
    self._records.finish_pending()
    round_ended = schedule.ends_round(step)
    evaluating = schedule.evaluates(step)
    if evaluating and self._programs.evaluate_island_mean is not None:
      # Before the outer step resets them, the islands' plain average.
      self._island_mean_loss = float(self._programs.evaluate_island_mean(
          self.state, tuple(self._eval_arrays)))
    self.state, excluded = self._syncs.after(step, self.state,
                                             self._programs, synced,
                                             progress)
    if round_ended:
      progress.rounds_done += 1
      progress.island_round_steps[:] = 0
    record = self._record(step, evaluating, round_ended, synced, excluded)
    checkpoint_due = schedule.checkpoints(step, progress.rounds_done)
    if round_ended or checkpoint_due:  # its record goes out first
      self._records.finish(record, step_metrics)
    else:
      self._records.defer(record, step_metrics)
    diverged = self._records.diverged_this_round
    if checkpoint_due and diverged and not round_ended:
      logging.info("step %d: no checkpoint while island(s) %s are "
                   "diverged; the round's outer step restarts them",
                   step, sorted(diverged))
    elif checkpoint_due:
      self.save(step)
    if round_ended:
      diverged.clear()

  def _inner_step(self, step: int):
    """Runs inner step `step` on every island; returns its metrics (on the
    device) and prepares the next batch meanwhile."""
    config, programs = self._config, self._programs
    batch = self._batches.take()
    run_config = self._setup.run_config
    nan_island = run_config.nan_island
    # config.testing.nan_island: the island's params turn NaN as its round
    # starts.
    if nan_island and step == ((nan_island[1] - 1)
                               * run_config.diloco.inner_steps + 1):
      self.state = jax.jit(
          state_lib.poison_island, static_argnums=1,
          out_shardings=state_lib.state_shardings(
              self.state, self._setup.mesh, config.mesh.fsdp))(
                  self.state, nan_island[0])
    self.state, step_metrics = programs.inner_step(self.state, batch)
    if self._startup_s is None:  # launch to the first inner step's result
      jax.block_until_ready(step_metrics)
      self._startup_s = time.time() - self._launch_time
      logging.info("first inner step done %.1fs after launch (compile "
                   "%.1fs)", self._startup_s, programs.compile_s)
    if step < config.total_steps:
      self._batches.prepare()
    return step_metrics

  def _count_step(self, synced: np.ndarray) -> None:
    """The step's tokens and what DDP would send (or sends) for it."""
    progress = self.progress
    progress.island_round_steps += 1
    # An idle island's work is discarded: its tokens do not count.
    progress.tokens_seen += self._tokens_per_island_step * (
        int(synced.sum()) if self._setup.run_config.diloco.restart_dropped
        else self._setup.islands)
    self._syncs.link_bytes.count_step(progress)

  def _record(self, step: int, evaluating: bool, round_ended: bool,
              synced: np.ndarray, excluded: np.ndarray) -> dict:
    """The step's record (its training metrics are added when fetched),
    with the evaluation when it is due."""
    config = self._config
    record = reports.step_record(self._setup.run_config, step, self.progress,
                                 float(self._learning_rates[step - 1]))
    self._writer.set_data_wait(self._batches.waited_s)
    if evaluating:
      self._eval_loss = self._mean_eval_loss(
          settled=step == config.total_steps)
      self._rising_loss.observe(step, self._eval_loss)
      record.update(reports.eval_record(self._eval_loss,
                                        config.data.tokenizer == "byte"))
      if self._programs.evaluate_island_mean is not None:
        record["eval_loss_island_mean"] = self._island_mean_loss
    if round_ended and config.mode == "diloco":
      if self._syncs.mean_rank is not None:
        record["codec_mean_rank"] = self._syncs.mean_rank
      record["active_islands"] = int(synced.sum())
      record["excluded_islands"] = int(excluded.sum())
    return record

  def _mean_eval_loss(self, settled: bool = False) -> float:
    """x's mean loss over the eval batches. With eager updates x is the
    islands' average point, formed here unless the run's end has `settled`
    the islands on it already."""
    state = self._setup.evaluated(self.state)
    if self._programs.consensus is not None and not settled:
      state = state.replace(global_params=self._programs.consensus(state))
    return float(np.mean(jax.device_get(
        [self._programs.evaluate(state, b) for b in self._eval_arrays])))

  def save(self, step: int) -> None:
    """Starts saving the state after `step` (its metrics record, written
    first, is on disk already: the writer writes each record at once)."""
    setup = self._setup
    self._checkpointer.save(step, setup.whole(self.state), {
        **self.progress.to_meta(), "step": step,
        "data": multihost.merge_island_states(
            self._batches.position, setup.data.held, setup.islands),
        **self._checkpoint_meta,
    }, self._programs.inspect_state)
    self.saved_step = step

  def _stop(self, step: int) -> None:
    """Saves `step` if it can and raises StopRequested."""
    diverged = self._save_before_stopping(step)
    raise stops.stop_error(step, self._signals, self.saved_step, diverged)

  def _stop_on_data_error(self, step: int, error: Exception) -> None:
    """Saves `step` if it can and raises the source's DataError, saying
    where a rerun resumes."""
    self._save_before_stopping(step)
    resumes = (f"a rerun resumes from step {self.saved_step}"
               if self.saved_step else "a rerun starts over")
    raise data_errors.DataError(
        f"{error} (stopped after step {step}; {resumes})") from error

  def _save_before_stopping(self, step: int) -> set:
    """Saves `step` unless it is saved, diverged or not a step of this
    run, and waits for the checkpoint; returns the diverged islands."""
    self._records.finish_pending()
    diverged = self._records.diverged_this_round
    if step > self._start_step and self.saved_step != step and not diverged:
      self.save(step)
    self._checkpointer.wait()
    return diverged

  def _roll_back(self, error: guards.NonFiniteError, step: int) -> int:
    """Goes on from the last good state (rollback.rollback_start); returns
    its step."""
    start = rollback.rollback_start(error, step, self._setup,
                                    self._checkpointer, self._source,
                                    self.progress)
    self._writer.truncate(start.step)
    self.saved_step = start.step if start.restored else None
    self.state = self._setup.islands_side(start.state)
    self.progress = start.progress
    self._eval_loss = float("nan")
    return start.step
