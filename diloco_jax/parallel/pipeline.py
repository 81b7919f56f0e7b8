"""Microbatches through the S pipeline stages of an island, in SPMD JAX.

Every stage runs the same program. The island's batch is cut into M
microbatches; at each tick every stage applies its layers to the
activation it holds (stages.per_stage: a vmap over the stage axis, each
device its own stage) and hands the result to the next stage with one
ppermute over 'stage' (stages.hand_off; the last stage hands to the
first). The backward pass is the same schedule reversed: autodiff
transposes the ppermutes. Gradients of the microbatches accumulate in the
transpose of the scan over ticks.

Schedules, for M microbatches and R repeats (the layouts in stages.py):
  gpipe     R = 1: microbatch m is on stage s at tick m + s; a pass takes
            M + S - 1 ticks, of which each stage idles S - 1: the bubble
            (S - 1) / (M + S - 1).
  circular  R >= 2 passes around the ring, each stage holding R chunks of
            L / (S R) layers: microbatch m's pass r is on stage s at tick
            r M + m + s; R M + S - 1 ticks of 1/R the work each, bubble
            (S - 1) / (R M + S - 1). Needs M >= S: a microbatch is back at
            stage 0 before its next pass starts, and waits there.
The outputs collect on stage 0 and are then shared out over the stages,
so each computes the head and loss of M / S microbatches: no stage
computes the others' heads, and the head's cost is spread like the
layers'.
"""

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax.parallel.mesh import DATA
from diloco_jax.parallel.stages import (LAYERS, context_mesh, hand_off,
                                        per_stage)

SCHEDULES = ("gpipe", "circular")


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
  """The ideal share of a stage's ticks spent idle: (S-1) / (R M + S-1)."""
  return (stages - 1) / (repeats * microbatches + stages - 1)


def num_ticks(stages: int, microbatches: int, repeats: int = 1) -> int:
  """Ticks of one pass of every microbatch: R M + S - 1."""
  return repeats * microbatches + stages - 1


