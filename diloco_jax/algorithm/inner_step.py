"""The inner step: every island takes one optimizer step on its own batch.

One jitted program advances all k islands at once (placement.island_map:
a shard_map over the 'island' device slots, a vmap over the islands folded
on each). The same step serves all three modes: `ddp` also averages the
gradients across islands every step, through the communication boundary;
`single` is one island that never syncs.
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from diloco_jax.algorithm import state as state_lib
from diloco_jax.parallel import communication
from diloco_jax.parallel.mesh import DATA, STAGE
from diloco_jax.parallel import placement
from diloco_jax.parallel.placement import PER_ISLAND
from diloco_jax.parallel.stages import per_stage

LossFn = Callable[[Any, jax.Array], jax.Array]  # (params, sequences) -> loss


def _without_island_axis(specs):
  """Per-island specs P(ISLAND, ...) as seen inside one island: P(...)."""
  return jax.tree.map(lambda spec: P(*spec[1:]), specs,
                      is_leaf=lambda x: isinstance(x, P))



def value_and_grad_accumulated(loss_fn: LossFn, params, sequences,
                               microbatches: int):
  """Mean loss and gradient over `sequences` [B, L + 1], in `microbatches`.

  Gradient accumulation: the batch is cut into `microbatches` equal parts
  run one after another (lax.scan), so activations of only B / microbatches
  sequences are alive at once; the result is the full batch's mean.
  Microbatch i takes sequences i, i + n, i + 2n, ..., which keeps each
  microbatch split over the island's 'data' devices like the whole batch.
  """
  sequences = jax.lax.with_sharding_constraint(sequences, P(DATA))
  if microbatches == 1:
    return jax.value_and_grad(loss_fn)(params, sequences)
  batch, length = sequences.shape
  parts = sequences.reshape(batch // microbatches, microbatches, length)
  parts = jax.lax.with_sharding_constraint(parts.swapaxes(0, 1),
                                           P(None, DATA))

  def accumulate(totals, part):
    loss, grads = jax.value_and_grad(loss_fn)(params, part)
    return jax.tree.map(lambda t, g: t + g.astype(jnp.float32), totals,
                        (loss, grads)), None

  # The carry's zeros are derived from the inputs (zeros_like, a sum of
  # zeros for the loss) so they are typed as varying over islands like the
  # values the scan adds to them; XLA folds them to constants.
  zeros = (jnp.zeros_like(sequences, jnp.float32).sum(),
           jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params))
  (loss, grads), _ = jax.lax.scan(accumulate, zeros, parts)
  grads = jax.tree.map(lambda g, p: (g / microbatches).astype(p.dtype),
                       grads, params)
  return loss / microbatches, grads


def make_inner_step(loss_fn: LossFn, inner_opt: optax.GradientTransformation,
                    mesh, sync_gradients_across_islands: bool = False,
                    microbatches: int = 1, fsdp: bool = False):
  """Builds the jitted inner step for all islands at once.

  Each island computes the gradient of its batch (split over its 'data'
  devices, in `microbatches` accumulated parts) and takes one inner
  optimizer step. With `sync_gradients_across_islands` (ddp mode) the
  gradients are also averaged across islands through the communication
  boundary, every step. With `fsdp`, params, gradients and optimizer
  states stay split over the island's 'data' devices.

  On a mesh with 'stage' > 1 the state is staged (state.stage_state):
  `loss_fn` is the pipelined loss of staged params (parallel/pipeline.py),
  and each stage's optimizer steps its own layers (`inner_opt` built with
  the stage axis, so its clipping norm spans the stages).

  Returns:
    step(state, batch) -> (state, metrics) with metrics['loss'] of shape
    [islands]; `state` is donated.
  """

  stages = mesh.shape[STAGE]

  def step(state: state_lib.TrainState, batch: jax.Array):
    specs = state_lib.state_partition_specs(state, mesh.shape[DATA], fsdp,
                                            stages)
    param_specs = _without_island_axis(specs.island_params)
    opt_specs = _without_island_axis(specs.inner_opt_state)

    def island_update(params, opt_state, sequences):
      loss, grads = value_and_grad_accumulated(loss_fn, params, sequences,
                                               microbatches)
      if fsdp:  # reduce-scatter the gradient rather than all-reduce it
        grads = placement.constrain(grads, param_specs)
      if sync_gradients_across_islands:
        grads = communication.island_mean(grads, jnp.float32(1.0))
      updates, opt_state = per_stage(inner_opt.update, stages)(
          grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      if fsdp:
        params = placement.constrain(params, param_specs)
        opt_state = placement.constrain(opt_state, opt_specs)
      return params, opt_state, loss, optax.tree.norm(grads)

    update = placement.island_map(
        island_update, mesh, in_specs=(PER_ISLAND,) * 3,
        out_specs=(PER_ISLAND,) * 4,
        # ddp's mean psums a weight that is the same on every island, which
        # the varying-axes check rejects for folded (vmapped) islands; the
        # pipeline's hand-off is a shard_map over 'stage', which the check
        # does not follow into.
        check_vma=not sync_gradients_across_islands and stages == 1)
    params, opt_state, loss, grad_norm = update(
        state.island_params, state.inner_opt_state, batch)
    state = state.replace(step=state.step + 1, island_params=params,
                          inner_opt_state=opt_state)
    state = state_lib.constrain_state(state, mesh, fsdp)
    return state, {"loss": loss, "grad_norm": grad_norm}

  return jax.jit(step, donate_argnums=0)
