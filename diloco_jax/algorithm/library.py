"""DiLoCo's outer step as pieces any JAX training loop can call.

Pure functions over pytrees, with no config and no run layer: a loop that
trains k copies of a model (its islands) for H inner steps calls
`outer_update` to average their pseudo-gradients (through a codec) and
step the global params with an optax outer optimizer, then starts every
island from the result. Each call works in two forms:

  stacked     island trees carry a leading axis of k islands (one process
              holds them all, as with jax.vmap); `axis_name=None`.
  per island  inside shard_map (or pmap), each call sees one island's
              trees; `axis_name` names the islands' axis.

The built-in runs use these same pieces (island_sync.sync_island is the
collective of both), so a hand-written loop computes what
`python -m diloco_jax.main` computes. docs/library.md shows a loop.
"""
import flax.struct
import jax
import jax.numpy as jnp
import optax

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import optimizers
from diloco_jax.algorithm import island_sync as island_sync_lib
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.codecs import dense as dense_codecs

__all__ = [
    "DiLoCoState", "EagerState", "adam", "bytes_sent", "codec", "eager_init",
    "eager_settle", "eager_update", "fedavg", "flush", "init",
    "island_copies", "nesterov", "outer_update", "sgd", "sparseloco",
]

# The islands' axis name of the stacked form (a jax.vmap inside).
_STACKED_AXIS = "diloco_islands"


def nesterov(learning_rate: float = 0.7,
             momentum: float = 0.9) -> optax.GradientTransformation:
  """DiLoCo's outer optimizer: Nesterov momentum on the averaged
  pseudo-gradient (the paper's lr 0.7, momentum 0.9)."""
  return optimizers.outer_optimizer(optimizers.OuterSettings(
      "nesterov", learning_rate, momentum))


def sgd(learning_rate: float) -> optax.GradientTransformation:
  """Plain SGD on the averaged pseudo-gradient."""
  return optimizers.outer_optimizer(optimizers.OuterSettings(
      "sgd", learning_rate))


def fedavg() -> optax.GradientTransformation:
  """FedAvg: the global params become the islands' weighted average."""
  return sgd(1.0)


def adam(learning_rate: float, b1: float = 0.9, b2: float = 0.999,
         eps: float = 0.1) -> optax.GradientTransformation:
  """Adam on the averaged pseudo-gradient (DiLoCo needs an eps ~0.1)."""
  return optimizers.outer_optimizer(optimizers.OuterSettings(
      "adam", learning_rate, b1=b1, b2=b2, eps=eps))


def sparseloco(alpha: float = 1.0, *, chunk_size: int = 4096,
               density: float = 0.02, bits: int = 2, beta: float = 0.95):
  """SparseLoCo: (outer optimizer, codec). The outer step is x - alpha *
  mean; the momentum is the islands' error feedback, decayed by `beta`
  (init with error_feedback=True), and the codec keeps `density` of each
  chunk of `chunk_size` values at `bits` bits."""
  compression = compression_lib.Compression(
      compression_lib.SPARSELOCO, dense_codecs.make_codec("fp32"),
      chunk_size=chunk_size, density=density, value_bits=bits,
      feedback_decay=beta)
  return optimizers.outer_optimizer(optimizers.OuterSettings(
      "sparseloco", alpha)), compression


def codec(name: str = "fp32",
          block_size: int = 256) -> compression_lib.Compression:
  """A dense codec of what crosses the link, by name: one of
  codecs.dense.DENSE_CODECS (fp32, bf16, fp16, int8, int4, fp4), the
  quantized ones with one scale per `block_size` values. Structured codecs
  are compression.Compression objects, as `sparseloco` makes."""
  if name not in dense_codecs.DENSE_CODECS:
    raise ValueError(f"codec {name!r} is not one of "
                     f"{dense_codecs.DENSE_CODECS}")
  return compression_lib.Compression(
      name, dense_codecs.make_codec(name, block_size))


