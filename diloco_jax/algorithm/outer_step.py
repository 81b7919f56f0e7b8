"""The outer step on the compute devices: the islands' collective over
the island mesh (island_sync.py), then the run's outer object
(outer.py's `apply`, on the TrainState's outer state), then the islands
set up for the next round with fresh inner states where they need them.
`make_flush` is the object's `finish`. With config.diloco.outer_placement=
'host' the run layer runs the object's parts on devices of their own
(compiled/host_outer.py).
"""

import jax
import jax.numpy as jnp
import optax

from diloco_jax.algorithm.island_mean import IslandMean
from diloco_jax.algorithm import island_sync as island_sync_lib
from diloco_jax.algorithm import outer as outer_lib
from diloco_jax.algorithm import outer_settings
from diloco_jax.algorithm import outer_state
from diloco_jax.algorithm import state as state_lib
from diloco_jax.algorithm.state import TrainState
from diloco_jax.parallel.mesh import STAGE


def make_outer_step(outer_opt: optax.GradientTransformation, mesh,
                    compression=None, rounding_seed: int | None = None,
                    fsdp: bool = False,
                    inner_opt: optax.GradientTransformation | None = None,
                    restart_dropped: bool = False, overlap: str = "none",
                    reset_inner: bool = False,
                    eager_own_weight: float | None = None,
                    warmup_rounds: int = 0):
  """make_outer_program for the outer object of these settings
  (`overlap` a config.diloco.overlap mode, with eager updates' own weight,
  1 if None, and warm-up rounds); error feedback as the state it is given
  keeps it (outer_settings.init_state's `error_feedback`). The state is
  taken as these settings' (its recipe relabelled), as the compiled steps
  of a run built from settings always took it: a state made with no codec
  steps through int8 (neither keeps codec state), for instance."""
  def step(state: TrainState, weights: jax.Array):
    made = state.outer.recipe
    outer = outer_settings.outer_of(
        outer_opt, compression, overlap, eager_own_weight, warmup_rounds,
        error_feedback=made.error_feedback)
    state = state.replace(outer=state.outer.replace(recipe=outer_state.Recipe(
        outer.codec, outer.overlap, outer.error_feedback, made.assignment)))
    return _program(outer, mesh, rounding_seed, fsdp, inner_opt,
                    restart_dropped, reset_inner)(state, weights)

  return jax.jit(step, donate_argnums=0)


def make_outer_program(outer: outer_lib.DiLoCo, mesh,
                       rounding_seed: int | None = None, fsdp: bool = False,
                       inner_opt: optax.GradientTransformation | None = None,
                       restart_dropped: bool = False,
                       reset_inner: bool = False):
  """Builds the jitted outer step on the compute devices: the collective
  over the island mesh, then the outer object's step (`outer.apply`) on
  the TrainState's outer state (`state.outer`, which `outer.init` made).

  The codec's state, if any, lives in the TrainState; when the state
  carries residuals, error feedback adds each island's residual to its
  pseudo-gradient and keeps what the codec did not send. With
  `rounding_seed` the codec rounds stochastically, with noise derived from
  (seed, round, island) so a resumed run draws the same noise. With `fsdp`
  (params split over each island's 'data' devices) each device reduces its
  own shards across islands (dense codecs only); with pipeline stages each
  stage its own layers, stepping its own outer state.

  An island with weight 0 (not synced this round) or a non-finite
  pseudo-gradient (it diverged) is left out of the mean: masked before any
  arithmetic, so NaN never reaches x; it keeps its error-feedback residual
  and starts the next round where the overlap starts it (outer.apply);
  given `inner_opt`, a diverged island also restarts with a fresh inner
  optimizer state (its moments are not finite either), counted from the
  current step so the learning rate schedule goes on; with
  `restart_dropped` so does an island with weight 0
  (config.diloco.dropped_islands='idle': it rejoins fresh), and with
  `reset_inner` every island (config.diloco.inner_state='reset'). If no
  island takes part, x, the outer state and the codec state stay.

  Returns:
    step(state, weights) -> state, where `weights` [islands] are the
    islands' weights in the mean (tokens processed this round). `state` is
    donated.
  """
  return jax.jit(_program(outer, mesh, rounding_seed, fsdp, inner_opt,
                          restart_dropped, reset_inner), donate_argnums=0)


def _program(outer: outer_lib.DiLoCo, mesh, rounding_seed, fsdp, inner_opt,
             restart_dropped, reset_inner):
  """make_outer_program's step, not yet compiled."""
  stages = mesh.shape[STAGE]
  sync = island_sync_lib.make_island_sync(
      mesh, outer.codec, rounding_seed, fsdp,
      reference_per_island=outer.keeps_island_points)

  def step(state: TrainState, weights: jax.Array):
    reference = (state.outer.anchors if outer.keeps_island_points
                 else state.global_params)
    mean, residuals, codec_state, included, finite = sync(
        reference, state.island_params, state.outer.residuals,
        state.outer.codec_state, weights, state.round)
    update = outer.apply(
        state.global_params, state.island_params, state.outer,
        IslandMean(mean, residuals, codec_state, included, finite,
                   jnp.any(included)),
        weights=weights, stages=stages)
    state = state.replace(outer=update.state)
    restart = state_lib.restart_islands(finite, weights, restart_dropped,
                                        reset_inner)
    state = start_islands(state, update.params, update.islands, restart,
                          inner_opt, stages)
    # The state keeps its declared layout, so the compiled steps take it.
    return state_lib.constrain_state(state, mesh, fsdp)

  return step


def start_islands(state: TrainState, x, islands, restart, inner_opt,
                  stages: int) -> TrainState:
  """`state` with x, the islands' starts and, given `inner_opt`, fresh
  inner states for the islands in `restart` [islands]."""
  inner_opt_state = state.inner_opt_state
  if inner_opt is not None:
    inner_opt_state = state_lib.restart_inner_states(
        inner_opt, inner_opt_state,
        state_lib.stack_islands(x, state_lib.num_islands(state)),
        state.step, restart, stages)
  return state.replace(global_params=x, island_params=islands,
                       inner_opt_state=inner_opt_state)


def make_flush(outer_opt: optax.GradientTransformation, mesh,
               fsdp: bool = False):
  """Builds the jitted end of a delayed run: flush(state) -> state, the
  outer object's `finish` (its codec and overlap the state's recipe).

  The mean still in flight after the last round is applied
  (x_R = OuterOpt(x_{R-1}, D(R - 1))), every island is set to the final x
  (with the rebasing delay, its anchor too: the last round's progress is
  in x_R), and the slot is emptied, so a run extended later starts its
  delay anew. With eager updates the islands settle on their average
  point, which is x, and every island's outer state on their average.
  `state` is donated.
  """
  stages = mesh.shape[STAGE]

  def flush(state: TrainState) -> TrainState:
    recipe = state.outer.recipe
    outer = outer_lib.DiLoCo(outer_opt, recipe.codec, recipe.overlap,
                             recipe.error_feedback)
    update = outer.finish(state.global_params, state.outer, stages=stages)
    state = state.replace(global_params=update.params,
                          island_params=update.islands, outer=update.state)
    return state_lib.constrain_state(state, mesh, fsdp)

  return jax.jit(flush, donate_argnums=0)
