"""Pipeline stages inside an island: which stage holds what, and code that
runs once per stage.

An island of S stages keeps each layer on one stage only, and 1 / S of
every other leaf. A params-shaped tree (the model's params, an optimizer's
moments, a residual: any mapping with a LAYERS entry holding one subtree
per layer) has two layouts:

  logical   one entry per layer (blocks/0 .. blocks/L-1), every other
            leaf whole: what checkpoints, warm starts and byte counts see,
            whatever S is, so a run may resume with another S;
  staged    what the compiled steps take: S per-stage trees of the same
            structure stacked on a leading axis of S, split over the mesh's
            'stage' axis. Stage s holds its own layers as blocks/0 ..
            blocks/(L/S - 1) and piece s of every other leaf, cut along its
            largest dimension that S divides (`split_axis`).

With R repeats (the circular schedule) the layers form S x R chunks of
L / (S R) consecutive layers, chunk c = r S + s on stage s, so stage s
holds chunks s, s + S, s + 2S, ... (pipeline.py). Leaves that are not
params-shaped (an optimizer's step count) get one copy per stage: each
stage's optimizer is its own (DiLoCoX's dual optimizer).

`per_stage` runs a function of one stage's values on every stage at once:
a `vmap` over the stage axis whose values stay split over 'stage'
(spmd_axis_name), so each device computes its own stage. Collectives over
STAGE inside it (psum, all_gather) reach the island's other stages; the
hand-off of activations between neighbouring stages is `hand_off`, one
ppermute.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from diloco_jax.parallel.mesh import STAGE

LAYERS = "blocks"  # the params entry that holds one subtree per layer


def split_axis(shape, stages: int) -> int | None:
  """The axis a non-layer leaf of logical `shape` is cut along: its largest
  dimension that `stages` divides (ties: the first), None if none does."""
  candidates = [i for i, dim in enumerate(shape) if dim % stages == 0]
  if not candidates:
    return None
  return max(candidates, key=lambda i: (shape[i], -i))


def is_params(tree) -> bool:
  """Whether `tree` is a params-shaped subtree (logical or staged)."""
  return isinstance(tree, Mapping) and LAYERS in tree


def _raw(tree) -> Mapping:
  """The plain nested dicts under a params-shaped tree: an nnx.State's
  own (its inner levels are dicts, which it wraps only when indexed), or
  the tree itself."""
  return getattr(tree, "raw_mapping", tree)


def _like(tree, mapping: dict):
  """`mapping` as the top level of a tree of `tree`'s type."""
  return type(tree)(mapping)


