"""The outer optimizer's defaults per overlap mode, and eager updates'
warm-up rounds.

A one-round-stale mean under heavy Nesterov momentum overshoots: with the
one-step delay at lr 0.7, momentum 0.9 (DiLoCo's setting) x's eval loss
falls for two rounds, then oscillates and climbs. A linear model of a round
(each round covers a fraction of the way to the optimum) puts the delayed
iteration's spectral radius above 1 there and below 1 without the delay.
So each overlap mode has its own (learning rate, momentum) for outer
Nesterov (algorithm/outer_overlaps.py holds the measured tables), used
when a config leaves config.diloco.outer_optimizer.
learning_rate or momentum unset (None). Values a config sets are kept as
they are; on the command line, a config file's outer optimizer is its
choice for its own overlap mode only (outer_choice.py).
"""

import ml_collections

# (learning rate, momentum) of outer Nesterov per config.diloco.overlap, and
# eager updates' warm-up rounds: the library's outer object takes the same
# measured tables.
from diloco_jax.algorithm.outer_overlaps import (  # pylint: disable=unused-import
    NESTEROV_DEFAULTS, WARMUP_ROUNDS_DEFAULTS)

# Other outer optimizers ('sgd', 'momentum', 'adam') are not overlap-tuned.
OTHER_DEFAULTS = NESTEROV_DEFAULTS["none"]


def warmup_rounds(diloco: ml_collections.ConfigDict) -> int:
  """config.diloco.overlap_warmup_rounds, or its overlap mode's default
  where unset (0 for every mode but 'eager'). A config written before the
  field existed (a run's saved config.json) ran without a warm-up: 0."""
  if "overlap_warmup_rounds" not in diloco:
    return 0
  rounds = diloco.overlap_warmup_rounds
  if rounds is not None:
    return rounds
  return WARMUP_ROUNDS_DEFAULTS.get(diloco.get("overlap", "none"), 0)


def outer_defaults(optimizer: str, overlap: str) -> tuple[float, float]:
  """(learning rate, momentum) an unset outer optimizer field takes."""
  if optimizer != "nesterov":
    return OTHER_DEFAULTS
  return NESTEROV_DEFAULTS.get(overlap, NESTEROV_DEFAULTS["none"])


def resolve(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """`config` with the outer optimizer's unset learning rate and momentum
  set to the overlap mode's defaults, or under SparseLoCo to its alpha and
  no momentum (a copy; `config` is unchanged)."""
  outer = config.diloco.outer_optimizer
  if outer.learning_rate is not None and outer.momentum is not None:
    return config
  resolved = config.copy_and_resolve_references()
  outer = resolved.diloco.outer_optimizer
  if outer.name == "sparseloco":
    # Its step is x - alpha * mean: its momentum is the error feedback.
    learning_rate, momentum = resolved.diloco.sparseloco.alpha, 0.0
  else:
    learning_rate, momentum = outer_defaults(outer.name,
                                             resolved.diloco.overlap)
  if outer.learning_rate is None:
    outer.learning_rate = learning_rate
  if outer.momentum is None:
    outer.momentum = momentum
  return resolved
