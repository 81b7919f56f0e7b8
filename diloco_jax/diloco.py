"""DiLoCo's state and its two compiled steps, as pure functions over pytrees.

State layout (DESIGN.md §2): the global params x and the outer optimizer state
are replicated; island params y_i and inner optimizer states are stacked with a
leading island dimension sharded over the 'island' mesh axis. The inner step
advances every island at once; the outer step averages the pseudo-gradients
x - y_i across islands (through `communication.island_mean`), applies the outer
optimizer and resets every island to the new x.

The same inner step serves all three modes: `ddp` additionally averages the
gradients across islands every step, `single` is one island that never syncs.
"""

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax import communication
from diloco_jax import compression as compression_lib
from diloco_jax.mesh import DATA, ISLAND

LossFn = Callable[[Any, jax.Array], jax.Array]  # (params, sequences) -> loss


class TrainState(flax.struct.PyTreeNode):
  """Everything a DiLoCo run carries from step to step.

  Attributes:
    step: inner steps taken by every island so far.
    round: outer steps taken so far.
    global_params: x, the outer parameters (replicated).
    outer_opt_state: the outer optimizer's state (replicated).
    island_params: y, stacked [islands, ...], sharded over 'island'.
    inner_opt_state: the inner optimizers' states, stacked the same way.
    residuals: error feedback: per island, the part of its pseudo-gradients
      the codec has not sent yet (stacked like island_params), or None.
    codec_state: what the codec carries across rounds (replicated; the
      low-rank codecs' warm-start bases and ranks), or None.
  """
  step: jax.Array
  round: jax.Array
  global_params: Any
  outer_opt_state: Any
  island_params: Any
  inner_opt_state: Any
  residuals: Any = None
  codec_state: Any = None


def _stack(tree, n: int):
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), tree)


def _zero_residuals(params, num_islands: int):
  return jax.tree.map(
      lambda x: jnp.zeros((num_islands,) + x.shape, jnp.float32), params)


def init_state(params, inner_opt: optax.GradientTransformation,
               outer_opt: optax.GradientTransformation,
               num_islands: int, error_feedback: bool = False,
               compression=None, seed: int = 0) -> TrainState:
  """Every island starts from the same params with a fresh inner state.

  With `error_feedback` the state holds zero residuals; with a `compression`
  (as make_outer_step takes it) that keeps state, its initial codec state
  (seeded by `seed`).
  """
  island_params = _stack(params, num_islands)
  return TrainState(
      codec_state=compression_lib.init_codec_state(
          params, compression_lib.as_compression(compression), seed),
      residuals=(_zero_residuals(params, num_islands) if error_feedback
                 else None),
      step=jnp.zeros((), jnp.int32),
      round=jnp.zeros((), jnp.int32),
      global_params=params,
      outer_opt_state=outer_opt.init(params),
      island_params=island_params,
      inner_opt_state=jax.vmap(inner_opt.init)(island_params),
  )


def state_partition_specs(state: TrainState) -> TrainState:
  """Where each part of the state lives on the (island, data, stage) mesh."""
  replicated = lambda tree: jax.tree.map(lambda _: P(), tree)
  per_island = lambda tree: jax.tree.map(lambda _: P(ISLAND), tree)
  return TrainState(
      step=P(), round=P(),
      global_params=replicated(state.global_params),
      outer_opt_state=replicated(state.outer_opt_state),
      island_params=per_island(state.island_params),
      inner_opt_state=per_island(state.inner_opt_state),
      residuals=per_island(state.residuals),
      codec_state=replicated(state.codec_state),
  )


