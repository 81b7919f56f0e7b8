"""The training loop: a run's inner steps and, after each, what its
schedule says (synchronizations, evaluation, a checkpoint).

Each step's metrics are fetched one step late, so the host queues the next
step before it waits on the last one. A NaN or inf rolls the run back to its
last checkpoint or stops it (guards.py); a signal stops it at the next step
with a checkpoint (stops.py). Every decision that must agree across the
processes of a multi-process run (the metrics, a stop) is taken from one
exchange per step.
"""

import dataclasses
import math
import time

import jax
import numpy as np
from absl import logging

from diloco_jax.run import progress as progress_lib
from diloco_jax.analysis import link_bytes
from diloco_jax.run import checkpoints as checkpointing
from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import guards
from diloco_jax.algorithm import state as state_lib
from diloco_jax.parallel import multihost
from diloco_jax.algorithm import optimizers
from diloco_jax.algorithm import participation
from diloco_jax.run import records
from diloco_jax.run import resume
from diloco_jax.run import setup as run_setup
from diloco_jax.algorithm import schedule as schedule_lib
from diloco_jax.run import stops


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
  """
  state: state_lib.TrainState
  progress: progress_lib.Progress
  steps_taken: int
  start_tokens: int
  eval_loss: float
  island_mean_loss: float | None
  startup_s: float | None
  train_s: float


def run_sync_actions(actions, state, programs, weights, host_outer=None):
  """Runs the schedule's synchronization programs after a step, in order:
  the compiled ones, or with outer_placement='host' `host_outer`'s (a
  merge then takes the fragment's x from it)."""
  outer = programs if host_outer is None else host_outer
  for action in actions:
    if action.kind == schedule_lib.OUTER:
      state = outer.outer_step(state, weights)
    elif action.kind == schedule_lib.FLUSH:
      state = outer.flush(state)  # the last update in flight
    elif action.kind == schedule_lib.SEND:
      state = outer.sends[action.fragment](state, weights)
    elif action.kind == schedule_lib.MERGE:
      merge = programs.merges[action.fragment]
      state = (merge(state) if host_outer is None
               else merge(state, host_outer.fragment_x(action.fragment)))
    else:
      raise ValueError(f"unknown schedule action {action}")
  return state


def _place(array: np.ndarray, sharding) -> jax.Array:
  # A callback rather than device_put: each process materializes only the
  # slices its own devices hold, so the same line works on many hosts.
  return jax.make_array_from_callback(array.shape, sharding,
                                      lambda index: array[index])


def _rank_indices(state) -> tuple[int, ...] | None:
  """This round's low-rank ranks, chosen last round (a small fetch)."""
  indices = compression_lib.rank_indices(state.codec_state)
  return None if indices is None else tuple(indices)


