"""Each step's record, finished one step late and checked for divergence.

A step's metrics are fetched only after the next step is queued, so the
host never waits on the device. Fetching them is also the one exchange per
step among the processes of a multi-process run: it carries every
process's metrics and whether any was asked to stop, so all take the same
decisions.
"""

import time

import numpy as np

from diloco_jax.algorithm import guards
from diloco_jax.parallel import multihost


class StepRecords:
  """Writes the run's step records as their metrics arrive.

  Attributes:
    diverged_this_round: islands whose loss turned non-finite in this round
      while others' did not (DiLoCo leaves them to the outer step, which
      excludes and restarts them).
  """

  def __init__(self, writer, signals, syncs: bool):
    """`syncs`: whether the run synchronizes islands (DiLoCo), so a few
    diverged islands are left to the outer step rather than stopping it."""
    self._writer, self._signals, self._syncs = writer, signals, syncs
    self._pending = None  # (record, metrics) of the step before
    self._train_start = None
    # Whether a process was asked to stop, as the processes agreed in the
    # last exchange since the loop's last check (None: none since).
    self._stop_agreed = None
    self.diverged_this_round = set()

  def start_clock(self) -> None:
    """Marks the loop's start: records give their time since."""
    self._train_start = time.perf_counter()

  def elapsed_s(self) -> float:
    """Seconds since start_clock."""
    return time.perf_counter() - self._train_start

  def stop_requested(self) -> bool:
    """Whether any process was asked to stop, as the last exchange said
    (or a new exchange, when none has happened since the last call)."""
    if self._stop_agreed is None:
      self._stop_agreed = multihost.any_process(self._signals.requested)
    stop, self._stop_agreed = self._stop_agreed, None
    return stop

  def defer(self, record: dict, step_metrics) -> None:
    """Holds a step's record until the next step is queued."""
    self._pending = (record, step_metrics)

  def finish_pending(self) -> None:
    """Finishes the held record, if any (see `finish`)."""
    if self._pending is not None:
      pending, self._pending = self._pending, None
      self.finish(*pending)

  def drop_pending(self) -> None:
    """Forgets the held record (its step is being rolled back)."""
    self._pending = None

  def finish(self, record: dict, step_metrics) -> None:
    """Writes a step's record once its metrics are fetched.

    In DiLoCo, islands that diverge while others do not are left to the
    outer step (it excludes them and restarts them from x); the record then
    averages the finite islands and counts the others.

    Raises:
      guards.NonFiniteError: after writing the record, if the run diverged.
    """
    step_metrics, self._stop_agreed = multihost.fetch_and_any(
        step_metrics, self._signals.requested)
    losses = np.atleast_1d(step_metrics["loss"])
    norms = np.atleast_1d(step_metrics["grad_norm"])
    finite = np.isfinite(losses) & np.isfinite(norms)
    some_diverged = self._syncs and 0 < finite.sum() < finite.size
    kept = finite if some_diverged else np.ones_like(finite)
    # Wall-clock since this process's loop started, when the step's
    # metrics (and, at a round's end, its syncs and eval) were done.
    record["elapsed_s"] = self.elapsed_s()
    record["train_loss"] = float(np.mean(losses[kept]))
    record["grad_norm"] = float(np.mean(norms[kept]))
    if some_diverged:
      record["diverged_islands"] = int((~finite).sum())
      self.diverged_this_round.update(np.flatnonzero(~finite).tolist())
    self._writer.write(record)
    problem = guards.eval_problem(record["step"],
                                  record.get("eval_loss", 0.0))
    if not some_diverged:
      problem = problem or guards.step_problem(record["step"], losses, norms)
    if problem:
      raise problem