def bytes_sent(params, num_islands: int,
               compression: compression_lib.Compression | None = None
               ) -> int:
  """Bytes one island sends in one `outer_update` of `params` (arrays or
  jax.ShapeDtypeStruct, one island's shapes) among `num_islands`: the
  codec's payload and scales over a ring all-reduce or all-gather."""
  return compression_lib.mean_bytes(
      params, num_islands, compression_lib.as_compression(compression))


class DiLoCoState(flax.struct.PyTreeNode):
  """What the outer step carries from round to round.

  Attributes:
    outer_opt_state: the outer optimizer's state (of the global params).
    codec_state: the codec's state (adaptive ranks), or None.
    residuals: error feedback: what the codec left unsent, per island
      (stacked [k, ...] in the stacked form, one island's in the other),
      or None.
    round: rounds done (int32 scalar).
    in_flight: with the one-step delay, the last round's mean (float32,
      params-shaped), applied at the next round's end; else None.
    in_flight_valid: whether `in_flight` holds a mean (bool scalar), or
      None.
  """
  outer_opt_state: optax.OptState
  codec_state: object
  residuals: object
  round: jax.Array
  in_flight: object = None
  in_flight_valid: object = None


def init(params, outer_tx: optax.GradientTransformation,
         num_islands: int | None = None, *,
         compression: compression_lib.Compression | None = None,
         error_feedback: bool = False, one_step_delay: bool = False,
         seed: int = 0) -> DiLoCoState:
  """The state before the first round, for the global `params`.

  `num_islands`: k for the stacked form (residuals stacked [k, ...]); None
  for the per-island form (each island holds its own residuals).
  `one_step_delay`: each round's mean is applied a round later, so its
  collective can overlap the next round's inner steps (DiLoCoX); call
  `flush` after the last round. `seed` seeds the codec's initial state
  (low-rank bases).
  """
  residuals = None
  if error_feedback:
    zeros = jax.tree.map(jnp.zeros_like, params)
    residuals = (zeros if num_islands is None
                 else state_lib.stack_islands(zeros, num_islands))
  return DiLoCoState(
      outer_opt_state=outer_tx.init(params),
      codec_state=state_lib.init_codec_state(params, compression, seed),
      residuals=residuals, round=jnp.zeros((), jnp.int32),
      in_flight=(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32),
                              params) if one_step_delay else None),
      in_flight_valid=jnp.zeros((), bool) if one_step_delay else None)


def island_copies(params, num_islands: int):
  """`params` repeated on a leading axis of `num_islands` (stacked form):
  the islands' start of a round."""
  return state_lib.stack_islands(params, num_islands)


