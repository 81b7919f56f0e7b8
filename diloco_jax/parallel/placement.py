"""Where arrays live: per-island functions on the mesh, and sharding rules.

`island_map` runs a function once per logical island, whatever the
placement: a shard_map that is manual over the 'island' device axis only,
and inside it a `vmap` (axis FOLDED) over the islands stacked on each
device slot. Inside an island, arrays keep the shardings declared for them
(data parallel over 'data', optionally FSDP) and XLA inserts the collectives
among the island's own devices.

`fsdp_spec` is the one sharding rule inside an island: with FSDP, each
array large enough is split over 'data' along its largest dimension that
divides evenly (as big_vision's and MaxText's fsdp rules do); without it,
arrays are replicated over the island's devices.
"""

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from diloco_jax.parallel.mesh import DATA, FOLDED, ISLAND, STAGE

# Per-island arrays are stacked on a leading axis split over 'island'.
PER_ISLAND = P(ISLAND)
REPLICATED = P()
# Leaves smaller than this stay replicated under FSDP: gathering them costs
# a collective's latency for a few kilobytes of memory.
MIN_FSDP_ELEMENTS = 4096


def _is_spec(x) -> bool:
  return isinstance(x, P)


def _per_island(spec) -> bool:
  """Whether `spec` stacks islands on its leading axis."""
  return len(spec) > 0 and spec[0] == ISLAND


def island_map(fn: Callable, mesh, in_specs, out_specs,
               check_vma: bool = True, stage_manual: bool = False
               ) -> Callable:
  """Maps `fn` over every logical island on `mesh`.

  Args:
    fn: takes and returns one island's values (no island axis). Collectives
      over communication's island axes reach every logical island.
    mesh: the (island, data, stage) mesh.
    in_specs: for each argument, PER_ISLAND (stacked [islands, ...]) or
      REPLICATED (the same for every island); a pytree prefix of the
      arguments, as for shard_map.
    out_specs: the same for the outputs. A REPLICATED output must be the
      same on every island (e.g. the result of a collective); island 0's is
      returned.
    check_vma: as for shard_map; outputs of compressed collectives are the
      same on every island but typed as varying, so those callers pass
      False.
    stage_manual: the 'stage' axis is manual too: each device runs `fn` on
      its own stage (specs name STAGE for staged arrays, which `fn` sees
      with a stage axis of 1), so a collective over the island axes
      reaches the same stage of the other islands only. (Left to XLA's
      partitioner, a collective whose operand is split over the auto
      'stage' axis was gathered over the stages first: every device then
      sent every stage's values, measured as 2x the bytes at 2 stages.)

  Returns:
    A function of the stacked/replicated arguments.
  """
  to_axis = lambda spec: 0 if _per_island(spec) else None

  def per_device(*args):
    in_axes = jax.tree.map(to_axis, tuple(in_specs), is_leaf=_is_spec)
    outputs = jax.vmap(fn, in_axes=in_axes, axis_name=FOLDED)(*args)
    # Every output comes out of vmap stacked; a replicated one is the same
    # in every row, so the first row is it (XLA folds the slice away when
    # the row was a broadcast).
    return jax.tree.map(
        lambda spec, out: out if _per_island(spec) else jax.tree.map(
            lambda x: x[0], out),
        out_specs, outputs, is_leaf=_is_spec)

  return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs,
                       out_specs=out_specs,
                       axis_names={ISLAND, STAGE} if stage_manual else {ISLAND},
                       check_vma=check_vma)


def fsdp_spec(shape, data_size: int, fsdp: bool) -> P:
  """The spec of an island-local array of `shape` (no island axis).

  With `fsdp`, the largest dimension divisible by `data_size` is split over
  'data' (ties: the first); small arrays and arrays without such a
  dimension stay replicated, as does everything without `fsdp`.
  """
  size = 1
  for dim in shape:
    size *= dim
  if not fsdp or data_size <= 1 or size < MIN_FSDP_ELEMENTS:
    return P()
  candidates = [i for i, dim in enumerate(shape) if dim % data_size == 0]
  if not candidates:
    return P()
  axis = max(candidates, key=lambda i: (shape[i], -i))
  return P(*([None] * axis + [DATA]))