def state_shardings(state: TrainState, mesh) -> TrainState:
  """NamedShardings for `state` on `mesh` (see state_partition_specs)."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                      state_partition_specs(state),
                      is_leaf=lambda x: isinstance(x, P))


BATCH_SPEC = P(ISLAND, DATA)  # batches are [islands, per-island batch, L+1]


def _squeeze_island(tree):
  return jax.tree.map(lambda x: x[0], tree)


def _unsqueeze_island(tree):
  return jax.tree.map(lambda x: x[None], tree)


def make_inner_step(loss_fn: LossFn, inner_opt: optax.GradientTransformation,
                    mesh, sync_gradients_across_islands: bool = False):
  """Builds the jitted inner step for all islands at once.

  Each island computes gradients on its batch, averaged over its 'data'
  replicas, and takes one inner optimizer step. With
  `sync_gradients_across_islands` (ddp mode) the gradients are also averaged
  across islands through the communication boundary, every step.

  Returns:
    step(state, batch) -> (state, metrics) with metrics['loss'] of shape
    [islands]; `state` is donated.
  """

  def island_update(params, opt_state, sequences):
    params, opt_state = _squeeze_island(params), _squeeze_island(opt_state)
    sequences = sequences[0]

    def replica_mean_loss(p):
      # Differentiating through the pmean makes the gradient the mean over
      # the island's data replicas, and keeps it replicated across them.
      return jax.lax.pmean(loss_fn(p, sequences), DATA)

    loss, grads = jax.value_and_grad(replica_mean_loss)(params)
    if sync_gradients_across_islands:
      grads = communication.island_mean(grads, jnp.float32(1.0))
    updates, opt_state = inner_opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    grad_norm = optax.tree.norm(grads)
    return (_unsqueeze_island(params), _unsqueeze_island(opt_state),
            loss[None], grad_norm[None])

  def step(state: TrainState, batch: jax.Array):
    island_spec = lambda tree: jax.tree.map(lambda _: P(ISLAND), tree)
    update = jax.shard_map(
        island_update, mesh=mesh,
        in_specs=(island_spec(state.island_params),
                  island_spec(state.inner_opt_state), BATCH_SPEC),
        out_specs=(island_spec(state.island_params),
                   island_spec(state.inner_opt_state), P(ISLAND), P(ISLAND)),
    )
    params, opt_state, loss, grad_norm = update(
        state.island_params, state.inner_opt_state, batch)
    state = state.replace(step=state.step + 1, island_params=params,
                          inner_opt_state=opt_state)
    return state, {"loss": loss, "grad_norm": grad_norm}

  return jax.jit(step, donate_argnums=0)


def make_outer_step(outer_opt: optax.GradientTransformation, mesh,
                    compression=None, rounding_seed: int | None = None):
  """Builds the jitted outer step: one program holding the collective.

  `compression` (a compression.Compression, a codecs.DenseCodec, or None
  for fp32) says how pseudo-gradients cross the island link; its codec state, if any, lives in the TrainState. When
  the state carries residuals, error feedback adds each island's residual to
  its pseudo-gradient and keeps what the codec did not send. With
  `rounding_seed` the codec rounds stochastically, with noise derived from
  (seed, round, island) so a resumed run draws the same noise.

  Returns:
    outer(state, weights) -> state, where `weights` [islands] are the islands'
    weights in the mean (tokens processed this round). `state` is donated.
  """

  compression = compression_lib.as_compression(compression)

  def island_round_end(global_params, outer_state, island_params, residuals,
                       codec_state, weight, round_index):
    local = _squeeze_island(island_params)
    pseudo_grad = jax.tree.map(jnp.subtract, global_params, local)
    if residuals is not None:
      pseudo_grad = jax.tree.map(jnp.add, pseudo_grad,
                                 _squeeze_island(residuals))
    key = None
    if rounding_seed is not None:
      key = jax.random.fold_in(
          jax.random.fold_in(jax.random.key(rounding_seed), round_index),
          jax.lax.axis_index(ISLAND))
    mean_pseudo_grad, sent, codec_state = compression_lib.island_mean(
        pseudo_grad, weight[0], compression, codec_state, key)
    if residuals is not None:
      residuals = _unsqueeze_island(
          jax.tree.map(jnp.subtract, pseudo_grad, sent))
    updates, outer_state = outer_opt.update(
        mean_pseudo_grad, outer_state, global_params)
    new_global = optax.apply_updates(global_params, updates)
    return (new_global, outer_state, _unsqueeze_island(new_global),
            residuals, codec_state)

  def outer(state: TrainState, weights: jax.Array):
    replicated = lambda tree: jax.tree.map(lambda _: P(), tree)
    island_spec = lambda tree: jax.tree.map(lambda _: P(ISLAND), tree)
    round_end = jax.shard_map(
        island_round_end, mesh=mesh,
        in_specs=(replicated(state.global_params),
                  replicated(state.outer_opt_state),
                  island_spec(state.island_params),
                  island_spec(state.residuals),
                  replicated(state.codec_state), P(ISLAND), P()),
        out_specs=(replicated(state.global_params),
                   replicated(state.outer_opt_state),
                   island_spec(state.island_params),
                   island_spec(state.residuals),
                   replicated(state.codec_state)),
        # A compressed mean ends in an all_gather, whose result is the same
        # on every island but is typed as varying; the replicated out_specs
        # are right by construction (tests check islands agree bit for bit).
        check_vma=compression.is_identity,
    )
    new_global, outer_state, island_params, residuals, codec_state = (
        round_end(state.global_params, state.outer_opt_state,
                  state.island_params, state.residuals, state.codec_state,
                  weights, state.round))
    return state.replace(round=state.round + 1, global_params=new_global,
                         outer_opt_state=outer_state,
                         island_params=island_params, residuals=residuals,
                         codec_state=codec_state)

  return jax.jit(outer, donate_argnums=0)


def resize_islands(state: TrainState, num_islands: int,
                   inner_opt: optax.GradientTransformation) -> TrainState:
  """Changes the number of islands, e.g. when a run restarts on a new fleet.

  Islands that stay keep their params and inner optimizer state; new islands
  start from the global params with a fresh inner optimizer state; removed
  islands are dropped with whatever progress they made since the last outer
  step.
  """
  old = jax.tree.leaves(state.island_params)[0].shape[0]
  kept = min(old, num_islands)
  added = num_islands - kept
  take = lambda tree: jax.tree.map(lambda y: y[:kept], tree)
  params = take(state.island_params)
  opt_state = take(state.inner_opt_state)
  residuals = take(state.residuals)
  if added:
    new_params = _stack(state.global_params, added)
    new_opt_state = jax.vmap(inner_opt.init)(new_params)
    join = lambda a, b: jnp.concatenate([a, b.astype(a.dtype)])
    params = jax.tree.map(join, params, new_params)
    opt_state = jax.tree.map(join, opt_state, new_opt_state)
    if residuals is not None:  # new islands have sent nothing yet
      residuals = jax.tree.map(
          join, residuals, _zero_residuals(state.global_params, added))
  return state.replace(island_params=params, inner_opt_state=opt_state,
                       residuals=residuals)


def evaluation_params(state: TrainState, mode: str):
  """The params a run is judged by: x for DiLoCo, island 0's otherwise.

  `single` has one island and `ddp` keeps its islands identical, so island 0
  is their model. Call inside jit so XLA moves the slice where it is needed.
  """
  if mode == "diloco":
    return state.global_params
  return jax.tree.map(lambda y: y[0], state.island_params)


def island_mean_params(state: TrainState):
  """The plain average of the island params (what FedAvg would serve).

  Evaluated just before an outer step, it is the counterpart of the global
  params after it: Streaming DiLoCo found the outer params evaluate better.
  """
  return jax.tree.map(lambda y: jnp.mean(y, axis=0), state.island_params)


def make_evaluate(loss_fn: LossFn, mode: str, island_mean: bool = False):
  """Builds evaluate(state, batch) -> mean loss.

  Evaluates `evaluation_params`, or with `island_mean` the average of the
  island params.
  """

  def evaluate(state: TrainState, batch: jax.Array) -> jax.Array:
    params = (island_mean_params(state) if island_mean
              else evaluation_params(state, mode))
    return loss_fn(params, batch)

  return jax.jit(evaluate)
