"""The library's eager updates (re-exported by library.py): each island
keeps its own outer point and steps it at once on the mean that has had a
round to arrive, its stale share swapped for its fresh pseudo-gradient, so
no island waits for the link. Both forms: stacked islands [k, ...], or one
island inside shard_map with `axis_name`.
"""

import flax.struct
import jax
import jax.numpy as jnp
import optax

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import library_checks
from diloco_jax.algorithm import library_diloco
from diloco_jax.algorithm import outer as outer_lib
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.algorithm import outer_state as outer_state_lib
from diloco_jax.algorithm import state as state_lib


class EagerState(flax.struct.PyTreeNode):
  """What eager updates carry from round to round.

  Attributes:
    outer_opt_states: each island's own outer optimizer state ([k, ...]
      stacked, or this island's).
    codec_state, residuals, round: as in DiLoCoState.
    in_flight, in_flight_valid: the last round's mean (float32, one copy),
      still crossing the link while the islands train the next round.
    own_shares: u_m, each island's part of the mean it sent last round
      (float32; [k, ...] or this island's).
  """
  outer_opt_states: optax.OptState
  codec_state: object
  residuals: object
  round: jax.Array
  in_flight: object
  in_flight_valid: jax.Array
  own_shares: object


def eager_init(params, outer_tx: optax.GradientTransformation,
               num_islands: int | None = None, *,
               compression: compression_lib.Compression | None = None,
               error_feedback: bool = False, seed: int = 0):
  """Eager updates' start: (points, EagerState). Every island keeps its
  own point x_m (`points`: all `params` at first; [k, ...] for
  `num_islands` k, or this island's with None, the per-island form) and
  its own outer state, and starts each round from its point."""
  library_checks.check_num_islands(num_islands, "eager_init")
  library_checks.check_error_feedback(compression, error_feedback,
                                      "eager_init")
  per_island = ((lambda tree: tree) if num_islands is None else
                (lambda tree: state_lib.stack_islands(tree, num_islands)))
  points = per_island(params)
  zeros32 = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  outer_states = (outer_tx.init(points) if num_islands is None
                  else jax.vmap(outer_tx.init)(points))
  return points, EagerState(
      outer_opt_states=outer_states,
      codec_state=state_lib.init_codec_state(params, compression, seed),
      residuals=(per_island(jax.tree.map(jnp.zeros_like, params))
                 if error_feedback else None),
      round=jnp.zeros((), jnp.int32), in_flight=zeros32,
      in_flight_valid=jnp.zeros((), bool), own_shares=per_island(zeros32))


def eager_update(points, island_params, state: EagerState,
                 outer_tx: optax.GradientTransformation, *, weights=None,
                 compression: compression_lib.Compression | None = None,
                 own_weight: float | None = 1.0, wait: bool = False,
                 axis_name: str | None = None, key: jax.Array | None = None):
  """Eager updates' round end: the collective of the pseudo-gradients
  x_m - y_m starts, and each island steps its own point at once on
  D(r-1) - u_m(r-1) + u_m(r): the mean that has had this round to arrive,
  with its stale share of it swapped for its fresh one.

  Args:
    points: x_m, where each island started this round ([k, ...] stacked,
      or this island's inside shard_map).
    island_params: y_m after the inner steps, shaped like `points`.
    state: from eager_init or the previous call.
    outer_tx: each island's outer optimizer.
    weights: [k] or this island's scalar (default 1); 0 or a non-finite
      pseudo-gradient leaves an island out.
    compression: the codec (default fp32).
    own_weight: the weight of an island's own fresh pseudo-gradient in its
      step (1: its whole round at once); None: its share w_m / sum w of
      the mean (the paper's rule).
    wait: this round waits for its own mean (a warm-up round): every
      island steps on D(r), as DiLoCo's x does.
    axis_name: None for stacked islands, else the islands' axis name.
    key: PRNG key for stochastic rounding, or None.

  Returns:
    (points, state, included): the islands' next starting points, the next
    state, which islands took part ([k] or a scalar).
  """
  stacked = axis_name is None
  _check_points(points, state, axis_name, "eager_update")
  library_checks.check_like(
      island_params, points, "island_params", "points",
      "island_params are the islands after their inner steps from points, "
      "shaped like points")
  library_checks.check_update(
      state.in_flight, island_params, residuals=state.residuals,
      codec_state=state.codec_state, weights=weights,
      compression=compression, axis_name=axis_name, made_by="eager_init",
      used_by="eager_update", reference_name="the params")
  synced = library_diloco.island_mean(
      points, island_params, weights=weights, residuals=state.residuals,
      codec_state=state.codec_state, compression=compression,
      axis_name=axis_name, key=key, stacked_reference=True)
  # The outer object's eager step (outer.py) on that mean, the same as
  # every runtime's; this round waits for its own mean if `wait`.
  algorithm = _algorithm(outer_tx, compression, state, own_weight)
  outer_state = _outer_state(state, points, synced.included)
  landed = (outer_state.in_flight, outer_state.in_flight_valid)
  _, outer_state = algorithm.take(None, outer_state, synced)
  points, outer_state = algorithm.start(
      None, island_params, outer_state, included=synced.included,
      landed=landed, weights=weights, axis_name=axis_name, wait=bool(wait))
  return points, _from_outer_state(outer_state), synced.included