def stage_split_spec(shape, data_size: int, fsdp: bool, stages: int) -> P:
  """`fsdp_spec`, and with `stages` > 1 the largest other dimension that
  `stages` divides split over 'stage' too (replicated over the stages if
  none): how a logical array of a pipelined island is held while it is
  converted to or from the stages' layout, at 1 / S of its size per
  device."""
  spec = list(fsdp_spec(shape, data_size, fsdp))
  if stages <= 1:
    return P(*spec)
  spec += [None] * (len(shape) - len(spec))
  free = [i for i, dim in enumerate(shape)
          if spec[i] is None and dim % stages == 0]
  if free:
    spec[max(free, key=lambda i: (shape[i], -i))] = STAGE
  while spec and spec[-1] is None:
    spec.pop()
  return P(*spec)


def constrain(tree, shardings):
  """`tree` with each leaf constrained to its sharding (inside jit).

  `shardings`: NamedShardings, or PartitionSpecs inside an island_map (whose
  mesh they then refer to).
  """
  return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def with_shardings(abstract_tree, shardings):
  """jax.ShapeDtypeStructs of `abstract_tree` placed on `shardings` (a tree
  like it), to compile or restore for that placement."""
  return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract_tree, shardings)


def stripe_axis(shape, stripes: int) -> int | None:
  """The axis FSDP splits over `stripes` devices, or None (replicated)."""
  spec = fsdp_spec(shape, stripes, True)
  return spec.index(DATA) if DATA in spec else None


def stripe(tree, stripes: int):
  """Lays a pytree out as one float32 matrix [stripes, n], row s on device s.

  Each leaf split over the island's `stripes` 'data' devices contributes its
  local shard to its device's row (its split axis moved to the front, so
  the reshape only relabels local memory); a replicated leaf is cut into
  `stripes` equal parts (zero-padded). With one stripe this is
  `ravel_pytree`'s order. Codecs then work row by row, so a dense
  compressed collective never gathers the whole tree on one device.

  Returns:
    (matrix, unstripe): unstripe(matrix) gives back the tree's leaves in
    their own shapes and dtypes.
  """
  leaves, treedef = jax.tree.flatten(tree)
  rows, layouts = [], []
  for leaf in leaves:
    axis = stripe_axis(leaf.shape, stripes) if stripes > 1 else None
    x = leaf.astype(jnp.float32)
    if axis is not None:
      x = jnp.moveaxis(x, axis, 0)
      rows.append(x.reshape(stripes, -1))
    else:
      flat = x.reshape(-1)
      padded = math.ceil(flat.size / stripes) * stripes
      rows.append(jnp.pad(flat, (0, padded - flat.size)).reshape(stripes, -1))
    layouts.append((axis, x.shape, leaf.shape, leaf.dtype, rows[-1].shape[1]))
  matrix = jnp.concatenate(rows, axis=1)
  if stripes > 1:
    matrix = jax.lax.with_sharding_constraint(matrix, P(DATA))

  def unstripe(values):
    out, start = [], 0
    for axis, moved_shape, shape, dtype, width in layouts:
      part = values[:, start:start + width]
      start += width
      if axis is not None:
        x = jnp.moveaxis(part.reshape(moved_shape), 0, axis)
      else:
        x = part.reshape(-1)[:math.prod(shape)].reshape(shape)
      out.append(x.astype(dtype))
    return jax.tree.unflatten(treedef, out)

  return matrix, unstripe


def stripe_width(shapes, stripes: int) -> int:
  """Columns of stripe()'s matrix for leaves of these shapes."""
  width = 0
  for shape in shapes:
    size = math.prod(shape)
    width += (size // stripes if stripes > 1 and stripe_axis(shape, stripes)
              is not None else math.ceil(size / stripes))
  return width