def run_stages(stage_fn: Callable, chunks, inputs: jax.Array, stages: int,
               repeats: int, mesh) -> jax.Array:
  """Every microbatch through every chunk of layers, in order.

  Args:
    stage_fn: (one chunk's params, activation) -> activation.
    chunks: each stage's chunks, leaves [S, R, ...] (split over 'stage').
    inputs: [M, ...] the first layer's inputs.
    stages: S.
    repeats: R.
    mesh: the mesh (or the enclosing shard_map's) the stages are on.

  Returns:
    [M, ...] the last layer's outputs.
  """
  microbatches = inputs.shape[0]
  ticks = num_ticks(stages, microbatches, repeats)
  stage_ids = jnp.arange(stages)
  # A microbatch back at stage 0 after a pass waits `wait` ticks for its
  # next one (circular): it arrived M - S ticks before it is needed.
  wait = microbatches - stages + 1

  def compute(chunk, rep, held):
    return stage_fn(jax.tree.map(
        lambda p: jax.lax.dynamic_index_in_dim(p, rep, keepdims=False),
        chunk), held)

  def receive(stage, passed, waiting, t, fresh):
    """One stage's input for tick t + 1, after tick t's hand-off. Stage 0
    received the last stage's output: it waits in `waiting` (a ring of
    `wait` slots) for its next pass; stage 0 takes the next new
    microbatch, `fresh`, in the first pass, else the one whose wait ends."""
    if repeats > 1:
      waiting = jax.lax.dynamic_update_index_in_dim(
          waiting, passed, jnp.mod(t, wait), 0)
      back = jax.lax.dynamic_index_in_dim(waiting, jnp.mod(t + 1, wait),
                                          keepdims=False)
      fresh = jnp.where(t + 1 < microbatches, fresh, back)
    return jnp.where(stage == 0, fresh, passed), waiting

  receive = per_stage(receive, stages, in_axes=(0, 0, 0, None, None))

  def tick(carry, tick_inputs, rep):
    """One tick; `rep` is the pass every stage is on (a static index into
    its chunks), or None where the stages are on different passes."""
    held, waiting = carry
    t, fresh = tick_inputs
    if rep is None:
      # Each stage's pass (clipped in the bubble, whose results are never
      # used); a dynamic index copies the chunk's weights each tick.
      reps = jnp.clip((t - stage_ids) // microbatches, 0, repeats - 1)
      computed = per_stage(compute, stages)(chunks, reps, held)
    else:
      computed = per_stage(stage_fn, stages)(
          jax.tree.map(lambda p: p[:, rep], chunks), held)
    passed = hand_off(computed, mesh)
    held, waiting = receive(stage_ids, passed, waiting, t, fresh)
    return (held, waiting), passed

  # The new microbatch entering stage 0 after each tick (scanned over, so
  # the backward pass needs no scatter into the whole input per tick).
  fresh = jnp.concatenate([inputs[1:], jnp.zeros(
      (ticks - microbatches + 1,) + inputs.shape[1:], inputs.dtype)])
  carry = per_stage(
      lambda s: (jnp.where(s == 0, inputs[0], jnp.zeros_like(inputs[0])),
                 jnp.zeros((wait if repeats > 1 else 1,) + inputs.shape[1:],
                           inputs.dtype)), stages)(stage_ids)
  passed = []
  for start, length, rep in _segments(stages, microbatches, repeats):
    carry, out = jax.lax.scan(
        functools.partial(tick, rep=rep), carry,
        (jnp.arange(start, start + length), fresh[start:start + length]))
    passed.append(out)
  passed = jnp.concatenate(passed)
  # Microbatch m's last pass reaches stage 0 at tick (R - 1) M + m + S - 1.
  first = (repeats - 1) * microbatches + stages - 1
  return passed[first:first + microbatches, 0]


def _segments(stages: int, microbatches: int, repeats: int):
  """The ticks as (start, length, pass) runs in which every stage is on
  the same pass (None: the stages straddle two). Stage s starts pass r at
  tick r M + s, so only the S - 1 ticks after each r M straddle."""
  runs = [(0, microbatches, 0)]
  for rep in range(1, repeats):
    runs += [(rep * microbatches, stages - 1, None),
             (rep * microbatches + stages - 1, microbatches - stages + 1, rep)]
  runs.append((repeats * microbatches, stages - 1, repeats - 1))
  merged = []
  for start, length, rep in runs:
    if length == 0:
      continue
    if merged and rep is not None and merged[-1][2] == rep:
      merged[-1] = (merged[-1][0], merged[-1][1] + length, rep)
    else:
      merged.append((start, length, rep))
  return merged


def make_loss(layout, embed: Callable, layer: Callable,
              token_losses: Callable, logical_params, microbatches: int,
              mesh, remat: bool = False) -> Callable:
  """The mean next-token loss of staged params, pipelined.

  Returns loss(staged_params, sequences) with `sequences` [B, L + 1]; its
  gradient is the staged gradient (each stage's own layers and pieces).

  Args:
    layout: the stages.StageLayout of the params.
    embed: (whole non-layer params, tokens [B, L]) -> activations [B, L, d].
    layer: (one layer's params, activations) -> activations.
    token_losses: (whole non-layer params, activations, targets [B, L]) ->
      per-position losses [B, L].
    logical_params: the logical params (abstract), for the cut axes.
    microbatches: M, a multiple of S dividing B.
    mesh: the compute mesh.
    remat: keep only each stage's input per tick for the backward pass and
      recompute the rest (activation memory of one microbatch per stage
      and tick, for about a third more compute).
  """
  stages, repeats = layout.stages, layout.repeats

  def run_chunk(chunk, h):
    h, _ = jax.lax.scan(lambda h, p: (layer(p, h), None), h, chunk)
    return h

  if remat:
    run_chunk = jax.checkpoint(
        run_chunk, policy=jax.checkpoint_policies.nothing_saveable)

  def chunks_of(layers):
    """One stage's layers as [R, L / (S R), ...]: chunk r's layers."""
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs),
                           *[layers[i] for i in range(len(layers))])
    return jax.tree.map(lambda x: x.reshape(repeats, -1, *x.shape[1:]),
                        stacked)

  def loss(staged_params, sequences):
    ends = layout.ends(staged_params, logical_params)
    chunks = per_stage(chunks_of, stages)(staged_params[LAYERS])
    parts = _microbatches(sequences, microbatches, mesh)  # [M, B/M, L + 1]
    inputs, targets = parts[..., :-1], parts[..., 1:]
    activations = embed(ends, inputs.reshape(-1, inputs.shape[-1]))
    activations = activations.reshape(*inputs.shape, -1)
    outputs = run_stages(run_chunk, chunks, activations, stages, repeats,
                         mesh)
    # Stage s scores microbatches s M/S .. (s + 1) M/S - 1.
    shares = outputs.reshape(stages, -1, *outputs.shape[1:])
    target_shares = targets.reshape(stages, -1, *targets.shape[1:])

    def stage_loss(h, t):
      return token_losses(ends, h.reshape(-1, *h.shape[2:]),
                          t.reshape(-1, t.shape[-1])).mean()

    return per_stage(stage_loss, stages)(shares, target_shares).mean()

  return loss


def _microbatches(sequences: jax.Array, microbatches: int,
                  mesh) -> jax.Array:
  """[B, ...] -> [M, B/M, ...]: microbatch i takes sequences i, i + M, ...,
  so each stays split over the island's 'data' devices like the batch."""
  batch = sequences.shape[0]
  parts = sequences.reshape(batch // microbatches, microbatches,
                            *sequences.shape[1:]).swapaxes(0, 1)
  return jax.lax.with_sharding_constraint(
      parts, NamedSharding(context_mesh(mesh), P(None, DATA)))