def _algorithm(outer_tx, compression, state: EagerState,
               own_weight: float | None = 1.0) -> outer_lib.DiLoCo:
  """The outer object an EagerState stands for."""
  return outer_lib.DiLoCo(
      outer_tx, compression_lib.as_compression(compression),
      outer_overlaps.Eager(own_weight), error_feedback=(
          state.residuals is not None))


def _outer_state(state: EagerState, points, included,
                 algorithm: outer_lib.DiLoCo | None = None
                 ) -> outer_lib.OuterState:
  """The OuterState an EagerState and its points stand for (with
  `algorithm`, recorded as made by it)."""
  recipe = None if algorithm is None else outer_state_lib.Recipe(
      algorithm.codec, algorithm.overlap, algorithm.error_feedback)
  return outer_lib.OuterState(
      recipe=recipe,
      round=state.round, included=included,
      outer_opt_state=state.outer_opt_states, codec_state=state.codec_state,
      residuals=state.residuals, in_flight=state.in_flight,
      in_flight_valid=state.in_flight_valid, anchors=points,
      own_shares=state.own_shares)


def _from_outer_state(outer_state: outer_lib.OuterState) -> EagerState:
  return EagerState(
      outer_opt_states=outer_state.outer_opt_state,
      codec_state=outer_state.codec_state, residuals=outer_state.residuals,
      round=outer_state.round, in_flight=outer_state.in_flight,
      in_flight_valid=outer_state.in_flight_valid,
      own_shares=outer_state.own_shares)


def eager_settle(points, state: EagerState,
                 outer_tx: optax.GradientTransformation, *,
                 axis_name: str | None = None):
  """The end of an eager run: the last mean lands, each island steps on
  the rest of it, and the islands' average is the model: (x, its outer
  optimizer state), the same on every island in the per-island form."""
  _check_points(points, state, axis_name, "eager_settle")
  # The outer object's finish (outer.py): the runtimes' end of a run.
  algorithm = _algorithm(outer_tx, None, state)
  included = (jnp.ones((jax.tree.leaves(points)[0].shape[0],), bool)
              if axis_name is None else jnp.ones((), bool))
  update = algorithm.finish(
      None, _outer_state(state, points, included, algorithm),
      axis_name=axis_name)
  outer_state = update.state.outer_opt_state
  if axis_name is None:  # the average's copies, one per island
    outer_state = jax.tree.map(lambda a: a[0], outer_state)
  return update.params, outer_state


def _check_points(points, state: EagerState, axis_name, function: str):
  """points are the islands' points of the params eager_init was given
  (state.in_flight holds one copy's shapes), in the form axis_name says,
  and the state was made for as many islands."""
  library_checks.check_islands(state.in_flight, points, axis_name is None,
                               "the params", "points")
  library_checks.check_like(
      state.own_shares, points, "state.own_shares", "points",
      f"{function}: make the state with eager_init(..., num_islands=k) for "
      "the stacked form's k islands, or num_islands=None per island")
