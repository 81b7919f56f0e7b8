"""Graceful stops: SIGTERM and Ctrl-C end a run at a step boundary.

A cluster scheduler preempts with SIGTERM and a user stops with Ctrl-C;
either way the step in flight is worth finishing and saving. While a
`StopSignals` block is active, the first SIGTERM or SIGINT only records the
request; the training loop polls `requested` after each step, saves a
checkpoint, waits for it, and raises `StopRequested`. A second signal of
either kind is not caught again: the default action (KeyboardInterrupt for
SIGINT, termination for SIGTERM) ends a run that is stuck.
"""

import signal
import threading

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(Exception):
  """The run stopped on a signal after saving; rerun the command to resume."""

  def __init__(self, signal_name: str, step: int, saved: bool,
               unsaved_reason: str = "", last_saved: int | None = None):
    """`unsaved_reason`: why step `step` was taken but not saved (the rerun
    then resumes from `last_saved`, or from the start)."""
    self.signal_name = signal_name
    self.step = step
    self.exit_code = 128 + signal.Signals[signal_name].value  # the shell's
    if saved:
      where = (f"saved a checkpoint at step {step}; rerun the same command "
               "to resume")
    elif unsaved_reason:
      where = (f"step {step} was not saved ({unsaved_reason}); rerun the same "
               "command to resume from " + (f"step {last_saved}"
                                            if last_saved else "the start"))
    else:
      where = "no step was taken, nothing to save"
    super().__init__(f"stopped by {signal_name}: {where}")


class StopSignals:
  """Context manager turning the first SIGTERM/SIGINT into a stop request.

  Handlers are installed only in the main thread (Python delivers signals
  there); elsewhere the block is a no-op and signals act as usual. The
  previous handlers are restored on exit.
  """

  def __init__(self):
    self.signal_name: str | None = None
    self._previous = {}

  @property
  def requested(self) -> bool:
    return self.signal_name is not None

  def _handle(self, signum, frame) -> None:
    del frame
    self.signal_name = signal.Signals(signum).name
    for sig in _SIGNALS:  # a second signal gets the default action
      signal.signal(sig, self._previous.get(sig) or signal.SIG_DFL)

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in _SIGNALS:
        self._previous[sig] = signal.getsignal(sig)
        signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc_info):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler or signal.SIG_DFL)
    self._previous = {}


def stop_error(step: int, signals, saved_step: int | None,
               diverged: set) -> StopRequested:
  """The error that ends a run asked to stop after `step`, the newest
  saved step being `saved_step` and `diverged` this round's diverged
  islands (a checkpoint never holds a diverged island's NaN: mid-round,
  the outer step that restarts it has not run yet)."""
  return StopRequested(
      signals.signal_name, step, saved=saved_step == step,
      unsaved_reason=(f"island(s) {sorted(diverged)} had diverged in this "
                      "round" if diverged else ""),
      last_saved=saved_step)
