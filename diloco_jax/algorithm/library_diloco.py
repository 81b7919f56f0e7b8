"""The library's DiLoCo outer step (re-exported by library.py): the outer
optimizers, the codecs by name, the islands' compressed mean and the outer
update with its one-step delay, each in both forms (stacked islands, or one
island inside shard_map with `axis_name`).
"""
import flax.struct
import jax
import jax.numpy as jnp
import optax

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm.island_mean import IslandMean, island_mean  # pylint: disable=unused-import
from diloco_jax.algorithm import library_checks
from diloco_jax.algorithm import optimizers
from diloco_jax.algorithm import outer as outer_lib
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.algorithm import state as state_lib
from diloco_jax.codecs import dense as dense_codecs
from diloco_jax.codecs import lowrank



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
  return (optimizers.outer_optimizer(optimizers.OuterSettings(
      "sparseloco", alpha)),
          codec("sparseloco", chunk_size=chunk_size, density=density,
                bits=bits, beta=beta))


def codec(name: str = "fp32", block_size: int = 256, *,
          fallback: str = "fp32", prune_rate: float = 0.5,
          topk_fraction: float = 0.01, rank: int = 4,
          min_rank: int | None = None, energy_fraction: float = 0.9,
          factor_codec: str = "fp32", chunk_size: int = 4096,
          density: float = 0.02, bits: int = 2,
          beta: float = 0.95) -> compression_lib.Compression:
  """What crosses the link, by name (compression.CODECS).

  Dense codecs cover the whole tree: fp32, bf16, fp16, int8, int4, fp4 (the
  quantized ones with one scale per `block_size` values). Structured codecs
  work on each matrix (a leaf of rank >= 2 viewed as [rows, cols]) and send
  vectors and small tensors through the dense `fallback`:

    sign_prune        per column keep the 1 - `prune_rate` largest
                      magnitudes; merged by elected sign (TIES).
    topk              keep `topk_fraction` of each matrix's values.
    lowrank           PowerSGD at `rank`, warm-started from the codec
                      state's basis; float32 factors.
    adaptive_lowrank  each matrix's rank chosen every round from the
                      ladder `min_rank` (default `rank`), doubling, up to
                      `rank`, to keep `energy_fraction` of its energy;
                      factors sent through the dense `factor_codec`.

  "sparseloco" is SparseLoCo's: per chunk of `chunk_size` values the
  `density` largest at `bits` bits, with the residual decayed by `beta`
  as the outer momentum; take it with its outer step from `sparseloco`.

  The low-rank codecs keep state (bases, chosen ranks: `init` makes it);
  all of them leave a residual that error feedback sends later
  (`init(..., error_feedback=True)`).
  """
  library_checks.check_codec_options(
      name, prune_rate=prune_rate, topk_fraction=topk_fraction, rank=rank,
      min_rank=min_rank, energy_fraction=energy_fraction,
      chunk_size=chunk_size, density=density, bits=bits, beta=beta)
  dense_names = dense_codecs.DENSE_CODECS
  if name in dense_names:
    return compression_lib.Compression(
        name, dense_codecs.make_codec(name, block_size))
  if name == compression_lib.SPARSELOCO:
    return compression_lib.Compression(
        name, dense_codecs.make_codec("fp32", block_size),
        chunk_size=chunk_size, density=density, value_bits=bits,
        feedback_decay=beta)
  if name not in compression_lib.STRUCTURED_CODECS:
    raise ValueError(f"codec {name!r} is not one of "
                     f"{compression_lib.CODECS + (compression_lib.SPARSELOCO,)}")
  for what, value in (("fallback", fallback), ("factor_codec", factor_codec)):
    if value not in dense_names:
      raise ValueError(f"{what}={value!r} is not a dense codec {dense_names}")
  common = dict(name=name, dense=dense_codecs.make_codec(fallback, block_size))
  if name == "lowrank":
    return compression_lib.Compression(**common, ranks=(rank,))
  if name == "adaptive_lowrank":
    return compression_lib.Compression(
        **common, ranks=lowrank.rank_ladder(min_rank or rank, rank),
        energy_fraction=energy_fraction,
        factor_codec=dense_codecs.make_codec(factor_codec, block_size))
  return compression_lib.Compression(**common, prune_rate=prune_rate,
                                     topk_fraction=topk_fraction)