def outer_update(global_params, island_params, state: DiLoCoState,
                 outer_tx: optax.GradientTransformation, *, weights=None,
                 compression: compression_lib.Compression | None = None,
                 axis_name: str | None = None, key: jax.Array | None = None):
  """DiLoCo's outer step: the weighted mean of the islands' pseudo-gradients
  global_params - island_params (plus error feedback) through the codec,
  accumulated in float32, then one step of `outer_tx` on the global params.

  Args:
    global_params: x, the params every island started the round from.
    island_params: stacked [k, ...] (axis_name=None), or this island's.
    state: from `init` or the previous call.
    outer_tx: the outer optimizer (`nesterov`, `fedavg`, `adam`, ...).
    weights: per island: [k] (stacked) or a scalar (per island); 0 leaves
      an island out of the mean (a dropped island). Default: all 1. An
      island whose pseudo-gradient is not finite is left out too.
    compression: the codec (`codec`, `sparseloco`'s); default fp32.
    axis_name: None for the stacked form, else the islands' axis name.
    key: PRNG key for stochastic rounding in the codec, or None.

  Returns:
    (global_params, state, included): the new x (start every island from
    it: `island_copies`), the next state, and whether each island took
    part ([k], or this island's scalar). With no island taking part, x and
    the outer state do not move. With the one-step delay (`init`'s
    one_step_delay) x steps on the previous round's mean and this round's
    waits in the state.
  """
  compression = compression_lib.as_compression(compression)
  if axis_name is None:
    mean, residuals, codec_state, included, _ = _stacked_sync(
        global_params, False, island_params, state, weights, compression,
        key)
    anyone = jnp.any(included)
  else:
    weight = jnp.asarray(1.0 if weights is None else weights, jnp.float32)
    mean, residuals, codec_state, included, _ = island_sync_lib.sync_island(
        global_params, island_params, state.residuals, state.codec_state,
        weight, compression, key, axes=axis_name)
    anyone = jax.lax.psum(included.astype(jnp.int32), axis_name) > 0
  state = state.replace(
      residuals=residuals, round=state.round + 1,
      codec_state=outer_step_lib.keep_unless(anyone, codec_state,
                                             state.codec_state))
  if state.in_flight is None:
    x, outer_opt_state = outer_step_lib.outer_update(
        outer_tx, global_params, state.outer_opt_state, mean, anyone)
    return x, state.replace(outer_opt_state=outer_opt_state), included
  # One-step delay: x steps on last round's mean; this round's waits.
  x, state = flush(global_params, state, outer_tx)
  return x, state.replace(
      in_flight=jax.tree.map(lambda m: m.astype(jnp.float32), mean),
      in_flight_valid=anyone), included


def _stacked_sync(reference, per_island_reference: bool, island_params,
                  state, weights, compression, key):
  """sync_island over stacked islands (a vmap naming their axis): the
  mean and codec state (the same on every island: one copy), and per
  island its residual, whether it took part and was finite."""
  num_islands = jax.tree.leaves(island_params)[0].shape[0]
  weights = (jnp.ones((num_islands,), jnp.float32) if weights is None
             else jnp.asarray(weights, jnp.float32))
  keys = None if key is None else jax.random.split(key, num_islands)
  sync = jax.vmap(
      lambda x, y, e, w, k: island_sync_lib.sync_island(
          x, y, e, state.codec_state, w, compression, k,
          axes=_STACKED_AXIS),
      in_axes=(0 if per_island_reference else None, 0,
               None if state.residuals is None else 0, 0,
               None if keys is None else 0),
      axis_name=_STACKED_AXIS)
  mean, residuals, codec_state, included, finite = sync(
      reference, island_params, state.residuals, weights, keys)
  first = lambda tree: jax.tree.map(lambda a: a[0], tree)
  return first(mean), residuals, first(codec_state), included, finite


def flush(global_params, state: DiLoCoState,
          outer_tx: optax.GradientTransformation):
  """With the one-step delay: (x, state) after the mean in flight is
  applied (call it after the last round); without it, unchanged."""
  if state.in_flight is None:
    return global_params, state
  x, outer_opt_state = outer_step_lib.outer_update(
      outer_tx, global_params, state.outer_opt_state, state.in_flight,
      state.in_flight_valid)
  return x, state.replace(
      outer_opt_state=outer_opt_state,
      in_flight=jax.tree.map(jnp.zeros_like, state.in_flight),
      in_flight_valid=jnp.zeros((), bool))


class EagerState(flax.struct.PyTreeNode):
  """What eager updates carry from round to round (stacked form).

  Attributes:
    outer_opt_states: each island's own outer optimizer state [k, ...].
    codec_state, residuals, round: as in DiLoCoState.
    in_flight, in_flight_valid: the last round's mean, still crossing the
      link while the islands train the next round.
    own_shares: u_m, each island's part of the mean it sent last round
      [k, ...] (float32).
  """
  outer_opt_states: optax.OptState
  codec_state: object
  residuals: object
  round: jax.Array
  in_flight: object
  in_flight_valid: jax.Array
  own_shares: object


