"""Evaluation: the loss of the params a run is judged by, as compiled
programs over the state."""

import jax
import jax.numpy as jnp

from diloco_jax.algorithm.inner_step import LossFn
from diloco_jax.algorithm import state as state_lib
from diloco_jax.algorithm.state import TrainState


def island_mean_params(state: TrainState):
  """The plain average of the island params (what FedAvg would serve).

  Evaluated just before an outer step, it is the counterpart of the global
  params after it: Streaming DiLoCo found the outer params evaluate better.
  Computing it is a full-precision mean over the islands: one fp32
  all-reduce of the params across the island link.
  """
  return jax.tree.map(lambda y: jnp.mean(y, axis=0), state.island_params)


def make_evaluate(loss_fn: LossFn, mode: str):
  """Builds evaluate(state, batch) -> mean loss of state.evaluation_params.

  The eval batch is split over the islands. DiLoCo's x is on every island
  already (with eager updates, once `make_consensus` has formed it). ddp and single keep their islands identical, so each island
  scores its own share with its own params: island 0's params never cross
  the island link (a slice y[0] would send them to every other island, a
  full copy of the model per eval batch), only the per-island losses do.
  """

  def evaluate(state: TrainState, batch: jax.Array) -> jax.Array:
    if mode == "diloco":
      return loss_fn(state.global_params, batch)
    islands = state_lib.num_islands(state)
    shares = batch.reshape((islands, -1) + batch.shape[1:])
    return jnp.mean(jax.vmap(loss_fn)(state.island_params, shares))

  return jax.jit(evaluate)


def make_consensus(out_shardings=None):
  """Builds consensus(state) -> x for an eager run mid-way: the islands'
  average outer point (state.eager_consensus), which the run evaluates.
  It is one float32 all-reduce of the params across the island link, so a
  run forms it once per evaluation, not per eval batch."""
  return jax.jit(lambda state: state_lib.eager_consensus(state)[0],
                 out_shardings=out_shardings)


def make_evaluate_island_mean(loss_fn: LossFn):
  """Builds evaluate(state, batches) -> the islands' average's mean loss
  over a tuple of eval batches.

  One program for all the batches, so the average (an fp32 all-reduce of
  the params) crosses the island link once per evaluation, not once per
  batch.
  """

  def evaluate(state: TrainState, batches) -> jax.Array:
    params = island_mean_params(state)
    return jnp.mean(jnp.stack([loss_fn(params, b) for b in batches]))

  return jax.jit(evaluate)
