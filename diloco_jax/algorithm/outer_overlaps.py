"""How an outer step meets the islands' training, as values the outer
object (outer.py) takes: `no_overlap()`, `one_step_delay(rebase=...)`,
`eager(own_weight=...)` and `streaming(num_fragments, ...)`, each with the
outer optimizer measured for it.

A one-round-stale mean under heavy Nesterov momentum overshoots: with the
one-step delay at lr 0.7, momentum 0.9 (DiLoCo's setting) x's eval loss
falls for two rounds, then oscillates and climbs. A linear model of a round
(each round covers a fraction of the way to the optimum) puts the delayed
iteration's spectral radius above 1 there and below 1 without the delay.
So each overlap has its own (learning rate, momentum) for outer Nesterov,
measured by experiments/overlap_sweep.py (configs/study.py, 3 seeds;
eager's by experiments/eager_own_weight.py). The trainer's config takes
the same tables (config/overlap_defaults.py).
"""

import dataclasses
from typing import Sequence

from diloco_jax.algorithm import library_checks
from diloco_jax.algorithm import optimizers
from diloco_jax.algorithm import overlap as overlap_lib

# (learning rate, momentum) of outer Nesterov per overlap mode (the
# trainer's config.diloco.overlap).
NESTEROV_DEFAULTS = {
    "none": (0.7, 0.9),
    "one_step_delay": (0.8, 0.0),
    "one_step_delay_rebase": (0.7, 0.5),
    # An island's whole round applied at once wants a smaller lr and more
    # momentum than the share's averaging (experiments/eager_own_weight.py:
    # the best steps at weights 0.9 and 1 form a plateau around this one).
    "eager": (0.5, 0.7),
    "eager_share": (1.0, 0.0),
}

# The rounds at a run's start that wait for their own mean before eager
# updates begin, when unset. The first rounds move the model most, and the
# islands' spread under eager updates costs most there
# (experiments/eager_warmup.py: on configs/study.py, 6 seeds, from +3.3%
# perplexity against no overlap with none to +2.3% with 2). The paper's
# rule ('eager_share') starts at once.
WARMUP_ROUNDS_DEFAULTS = {"eager": 2}


@dataclasses.dataclass(frozen=True)
class NoOverlap:
  """Each round's mean is applied at once; the islands wait for it."""
  mode = "none"


@dataclasses.dataclass(frozen=True)
class OneStepDelay:
  """(DiLoCoX) Round r's mean is applied at the end of round r + 1, so its
  collective has all of round r + 1 to arrive. Every island starts round
  r + 1 from x_r, or with `rebase` from x_r plus its own progress of round
  r (measured from where it started that round), so no island discards a
  round."""
  rebase: bool = False

  @property
  def mode(self) -> str:
    return "one_step_delay_rebase" if self.rebase else "one_step_delay"


@dataclasses.dataclass(frozen=True)
class Eager:
  """(Eager updates) The islands' mean is a round late, as with the delay,
  but each island m steps its own point x_m with its own outer state at
  once on D(r-1) - u_m(r-1) + u_m(r): the mean that has had this round to
  arrive, its stale part swapped for its fresh one. u_m is `own_weight`
  times its pseudo-gradient (1: its whole round at once), or with
  own_weight=None its share of the mean (the paper's rule). The first
  `warmup_rounds` rounds wait for their own mean (default: 2 with an own
  weight, 0 with the share rule). The model is the islands' average
  point."""
  own_weight: float | None = 1.0
  warmup_rounds: int = 0

  @property
  def mode(self) -> str:
    return "eager_share" if self.own_weight is None else "eager"


@dataclasses.dataclass(frozen=True)
class Streaming:
  """(Streaming DiLoCo) The params cut into `num_fragments` fragments
  (`assignment`: each leaf's, default outer.fragment_assignment), each
  sent on its own staggered schedule; a fragment's x is merged into the
  islands `fragment_delay` inner steps after its send, as
  alpha * y + (1 - alpha) * x."""
  num_fragments: int
  fragment_delay: int = 0
  alpha: float = 0.0
  assignment: tuple[int, ...] | None = None
  mode = "none"  # its outer optimizer's defaults are DiLoCo's