def eager_init(params, outer_tx: optax.GradientTransformation,
               num_islands: int, *,
               compression: compression_lib.Compression | None = None,
               error_feedback: bool = False, seed: int = 0):
  """Eager updates' start: (points, EagerState). Every island keeps its
  own point x_m (`points`, [k, ...], all `params` at first) and outer
  state, and starts each round from its point."""
  points = state_lib.stack_islands(params, num_islands)
  zeros32 = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  return points, EagerState(
      outer_opt_states=jax.vmap(outer_tx.init)(points),
      codec_state=state_lib.init_codec_state(params, compression, seed),
      residuals=(state_lib.stack_islands(jax.tree.map(jnp.zeros_like,
                                                      params), num_islands)
                 if error_feedback else None),
      round=jnp.zeros((), jnp.int32), in_flight=zeros32,
      in_flight_valid=jnp.zeros((), bool),
      own_shares=state_lib.stack_islands(zeros32, num_islands))


def eager_update(points, island_params, state: EagerState,
                 outer_tx: optax.GradientTransformation, *, weights=None,
                 compression: compression_lib.Compression | None = None,
                 own_weight: float | None = 1.0, wait: bool = False,
                 key: jax.Array | None = None):
  """Eager updates' round end (stacked islands): the collective of the
  pseudo-gradients x_m - y_m starts, and each island steps its own point
  at once on D(r-1) - u_m(r-1) + u_m(r): the mean that has had this round
  to arrive, with its stale share of it swapped for its fresh one, so no
  island waits for the link.

  Args:
    points: x_m [k, ...], where each island started this round.
    island_params: y_m [k, ...] after the inner steps.
    state: from eager_init or the previous call.
    outer_tx: each island's outer optimizer.
    weights: [k] (default 1); 0 or a non-finite pseudo-gradient leaves an
      island out.
    compression: the codec (default fp32).
    own_weight: the weight of an island's own fresh pseudo-gradient in its
      step (1: its whole round at once); None: its share w_m / sum w of
      the mean (the paper's rule).
    wait: this round waits for its own mean (a warm-up round): every
      island steps on D(r), as DiLoCo's x does.
    key: PRNG key for stochastic rounding, or None.

  Returns:
    (points, state, included): the islands' next starting points [k, ...],
    the next state, which islands took part [k].
  """
  compression = compression_lib.as_compression(compression)
  landed, landed_valid = state.in_flight, state.in_flight_valid
  mean, residuals, codec_state, included, finite = _stacked_sync(
      points, True, island_params, state, weights, compression, key)
  anyone = jnp.any(included)
  num_islands = included.shape[0]
  weights = (jnp.ones((num_islands,), jnp.float32) if weights is None
             else jnp.asarray(weights, jnp.float32))
  mean = jax.tree.map(lambda m: m.astype(jnp.float32), mean)
  points, outer_opt_states, shares = outer_step_lib.eager_steps(
      outer_tx, points, island_params, state.outer_opt_states,
      state.own_shares, landed, landed_valid, weights,
      finite & (weights > 0), own_weight=own_weight,
      waited=(True, mean, anyone) if wait else None)
  return points, state.replace(
      outer_opt_states=outer_opt_states, residuals=residuals,
      codec_state=outer_step_lib.keep_unless(anyone, codec_state,
                                             state.codec_state),
      round=state.round + 1, in_flight=mean, in_flight_valid=anyone,
      own_shares=shares), included


def eager_settle(points, state: EagerState,
                 outer_tx: optax.GradientTransformation):
  """The end of an eager run: the last mean lands, each island steps on
  the rest of it, and the islands' average is the model: (x, its outer
  optimizer state)."""
  points, outer_opt_states = outer_step_lib.eager_last_steps(
      outer_tx, points, state.outer_opt_states, state.own_shares,
      state.in_flight, state.in_flight_valid)
  return (state_lib.islands_average(points),
          state_lib.islands_average(outer_opt_states))