def bytes_sent(params, num_islands: int,
               compression: compression_lib.Compression | None = None,
               codec_state=None) -> int:
  """Bytes one island sends in one `outer_update` of `params` (arrays or
  jax.ShapeDtypeStruct, one island's shapes) among `num_islands`: the
  codec's payload and scales over a ring all-reduce or all-gather. For
  adaptive_lowrank, give the round's `codec_state` (its chosen ranks);
  without it the count is at the top rank."""
  return compression_lib.mean_bytes(
      params, num_islands, compression_lib.as_compression(compression),
      rank_indices=compression_lib.rank_indices(codec_state))


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
  library_checks.check_num_islands(num_islands, "init")
  library_checks.check_error_feedback(compression, error_feedback, "init")
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
  library_checks.check_num_islands(num_islands, "island_copies")
  if num_islands is None:
    raise TypeError("island_copies: num_islands=None: give k, the number "
                    "of islands to stack")
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
  library_checks.check_update(
      global_params, island_params, residuals=state.residuals,
      codec_state=state.codec_state, weights=weights,
      compression=compression, axis_name=axis_name, made_by="init",
      used_by="outer_update")
  synced = island_mean(
      global_params, island_params, weights=weights,
      residuals=state.residuals, codec_state=state.codec_state,
      compression=compression, axis_name=axis_name, key=key)
  # The outer object's step (outer.py) on that mean, the same as every
  # runtime's.
  algorithm = _algorithm(outer_tx, compression, state)
  x, outer_state = algorithm.land(global_params,
                                  _outer_state(state, synced.included))
  x, outer_state = algorithm.take(x, outer_state, synced)
  return x, _from_outer_state(outer_state), synced.included


def _algorithm(outer_tx, compression, state: DiLoCoState) -> outer_lib.DiLoCo:
  """The outer object a DiLoCoState stands for (the one-step delay when it
  holds a slot in flight)."""
  return outer_lib.DiLoCo(
      outer_tx, compression_lib.as_compression(compression),
      (outer_overlaps.OneStepDelay() if state.in_flight is not None
       else outer_overlaps.NoOverlap()),
      error_feedback=state.residuals is not None)


def _outer_state(state: DiLoCoState, included) -> outer_lib.OuterState:
  return outer_lib.OuterState(
      round=state.round, included=included,
      outer_opt_state=state.outer_opt_state, codec_state=state.codec_state,
      residuals=state.residuals, in_flight=state.in_flight,
      in_flight_valid=state.in_flight_valid)


def _from_outer_state(outer_state: outer_lib.OuterState) -> DiLoCoState:
  return DiLoCoState(
      outer_opt_state=outer_state.outer_opt_state,
      codec_state=outer_state.codec_state, residuals=outer_state.residuals,
      round=outer_state.round, in_flight=outer_state.in_flight,
      in_flight_valid=outer_state.in_flight_valid)


def pseudo_gradients(global_params, island_params):
  """x - y_i: stacked [k, ...] from stacked islands (x broadcast), or this
  island's. What `pseudo_gradient_mean` averages (in the islands' dtype)."""
  stacked = (jax.tree.leaves(island_params)[0].ndim
             > jax.tree.leaves(global_params)[0].ndim)
  return jax.tree.map(
      lambda x, y: (x[None] if stacked else x) - y, global_params,
      island_params)


def pseudo_gradient_mean(reference, island_params, *, weights=None,
                         residuals=None, codec_state=None,
                         compression: compression_lib.Compression | None = None,
                         axis_name: str | None = None,
                         key: jax.Array | None = None,
                         stacked_reference: bool = False) -> IslandMean:
  """The islands' weighted mean of reference - y_i (plus each one's
  error-feedback residual, decayed by the codec's feedback_decay) through
  the codec, accumulated in float32: the collective of every outer step.

  An island with weight 0 or a non-finite pseudo-gradient is masked before
  any arithmetic (NaN x 0 is NaN), keeps its residual and adds nothing;
  the mean is over the weights of those that took part.

  Args:
    reference: x, where the islands started the round (params-shaped), or
      with `stacked_reference` each island's own start [k, ...].
    island_params: y_i, stacked [k, ...] (axis_name=None) or this island's.
    weights: [k] or this island's scalar; default 1.
    residuals: error feedback's residuals, shaped like `island_params`, or
      None (no error feedback).
    codec_state: the codec's state (`init`'s), or None.
    compression: `codec(...)`; default fp32.
    axis_name: None for stacked islands, else the islands' axis name
      (inside shard_map or pmap).
    key: PRNG key for stochastic rounding, or None (round to nearest).
  """
  if stacked_reference:
    library_checks.check_like(
        island_params, reference, "island_params", "reference",
        "with stacked_reference each island's start and its params "
        "have the same shapes")
    reference_shapes = (reference if axis_name is not None else
                        jax.tree.map(lambda a: jax.ShapeDtypeStruct(
                            a.shape[1:], a.dtype), reference))
  else:
    reference_shapes = reference
  library_checks.check_update(
      reference_shapes, island_params, residuals=residuals,
      codec_state=codec_state, weights=weights, compression=compression,
      axis_name=axis_name, made_by="init", used_by="pseudo_gradient_mean",
      reference_name="reference", state_name="")
  return island_mean(reference, island_params, weights=weights,
                     residuals=residuals, codec_state=codec_state,
                     compression=compression, axis_name=axis_name, key=key,
                     stacked_reference=stacked_reference)


def flush(global_params, state: DiLoCoState,
          outer_tx: optax.GradientTransformation):
  """With the one-step delay: (x, state) after the mean in flight is
  applied (call it after the last round); without it, unchanged."""
  x, outer_state = _algorithm(outer_tx, None, state).land(
      global_params, _outer_state(state, jnp.ones((), bool)))
  return x, _from_outer_state(outer_state)
