"""A warning for the overlap's outer step when x's eval loss keeps rising.

Under a one-round-stale mean the outer optimizer can overshoot: with
momentum 0.9 the one-step delay's x improves for two rounds, then
oscillates and climbs. Training goes on without error, so a run says so
once in its log, naming the likely cause and what to change.
"""

from absl import logging

RISES = 3  # evaluations in a row, each above the one before


class RisingLossWatch:
  """Watches x's eval losses at round ends under an overlap mode."""

  def __init__(self, overlap: str, outer_optimizer, rises: int = RISES):
    """`overlap`: the run's overlap mode (DiLoCoSettings.overlap_mode:
    'none' watches nothing); `outer_optimizer`: its OuterSettings (or
    config.diloco.outer_optimizer resolved: its name, learning_rate and
    momentum are read)."""
    self._overlap = overlap
    self._outer = outer_optimizer
    self._rises = rises
    self._last = None
    self._rising = 0
    self.warned = False

  def observe(self, step: int, eval_loss: float) -> None:
    """Counts a rise of x's eval loss; warns once after `rises` in a row."""
    if self._overlap == "none" or self.warned:
      return
    rose = self._last is not None and eval_loss > self._last
    self._rising = self._rising + 1 if rose else 0
    self._last = eval_loss
    if self._rising >= self._rises:
      self.warned = True
      logging.warning(
          "step %d: x's eval loss rose %d evaluations in a row (now %.4f) "
          "under config.diloco.overlap=%r with outer %s lr %s, momentum %s. "
          "A one-round-stale mean under heavy momentum overshoots: unset "
          "config.diloco.outer_optimizer.learning_rate and momentum to take "
          "the overlap's defaults (config/overlap_defaults.py), lower the "
          "momentum, or use overlap='eager'.", step, self._rising,
          eval_loss, self._overlap, self._outer.name,
          self._outer.learning_rate, self._outer.momentum)