class TrainingLoop:
  """Takes a run from its Start to config.total_steps.

  Construct it while the programs compile: it places the eval batches and
  the first training batch. Then `run(programs)`.
  """

  def __init__(self, setup: run_setup.RunSetup, start: run_setup.Start,
               checkpointer: checkpointing.Checkpointer, writer,
               signals: stops.StopSignals, source, launch_time: float):
    """`start.state` is the islands' side (setup.islands_side); `source`
    is where a rollback with no checkpoint starts again (None: fresh
    params)."""
    config = setup.config
    self._setup, self._config = setup, config
    self._checkpointer, self._writer = checkpointer, writer
    self._signals, self._source = signals, source
    self._launch_time = launch_time
    self._schedule = schedule_lib.from_config(config)
    self._participants = participation.step_masks(config, setup.islands)
    self._syncs = config.mode == "diloco"  # outer steps or fragments
    self._check_islands = (jax.jit(guards.islands_finite) if self._syncs
                           else None)
    self._nan_island = (  # config.testing.nan_island: (island, round)
        participation.parse_nan_island(config.testing.nan_island,
                                       setup.islands)
        if config.get("testing", {}).get("nan_island") else None)
    self.link_bytes = link_bytes.LinkBytes(
        config, setup.abstract_state.global_params, setup.islands,
        setup.spec.compression)
    self._learning_rates = optimizers.learning_rate_table(
        config.inner_optimizer, config.total_steps)
    self._tokens_per_island_step = (config.data.batch_size
                                    * config.data.sequence_length)
    # What every checkpoint saves beside the state.
    self._checkpoint_meta = {
        "param_shapes": checkpointing.param_shapes_record(
            setup.abstract_state.global_params),
        "state_layout": checkpointing.state_layout_record(
            setup.abstract_state),
        "config": resume.config_record(config),
    }
    self._start_step = start.step
    self.state = start.state
    self.progress = start.progress
    # The newest step this run's checkpoints hold (None: none yet).
    self._saved_step = start.step if start.restored else None
    self._eval_arrays = [_place(b, setup.eval_shape.sharding)
                         for b in setup.eval_set]
    self._next_batch = setup.place_batch(setup.batches.next_batch())
    self._data_state = setup.batches.state()
    self._pending = None  # the previous step's record, finished a step late
    # Whether a process was asked to stop, as the processes agreed in the
    # last exchange since the loop's last check (None: none since).
    self._stop_agreed = None
    self._diverged_this_round = set()  # islands the outer step excludes
    self._eval_loss = float("nan")
    self._island_mean_loss = None
    self._rank = None  # the low-rank codecs' mean rank at the last sync
    self._startup_s = None
    self._programs = None
    self._train_start = None

  def run(self, programs) -> Finished:
    """Takes the steps with the compiled `programs`.

    Raises:
      guards.NonFiniteError: under config.nonfinite='stop', or after
        config.max_rollbacks rollbacks.
      stops.StopRequested: a process was signalled (after saving).
    """
    self._programs = programs
    config = self._config
    start_tokens = self.progress.tokens_seen
    self._writer.start_clock(self.progress.tokens_seen)
    self._train_start = time.perf_counter()
    step = self._start_step
    while step < config.total_steps:
      if self._stop_agreed is None:
        self._stop_agreed = multihost.any_process(self._signals.requested)
      stop, self._stop_agreed = self._stop_agreed, None
      if stop:
        self._stop(step)
      step += 1
      try:
        self._take_step(step)
      except guards.NonFiniteError as error:
        self._pending = None
        step = self._roll_back(error, step)
        self._eval_loss = float("nan")
    if self._pending is not None:
      self._finish_record(*self._pending)
    if math.isnan(self._eval_loss):  # resumed from the final checkpoint
      self._eval_loss = self._mean_eval_loss()
    jax.block_until_ready(self.state)
    return Finished(
        state=self.state, progress=self.progress,
        steps_taken=step - self._start_step, start_tokens=start_tokens,
        eval_loss=self._eval_loss,
        island_mean_loss=(self._island_mean_loss
                          if programs.evaluate_island_mean is not None
                          else None),
        startup_s=self._startup_s,
        train_s=time.perf_counter() - self._train_start)

  def sync_bytes(self) -> int:
    """What one island sends in one sync of every param, at this round's
    ranks."""
    return self.link_bytes.sync(_rank_indices(self.state))

  def _take_step(self, step: int) -> None:
    """Inner step `step`, then what the schedule runs after it."""
    setup, config, programs = self._setup, self._config, self._programs
    progress, schedule = self.progress, self._schedule
    if self._next_batch is None:  # the prepared one was used before a rollback
      self._next_batch = setup.place_batch(setup.batches.next_batch())
    if self._nan_island and step == ((self._nan_island[1] - 1)
                                     * config.diloco.inner_steps + 1):
      self.state = jax.jit(
          state_lib.poison_island, static_argnums=1,
          out_shardings=state_lib.state_shardings(
              self.state, setup.mesh, config.mesh.fsdp))(
                  self.state, self._nan_island[0])
    self.state, step_metrics = programs.inner_step(self.state,
                                                   self._next_batch)
    self._next_batch = None
    if self._startup_s is None:  # launch to the first inner step's result
      jax.block_until_ready(step_metrics)
      self._startup_s = time.time() - self._launch_time
      logging.info("first inner step done %.1fs after launch (compile "
                   "%.1fs)", self._startup_s, programs.compile_s)
    self._data_state = setup.batches.state()  # the position after the batch
    progress.island_round_steps += 1
    synced = self._participants(step)
    # An idle island's work is discarded: its tokens do not count.
    progress.tokens_seen += self._tokens_per_island_step * (
        int(synced.sum()) if config.diloco.dropped_islands == "idle"
        else setup.islands)
    self.link_bytes.count_step(progress)
    if step < config.total_steps:  # prepare the next batch while this runs
      self._next_batch = setup.place_batch(setup.batches.next_batch())
    if self._pending is not None:
      self._finish_record(*self._pending)
      self._pending = None
    round_ended = schedule.ends_round(step)
    evaluating = schedule.evaluates(step)
    if evaluating and programs.evaluate_island_mean is not None:
      # Before the outer step resets them, the islands' plain average.
      self._island_mean_loss = float(programs.evaluate_island_mean(
          self.state, tuple(self._eval_arrays)))
    excluded = self._synchronize(step, synced)
    if round_ended:
      progress.rounds_done += 1
      progress.island_round_steps[:] = 0
    record = records.step_record(config, step, progress,
                                 float(self._learning_rates[step - 1]))
    self._pending = (record, step_metrics)
    if evaluating:
      self._eval_loss = self._mean_eval_loss()
      record.update(records.eval_record(
          self._eval_loss, config.data.tokenizer == "byte"))
      if programs.evaluate_island_mean is not None:
        record["eval_loss_island_mean"] = self._island_mean_loss
    if round_ended and self._syncs:
      if self._rank is not None:
        record["codec_mean_rank"] = self._rank
      record["active_islands"] = int(synced.sum())
      record["excluded_islands"] = int(excluded.sum())
    checkpoint_due = schedule.checkpoints(step, progress.rounds_done)
    if round_ended or checkpoint_due:  # its record goes out first
      self._pending = None
      self._finish_record(record, step_metrics)
    if checkpoint_due and self._diverged_this_round and not round_ended:
      logging.info("step %d: no checkpoint while island(s) %s are "
                   "diverged; the round's outer step restarts them",
                   step, sorted(self._diverged_this_round))
    elif checkpoint_due:
      self._save(step)
    if round_ended:
      self._diverged_this_round.clear()

  def _synchronize(self, step: int, synced: np.ndarray) -> np.ndarray:
    """Runs the schedule's syncs after `step` among the `synced` islands;
    returns the islands excluded for having diverged."""
    setup, progress = self._setup, self.progress
    actions = self._schedule.after(step)
    if not actions:
      return np.zeros(setup.islands, bool)
    # Islands are weighted by the tokens they processed this round (the
    # same for every island) times their share of the corpus; those not
    # synced this round get weight 0. Islands that diverged are left out
    # too (the programs mask them on the device; this counts them).
    weights = _place((progress.island_round_steps
                      * self._tokens_per_island_step * setup.island_shares
                      * synced).astype(np.float32),
                     setup.weights_shape.sharding)
    excluded = synced & ~multihost.fetch(self._check_islands(self.state))
    host_outer = setup.host_outer
    rank_indices = _rank_indices(
        self.state if host_outer is None else host_outer.outer_state)
    self._rank = (None if not rank_indices else float(np.mean(
        [setup.spec.compression.ranks[i] for i in rank_indices])))
    sending = int((synced & ~excluded).sum())
    self.state = run_sync_actions(actions, self.state, self._programs,
                                  weights, host_outer)
    self.link_bytes.count_syncs(progress, actions, rank_indices, sending)
    return excluded

  def _mean_eval_loss(self) -> float:
    state = self._setup.evaluated(self.state)
    return float(np.mean(jax.device_get(
        [self._programs.evaluate(state, b) for b in self._eval_arrays])))

  def _finish_record(self, record: dict, step_metrics) -> None:
    """Writes a step's record once its metrics are fetched; raises
    NonFiniteError after writing it if the run diverged.

    In DiLoCo, islands that diverge while others do not are left to the
    outer step (it excludes them and restarts them from x); the record
    then averages the finite islands and counts the others.
    """
    # One exchange per step carries the metrics and the stop requests.
    step_metrics, self._stop_agreed = multihost.fetch_and_any(
        step_metrics, self._signals.requested)
    losses = np.atleast_1d(step_metrics["loss"])
    norms = np.atleast_1d(step_metrics["grad_norm"])
    finite = np.isfinite(losses) & np.isfinite(norms)
    some_diverged = self._syncs and 0 < finite.sum() < finite.size
    kept = finite if some_diverged else np.ones_like(finite)
    # Wall-clock since this process's loop started, when the step's
    # metrics (and, at a round's end, its syncs and eval) were done.
    record["elapsed_s"] = time.perf_counter() - self._train_start
    record["train_loss"] = float(np.mean(losses[kept]))
    record["grad_norm"] = float(np.mean(norms[kept]))
    if some_diverged:
      record["diverged_islands"] = int((~finite).sum())
      self._diverged_this_round.update(np.flatnonzero(~finite).tolist())
    self._writer.write(record)
    problem = guards.eval_problem(record["step"],
                                  record.get("eval_loss", 0.0))
    if not some_diverged:
      problem = problem or guards.step_problem(record["step"], losses, norms)
    if problem:
      raise problem

  def _save(self, step: int) -> None:
    self._writer.flush()  # metrics up to `step` reach the file first
    setup = self._setup
    self._checkpointer.save(step, setup.whole(self.state), {
        **self.progress.to_meta(), "step": step,
        "data": multihost.merge_island_states(self._data_state, setup.held,
                                              setup.islands),
        **self._checkpoint_meta,
    }, self._programs.inspect_state)
    self._saved_step = step

  def _stop(self, step: int) -> None:
    """Saves `step` if it can and raises StopRequested."""
    if self._pending is not None:
      self._finish_record(*self._pending)
    diverged = self._diverged_this_round
    # A checkpoint never holds a diverged island's NaN: mid-round, the
    # outer step that restarts it has not run yet.
    if step > self._start_step and self._saved_step != step and not diverged:
      self._save(step)
    self._checkpointer.wait()
    raise stops.StopRequested(
        self._signals.signal_name, step, saved=self._saved_step == step,
        unsaved_reason=(f"island(s) {sorted(diverged)} had diverged in "
                        "this round" if diverged else ""),
        last_saved=self._saved_step)

  def _roll_back(self, error: guards.NonFiniteError, step: int) -> int:
    """Restores the last good state and returns its step; the data stream
    goes on from where it is, so the batches of steps after that state are
    skipped."""
    config, setup = self._config, self._setup
    rollbacks = self.progress.rollbacks
    if config.nonfinite != "rollback":
      raise error
    if len(rollbacks) >= config.max_rollbacks:
      raise guards.NonFiniteError(
          f"{error} (after {len(rollbacks)} rollbacks, config.max_rollbacks)",
          error.step) from error
    self._checkpointer.wait()
    start = (setup.restore(self._checkpointer, compare_config=False)
             or setup.first_start(self._source))
    start.progress.config_changes = self.progress.config_changes
    start.progress.rollbacks = rollbacks + [{
        "step": error.step, "to_step": start.step,
        "skipped_batches": step - start.step, "error": str(error)}]
    self._writer.truncate(start.step)
    self._saved_step = start.step if start.restored else None
    logging.warning("%s; rolled back to step %d, skipping the %d batches "
                    "taken since (rollback %d of at most %d)", error,
                    start.step, step - start.step,
                    len(start.progress.rollbacks), config.max_rollbacks)
    self.state = setup.islands_side(start.state)
    self.progress = start.progress
    return start.step
