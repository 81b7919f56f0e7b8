"""One pipeline stage's part of staged arrays, as arrays of its own.

A staged array is split over the mesh's 'stage' axis: the devices of stage
s hold its part s. `stage_part` gives that part as an array on the stage's
own devices (`stage_mesh`: the mesh with its 'stage' axis cut down to
stage s), without copying: its shards are the same buffers. A program
compiled on the stage's mesh then runs on those devices alone, and its
collectives reach the same stage of the other islands only, so one stage
can sync while the others train (Streaming DiLoCo with one fragment per
stage). `take_stage_part` and `put_stage_part` take the part out and put
the program's result back into the whole array, again without copying.

An array not split over 'stage' (replicated, like a step count or the
islands' weights) is whole on every stage: its part is the whole array on
the stage's devices.
"""

import jax
import numpy as np
from jax.sharding import NamedSharding

from diloco_jax.parallel.mesh import STAGE


def stage_mesh(mesh, stage: int) -> jax.sharding.Mesh:
  """The devices of stage `stage` of `mesh`, as a mesh of the same axes
  whose 'stage' axis has size 1."""
  axis = mesh.axis_names.index(STAGE)
  devices = np.take(mesh.devices, [stage], axis=axis)
  return jax.sharding.Mesh(devices, mesh.axis_names,
                           axis_types=mesh.axis_types)


def stage_dim(spec) -> int | None:
  """The dimension a PartitionSpec splits over 'stage', or None.

  Raises:
    ValueError: 'stage' shares a dimension with another mesh axis (a part
      would not be one stage's contiguous block).
  """
  for dim, entry in enumerate(spec):
    if entry == STAGE:
      return dim
    if isinstance(entry, tuple) and STAGE in entry:
      raise ValueError(f"spec {spec} splits a dimension over 'stage' and "
                       "other axes; a stage's part is not a block of it")
  return None


def _part_shape(shape, spec, stages: int) -> tuple[int, ...]:
  dim = stage_dim(spec)
  shape = list(shape)
  if dim is not None:
    shape[dim] //= stages
  return tuple(shape)


def stage_sharding(sharding: NamedSharding, stage: int) -> NamedSharding:
  """Where stage `stage`'s part of an array on `sharding` lives: the same
  spec on the stage's mesh."""
  return NamedSharding(stage_mesh(sharding.mesh, stage), sharding.spec)


def _part(leaf, stage: int):
  sharding = leaf.sharding
  part_sharding = stage_sharding(sharding, stage)
  shape = _part_shape(leaf.shape, sharding.spec, sharding.mesh.shape[STAGE])
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=part_sharding)
  devices = set(part_sharding.mesh.devices.flat)
  return jax.make_array_from_single_device_arrays(
      shape, part_sharding,
      [shard.data for shard in leaf.addressable_shards
       if shard.device in devices])


def stage_part(tree, stage: int):
  """Stage `stage`'s part of every array of `tree` (jax.Arrays, or
  jax.ShapeDtypeStructs with NamedShardings), on that stage's devices
  (stage_mesh): zero-copy views of the shards it holds. None stays None."""
  return jax.tree.map(lambda leaf: _part(leaf, stage), tree)


class _Rest:
  """An array's shards on the other stages' devices, and where the whole
  goes: what put_stage_part needs besides the new part."""

  def __init__(self, whole: jax.Array, stage: int):
    if stage_dim(whole.sharding.spec) is None:
      raise ValueError("an array not split over 'stage' has no part of one "
                       "stage to replace")
    devices = set(stage_mesh(whole.sharding.mesh, stage).devices.flat)
    self.shape, self.sharding = whole.shape, whole.sharding
    self.shards = [shard.data for shard in whole.addressable_shards
                   if shard.device not in devices]


def take_stage_part(tree, stage: int):
  """(stage_part(tree, stage), rest): the part, and what put_stage_part
  needs to rebuild `tree` around a replacement of it. Taken before a
  program that donates the part (the whole arrays are deleted with it)."""
  return (stage_part(tree, stage),
          jax.tree.map(lambda whole: _Rest(whole, stage), tree))


def put_stage_part(rest, part):
  """The whole arrays again, `part` (e.g. a program's result on the stage's
  mesh, shaped as take_stage_part's) in place of the stage's old part; the
  other stages' shards are reused as they are."""
  return jax.tree.map(
      lambda r, new: jax.make_array_from_single_device_arrays(
          r.shape, r.sharding,
          [shard.data for shard in new.addressable_shards] + r.shards),
      rest, part)


def with_stage_part(tree, part, stage: int):
  """`tree` (jax.Arrays split over 'stage', none deleted) with stage
  `stage`'s part replaced by `part`."""
  return put_stage_part(take_stage_part(tree, stage)[1], part)
