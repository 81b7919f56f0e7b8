"""The outer object from a compiled step's settings (config.diloco's
overlap mode by name, as the runs' steps and their tests give it), and a
TrainState made by it: the settings' forms of outer.diloco and
state.init_state."""

import optax

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import outer as outer_lib
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.algorithm import state as state_lib
from diloco_jax.parallel import stages as stages_lib


def outer_of(outer_opt: optax.GradientTransformation, compression=None,
             overlap: str = "none", eager_own_weight: float | None = None,
             warmup_rounds: int = 0,
             error_feedback: bool = False) -> outer_lib.DiLoCo:
  """The outer object of these settings: an overlap mode's name
  (overlap.OVERLAPS) with eager updates' own weight (1 if None) and
  warm-up rounds, and whether the islands keep error-feedback
  residuals."""
  spec = outer_overlaps.from_mode(overlap, eager_own_weight, warmup_rounds)
  return outer_lib.DiLoCo(outer_opt,
                          compression_lib.as_compression(compression), spec,
                          error_feedback=error_feedback)


def init_state(params, inner_opt: optax.GradientTransformation,
               outer_opt: optax.GradientTransformation, num_islands: int,
               error_feedback: bool = False, compression=None, seed: int = 0,
               overlap: str = "none",
               layout: stages_lib.StageLayout | None = None, *,
               eager_own_weight: float | None = None,
               warmup_rounds: int = 0) -> state_lib.TrainState:
  """state.init_state for the outer object of these settings (`outer_of`):
  with `error_feedback` zero residuals, with a `compression` that keeps
  state its seeded initial state, with a delayed `overlap` an empty slot
  for the mean in flight, and so on."""
  return state_lib.init_state(
      params, inner_opt,
      outer_of(outer_opt, compression, overlap, eager_own_weight,
               warmup_rounds, error_feedback=error_feedback),
      num_islands, seed=seed, layout=layout)
