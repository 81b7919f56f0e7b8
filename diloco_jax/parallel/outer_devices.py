"""Devices of their own for the outer step, and moving arrays onto them.

config.diloco.outer_placement='host' keeps x, the outer optimizer state and
the cross-island collective on one other device per process: the host's
CPU device beside GPUs or TPUs, or, on CPU-only hosts, a CPU device set
aside for it (`split_devices`). Arrays cross between the compute mesh and
those devices with `move`, which copies what each process holds without
any collective.
"""

import collections

import jax
import jax.numpy as jnp

from diloco_jax.parallel import mesh as mesh_lib

# config.diloco.outer_placement: with the islands, or on devices of its own.
PLACEMENTS = ("device", "host")


def split_devices(devices, per_process: int = 1) -> tuple[list, list]:
  """(compute devices, outer devices) for outer_placement='host'.

  `per_process` outer devices per process: one, or with pipeline stages
  one per stage, so each stage's outer state and collective have a device
  of their own. With accelerators among `devices`, each process's first
  `per_process` CPU devices are its outer devices and every accelerator
  computes. On CPU-only hosts each process's last `per_process` devices of
  `devices` are set aside for the outer side.

  Raises:
    ValueError: a process would be left without a compute device, or
      without enough CPU devices.
  """
  by_process = collections.defaultdict(list)
  for device in devices:
    by_process[device.process_index].append(device)
  if any(d.platform != "cpu" for d in devices):
    cpus = collections.defaultdict(list)
    for device in jax.devices("cpu"):
      cpus[device.process_index].append(device)
    short = [p for p in sorted(by_process) if len(cpus[p]) < per_process]
    if short:
      raise ValueError(
          f"config.diloco.outer_placement='host' keeps {per_process} outer "
          f"device(s) per process (one per pipeline stage) on its CPU "
          f"devices; process(es) {short} have fewer (diloco_jax.main makes "
          "them; elsewhere set jax_num_cpu_devices)")
    return list(devices), [d for p in sorted(by_process)
                           for d in cpus[p][:per_process]]
  compute, outer = [], []
  for process in sorted(by_process):
    local = by_process[process]
    if len(local) <= per_process:
      raise ValueError(
          "config.diloco.outer_placement='host' on CPU-only hosts sets "
          f"{per_process} CPU device(s) aside per process (one per pipeline "
          f"stage), beside those the islands compute on; process {process} "
          f"has {len(local)} (diloco_jax.main adds them; with --cpu_devices "
          f"or XLA_FLAGS, ask for {per_process} more)")
    compute += local[:-per_process]
    outer += local[-per_process:]
  return compute, outer


def islands_across_processes(mesh) -> list[int]:
  """The island slots of `mesh` whose devices are on several processes
  (with FSDP no process holds such an island whole, so 'host' cannot
  gather it without a collective of its own)."""
  return [slot for slot in range(mesh.shape[mesh_lib.ISLAND])
          if len({d.process_index for d in mesh.devices[slot].flat}) > 1]


def move(tree, shardings):
  """Copies every array of `tree` to `shardings` (a tree of them, or one),
  without any collective: each process copies what it holds.

  Each process must already hold every part its target shards need: both
  meshes put a process's islands on its own devices, and an island split
  over 'data' devices (FSDP) keeps them in one process.
  """
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: _move(x, shardings), tree)
  return jax.tree.map(_move, tree, shardings)


def _move(x: jax.Array, sharding) -> jax.Array:
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  # One copy of each distinct block this process holds (the shards of a
  # NamedSharding tile the array on a grid), by its (start, stop) per axis.
  blocks = {}
  for shard in x.addressable_shards:
    blocks.setdefault(_bounds(shard.index, x.shape), shard.data)
  arrays = []
  for device, index in sharding.addressable_devices_indices_map(
      x.shape).items():
    target = _bounds(index, x.shape)
    arrays.append(_assemble(
        {bounds: jax.device_put(data, device)
         for bounds, data in blocks.items() if _overlaps(bounds, target)},
        target, x.shape))
  return jax.make_array_from_single_device_arrays(x.shape, sharding, arrays)


def _bounds(index, shape) -> tuple[tuple[int, int], ...]:
  """A shard index's (start, stop) on every axis."""
  return tuple((part.start or 0, size if part.stop is None else part.stop)
               for part, size in zip(index, shape))


def _overlaps(bounds, target) -> bool:
  return all(start < t_stop and stop > t_start
             for (start, stop), (t_start, t_stop) in zip(bounds, target))


def _assemble(blocks: dict, target, shape, axis: int = 0) -> jax.Array:
  """The `target` region from the grid `blocks` overlapping it: along
  `axis`, each distinct span of blocks is assembled over the next axes and
  the spans are joined. ValueError if the blocks do not cover it."""
  if axis == len(target):
    (bounds, data), = blocks.items()
    return data[tuple(slice(t_start - start, t_stop - start)
                      for (start, _), (t_start, t_stop)
                      in zip(bounds, target))]
  t_start, t_stop = target[axis]
  spans = sorted({bounds[axis] for bounds in blocks})
  covered = sum(min(stop, t_stop) - max(start, t_start)
                for start, stop in spans)
  if covered != t_stop - t_start:
    raise ValueError(
        f"part {target} of an array of shape {shape} is not all on process"
        f" {jax.process_index()}")
  parts = []
  for start, stop in spans:
    clipped = tuple((max(start, t_start), min(stop, t_stop))
                    if a == axis else bounds for a, bounds in
                    enumerate(target))
    parts.append(_assemble(
        {b: d for b, d in blocks.items() if b[axis] == (start, stop)},
        clipped, shape, axis + 1))
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis)