Overlap = NoOverlap | OneStepDelay | Eager | Streaming


def no_overlap() -> NoOverlap:
  """Each round's mean applied at once (DiLoCo)."""
  return NoOverlap()


def one_step_delay(rebase: bool = False) -> OneStepDelay:
  """The mean applied a round late (DiLoCoX); `rebase`: each island keeps
  its own round's progress on the new x."""
  return OneStepDelay(bool(rebase))


def eager(own_weight: float | None = 1.0,
          warmup_rounds: int | None = None) -> Eager:
  """Eager updates: each island steps its own point at once. `own_weight`
  None is the paper's share rule; `warmup_rounds` None takes the measured
  default (2 with an own weight, 0 with the share rule)."""
  if own_weight is not None:
    library_checks.check_number(
        "own_weight", own_weight, 0, 1, "(]",
        meaning="the weight of an island's own fresh pseudo-gradient")
  mode = "eager_share" if own_weight is None else "eager"
  if warmup_rounds is None:
    warmup_rounds = WARMUP_ROUNDS_DEFAULTS.get(mode, 0)
  library_checks.check_number(
      "warmup_rounds", warmup_rounds, 0, float("inf"), "[)", integer=True,
      meaning="the first rounds that wait for their own mean")
  return Eager(None if own_weight is None else float(own_weight),
               int(warmup_rounds))


def streaming(num_fragments: int, fragment_delay: int = 0,
              alpha: float = 0.0,
              assignment: Sequence[int] | None = None) -> Streaming:
  """Streaming DiLoCo's fragments on staggered schedules."""
  library_checks.check_number("num_fragments", num_fragments, 1,
                              float("inf"), "[)", integer=True,
                              meaning="the fragments the params are cut in")
  library_checks.check_number(
      "fragment_delay", fragment_delay, 0, float("inf"), "[)", integer=True,
      meaning="inner steps between a fragment's send and its merge")
  library_checks.check_number(
      "alpha", alpha, 0, 1, "[]",
      meaning="the islands' own weight in a merge (0: take x)")
  return Streaming(int(num_fragments), int(fragment_delay), float(alpha),
                   None if assignment is None
                   else tuple(int(f) for f in assignment))


def from_mode(mode: str, own_weight: float | None = None,
              warmup_rounds: int | None = None) -> Overlap:
  """The overlap of a mode's name: 'eager' with `own_weight` (1 if None)
  and `warmup_rounds` (its default if None); the others take neither."""
  if mode == "none":
    return no_overlap()
  if mode in ("one_step_delay", "one_step_delay_rebase"):
    return one_step_delay(rebase=mode == "one_step_delay_rebase")
  if mode == "eager":
    return eager(1.0 if own_weight is None else own_weight, warmup_rounds)
  if mode == "eager_share":
    return eager(None, warmup_rounds)
  raise ValueError(f"overlap={mode!r} is not one of {overlap_lib.OVERLAPS}")


def nesterov_defaults(overlap: Overlap) -> tuple[float, float]:
  """(learning rate, momentum) measured for outer Nesterov under
  `overlap`."""
  return NESTEROV_DEFAULTS[overlap.mode]


# Every overlap the outer object takes.
OVERLAPS = (NoOverlap, OneStepDelay, Eager, Streaming)


def default_outer_tx(overlap: Overlap, sparseloco: bool):
  """The outer optimizer of an object given none: SparseLoCo's x - alpha *
  mean at alpha 1, or outer Nesterov at `overlap`'s measured defaults."""
  if sparseloco:
    return optimizers.outer_optimizer(optimizers.OuterSettings(
        "sparseloco", 1.0))
  learning_rate, momentum = nesterov_defaults(overlap)
  return optimizers.outer_optimizer(optimizers.OuterSettings(
      "nesterov", learning_rate, momentum))
