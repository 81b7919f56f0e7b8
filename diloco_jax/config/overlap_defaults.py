"""The outer optimizer's defaults per overlap mode, eager updates' warm-up
rounds, and the one line that says which outer step a run takes.

A one-round-stale mean under heavy Nesterov momentum overshoots: with the
one-step delay at lr 0.7, momentum 0.9 (DiLoCo's setting) x's eval loss
falls for two rounds, then oscillates and climbs. A linear model of a round
(each round covers a fraction of the way to the optimum) puts the delayed
iteration's spectral radius above 1 there and below 1 without the delay.
So each overlap mode has its own (learning rate, momentum) for outer
Nesterov (algorithm/outer_overlaps.py holds the measured tables), used
when a config leaves config.diloco.outer_optimizer.learning_rate or
momentum unset (None). What a config sets is kept, whether its file or a
--config.* flag set it: configs/default.py's plain averaging (sgd, lr 1)
stays with --config.diloco.overlap=eager, and the run's log line
(describe) names eager's measured step and the flags that select it.
"""

import ml_collections

from diloco_jax.algorithm import compression
# (learning rate, momentum) of outer Nesterov per config.diloco.overlap, and
# eager updates' warm-up rounds: the library's outer object takes the same
# measured tables.
from diloco_jax.algorithm.outer_overlaps import (  # pylint: disable=unused-import
    NESTEROV_DEFAULTS, WARMUP_ROUNDS_DEFAULTS)

# Other outer optimizers ('sgd', 'momentum', 'adam') are not overlap-tuned.
OTHER_DEFAULTS = NESTEROV_DEFAULTS["none"]

_WITH_MOMENTUM = ("nesterov", "momentum")
_FLAG = "--config.diloco.outer_optimizer"


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
  if outer.name == compression.SPARSELOCO:
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


def measured_flags(overlap: str) -> str:
  """The --config.* flags that select `overlap`'s measured outer step
  (Nesterov at its learning rate and momentum), whatever a config file
  set."""
  learning_rate, momentum = NESTEROV_DEFAULTS[overlap]
  # repr: the shortest text that parses back to the same float.
  return (f"{_FLAG}.name=nesterov {_FLAG}.learning_rate={learning_rate!r} "
          f"{_FLAG}.momentum={momentum!r}")


def describe(config, set_outer: dict) -> str:
  """The outer step of a checked, resolved config and where it came from,
  in one line ('' outside DiLoCo: no outer step). Where the step is not
  its overlap mode's measured one, the line names that one too, with the
  flags that select it.

  Args:
    config: the config with its defaults filled in (resolve).
    set_outer: the outer optimizer's learning_rate and momentum before the
      defaults filled them (None where unset).
  """
  if config.mode != "diloco":
    return ""
  diloco = config.diloco
  outer = diloco.outer_optimizer
  if outer.name == compression.SPARSELOCO:
    sparse = diloco.sparseloco
    return (f"outer step: sparseloco alpha {sparse.alpha:g}, its error "
            f"feedback (beta {sparse.beta:g}) the momentum, as "
            "config.diloco.sparseloco sets them")
  used = (("learning_rate", "momentum") if outer.name in _WITH_MOMENTUM
          else ("learning_rate",))
  step = f"{outer.name} lr {outer.learning_rate:g}"
  if "momentum" in used:
    step += f" momentum {outer.momentum:g}"
  unset = [f for f in used if set_outer[f] is None]
  line = (f"outer step: {step}, "
          f"{_why(outer.name, diloco.overlap, used, unset)}")
  if unset:
    line += " (config/overlap_defaults.py)"
  measured = NESTEROV_DEFAULTS.get(diloco.overlap)
  if measured is not None and (
      outer.name, outer.learning_rate, outer.momentum) != ("nesterov",
                                                           *measured):
    line += (f"; the measured default for overlap={diloco.overlap!r} is "
             f"nesterov lr {measured[0]:g} momentum {measured[1]:g}: "
             f"{measured_flags(diloco.overlap)}")
  return line


def _why(name: str, overlap: str, used, unset) -> str:
  """Where a step's values (`used`, of which `unset` took defaults) came
  from."""
  if not unset:
    return "as the config sets it"
  source = (f"the measured default for overlap={overlap!r}"
            if name == "nesterov" else "the default")
  if len(unset) == len(used):
    return source
  short = {"learning_rate": "lr", "momentum": "momentum"}
  kept = [f for f in used if f not in unset][0]
  return f"{short[kept]} as the config sets it, {short[unset[0]]} {source}"