@dataclasses.dataclass(frozen=True)
class StageLayout:
  """How a model's params are laid out over S pipeline stages.

  Attributes:
    stages: S (>= 2; one stage has no layout).
    repeats: R, the passes a microbatch makes around the stages (1: GPipe;
      more: the circular schedule).
    num_layers: L, a multiple of S x R.
  """
  stages: int
  repeats: int
  num_layers: int

  def __post_init__(self):
    if self.num_layers % (self.stages * self.repeats):
      raise ValueError(f"{self.num_layers} layers do not split into "
                       f"{self.stages} stages x {self.repeats} repeats")

  @property
  def layers_per_stage(self) -> int:
    return self.num_layers // self.stages

  @property
  def layers_per_chunk(self) -> int:
    return self.num_layers // (self.stages * self.repeats)

  def stage_layers(self, stage: int) -> list[int]:
    """The logical layers stage `stage` holds, in its own order."""
    chunk = self.layers_per_chunk
    return [(r * self.stages + stage) * chunk + i
            for r in range(self.repeats) for i in range(chunk)]

  # One params-shaped tree.

  def split_params(self, params):
    """A logical params-shaped tree in the staged layout ([S, ...] leaves)."""
    raw = _raw(params)
    layers = raw[LAYERS]
    staged_layers = {
        i: jax.tree.map(lambda *xs: jnp.stack(xs),
                        *[layers[self.stage_layers(s)[i]]
                          for s in range(self.stages)])
        for i in range(self.layers_per_stage)}
    rest = {name: jax.tree.map(self._cut, value)
            for name, value in raw.items() if name != LAYERS}
    return _like(params, {LAYERS: staged_layers, **rest})

  def join_params(self, staged, logical):
    """The logical tree back from split_params's; `logical` is any tree of
    the logical layout (e.g. abstract params), for the cut axes."""
    layers = {}
    for i, layer in _raw(staged)[LAYERS].items():
      for s in range(self.stages):
        layers[self.stage_layers(s)[i]] = jax.tree.map(
            lambda x, s=s: x[s], layer)
    ordered = {i: layers[i] for i in range(self.num_layers)}
    return _like(staged, {LAYERS: ordered, **self.ends(staged, logical)})

  def ends(self, staged, logical) -> dict:
    """The non-layer leaves whole (e.g. the embedding) from the staged
    tree: gathered over 'stage' where the stages are split; the transpose
    sums every stage's gradient into its own piece."""
    staged, logical = _raw(staged), _raw(logical)
    return {name: jax.tree.map(self._uncut, staged[name], logical[name])
            for name in staged if name != LAYERS}

  def stage_shapes(self, logical):
    """One stage's share of a logical params-shaped tree, abstract (every
    stage's has these shapes)."""
    staged = jax.eval_shape(self.split_params, logical)
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), staged)

  def _cut(self, leaf):
    axis = split_axis(leaf.shape, self.stages)
    if axis is None:
      raise ValueError(f"no dimension of a leaf of shape {leaf.shape} "
                       f"splits over {self.stages} stages")
    shape = leaf.shape
    pieces = leaf.reshape(shape[:axis] + (self.stages, shape[axis]
                                          // self.stages) + shape[axis + 1:])
    return jnp.moveaxis(pieces, axis, 0)

  def _uncut(self, pieces, logical_leaf):
    axis = split_axis(logical_leaf.shape, self.stages)
    return jnp.moveaxis(pieces, 0, axis).reshape(logical_leaf.shape)

  # Any tree holding params-shaped subtrees (a params tree, an optax state).

  def split(self, tree):
    """`tree` staged: each params-shaped subtree by split_params, every
    other leaf (a step count) copied once per stage."""
    return jax.tree.map(
        lambda t: (self.split_params(t) if is_params(t) else
                   jnp.broadcast_to(t, (self.stages,) + jnp.shape(t))),
        tree, is_leaf=is_params)

  def join(self, staged, logical):
    """The logical tree back from split's (`logical`: any tree of the
    logical layout, e.g. abstract; a copied leaf is taken from stage 0)."""
    return jax.tree.map(
        lambda t, l: self.join_params(t, l) if is_params(t) else t[0],
        staged, logical, is_leaf=is_params)


def per_stage(fn: Callable, stages: int, in_axes=0, out_axes=0) -> Callable:
  """`fn` of one stage's values, run on every stage at once.

  With S > 1 stages the arguments at `in_axes` carry the stage axis (a
  `vmap` over it, named STAGE so collectives inside reach the other
  stages, and kept split over the mesh's 'stage' axis: each device
  computes its own stage). With one stage, `fn` itself.
  """
  if stages == 1:
    return fn
  return jax.vmap(fn, in_axes=in_axes, out_axes=out_axes, axis_name=STAGE,
                  spmd_axis_name=STAGE)


def context_mesh(mesh):
  """The mesh to build a shard_map on: the enclosing shard_map's (abstract,
  with its manual axes) inside one, else `mesh`."""
  current = jax.sharding.get_abstract_mesh()
  if current is not None and not current.empty and current.manual_axes:
    return current
  return mesh


def hand_off(x: jax.Array, mesh) -> jax.Array:
  """Every stage's row of `x` [S, ...] to the next stage, the last stage's
  to the first: one ppermute over 'stage' (its transpose, in the backward
  pass, hands the other way)."""
  stages = x.shape[0]
  ring = [(s, (s + 1) % stages) for s in range(stages)]
  return jax.shard_map(lambda v: jax.lax.ppermute(v, STAGE, ring),
                       mesh=context_mesh(mesh), in_specs=P(STAGE),
                       out_specs=P(STAGE), axis_names={STAGE})(x)


def stage_index() -> jax.Array:
  """Inside per_stage: this stage's index."""
  return jax.lax.axis_index(STAGE)


def bytes_per_device(tree) -> int:
  """The bytes of `tree`'s arrays (or abstract arrays with shardings) one
  device holds: the most over devices of its shards' sizes there, read
  from the shardings."""
  held = {}
  for leaf in jax.tree.leaves(tree):
    shard = leaf.sharding.shard_shape(leaf.shape)
    size = math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    for device in leaf.sharding.device_set:
      held[device] = held.get(device, 0) + size
  return max(held.values(), default=0)