def stripe_pieces(leaf, stripes: int):
  """`leaf` as [stripes, *piece], piece s on device s, and a function
  that puts such a stack back into the leaf's shape.

  A leaf FSDP splits comes apart along its split axis (each piece is the
  shard one device holds, so this only relabels local memory); any other
  leaf is flattened, zero-padded and cut into `stripes` equal vectors, as
  `stripe` cuts it. Codecs that select or factor matrices (top-k, SparseLoCo,
  low rank) then run batched over the pieces, on the devices holding them.
  """
  shape = leaf.shape
  axis = stripe_axis(shape, stripes)
  if axis is not None:
    pieces = leaf.reshape(shape[:axis] + (stripes, shape[axis] // stripes)
                          + shape[axis + 1:])
    pieces = jnp.moveaxis(pieces, axis, 0)
    join = lambda p: jnp.moveaxis(p, 0, axis).reshape(shape)
  else:
    size = math.prod(shape)
    width = -(-size // stripes)
    pieces = jnp.pad(leaf.reshape(-1), (0, width * stripes - size)).reshape(
        stripes, width)
    join = lambda p: p.reshape(-1)[:size].reshape(shape)
  return jax.lax.with_sharding_constraint(pieces, P(DATA)), join


def piece_shape(shape, stripes: int) -> tuple[int, ...]:
  """The shape of one of stripe_pieces's pieces of a leaf of `shape`."""
  axis = stripe_axis(shape, stripes)
  if axis is not None:
    return shape[:axis] + (shape[axis] // stripes,) + shape[axis + 1:]
  return (-(-math.prod(shape) // stripes),)


def map_stripes(fn: Callable, stripes_args, shared_args=()):
  """Runs fn(local_stripes, *shared_args) on each 'data' device of every
  island, on the stripes it holds.

  `stripes_args` is a pytree of [stripes, ...] arrays (stripe_pieces'
  layout: stripe s on 'data' device s); fn gets the [local, ...] stripes of
  its device and returns a pytree of [local, ...] arrays, stacked back into
  [stripes, ...]. Inside fn, `stripes_sum` and `stripes_gather` reach the
  island's other stripes. Under a context mesh whose 'data' axis has
  several devices this is a shard_map manual over 'data' (so XLA keeps
  each device's work on its own shards, where its partitioner would
  gather some ops' operands); elsewhere (one device per island, an outer
  device holding whole islands, plain vmap) fn gets every stripe.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or DATA not in mesh.axis_names or mesh.shape[DATA] == 1:
    return fn(stripes_args, *shared_args)
  return jax.shard_map(
      fn, mesh=mesh, in_specs=(P(DATA),) + (P(),) * len(shared_args),
      out_specs=P(DATA), axis_names={DATA}, check_vma=False)(
          stripes_args, *shared_args)


def _data_is_manual() -> bool:
  mesh = jax.sharding.get_abstract_mesh()
  return (not mesh.empty and DATA in mesh.axis_names and mesh.shape[DATA] > 1
          and mesh.axis_types[mesh.axis_names.index(DATA)]
          == jax.sharding.AxisType.Manual)


def stripes_sum(x):
  """Inside map_stripes: the sum of [local, ...] `x` over every stripe of
  the island (a psum among its 'data' devices)."""
  total = jnp.sum(x, axis=0)
  return jax.lax.psum(total, DATA) if _data_is_manual() else total


def stripes_gather(x):
  """Inside map_stripes: [local, ...] `x` of every stripe of the island,
  [stripes, ...] in stripe order."""
  return (jax.lax.all_gather(x, DATA, axis=0, tiled=True)
          if _data_is_manual() else x)


def local_stripes(x):
  """Inside map_stripes: this device's rows of a [stripes, ...] array every
  device holds whole."""
  if not _data_is_manual():
    return x
  local = x.shape[0] // jax.lax.axis_size(DATA)
  return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(DATA) * local,
                                      local)
