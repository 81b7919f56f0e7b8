"""The device mesh, named axes ('island', 'data', 'stage'), and island folding.

'island' is the slow link between islands (across data centers, DCN or
processes); 'data' is data parallelism inside an island; 'stage' is pipeline
parallelism inside an island. Unused axes have size 1.

Islands are logical, devices are physical: k islands sit on the mesh's
'island' axis of d device slots (d divides k) times a folded axis of k / d
islands stacked on each slot and mapped with `vmap` (named FOLDED). So 8
islands run on one GPU, on 2 devices, or on 8 hosts with the same program;
the cross-island collectives span both axes (ISLANDS).
"""

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

ISLAND = "island"
DATA = "data"
STAGE = "stage"
AXES = (ISLAND, DATA, STAGE)
# The vmap axis of the islands folded onto one 'island' slot.
FOLDED = "folded"
# Every logical island: the device slot (outer), then the folded index.
ISLANDS = (ISLAND, FOLDED)


def device_islands(islands: int, devices_per_island: int,
                   num_devices: int) -> int:
  """How many 'island' device slots k islands get: the most that fit.

  The largest divisor d of `islands` with d x devices_per_island devices
  available; the other islands fold onto those slots (k / d per slot). 0
  when not even one island's devices are available.
  """
  fitting = [d for d in range(1, islands + 1)
             if islands % d == 0 and d * devices_per_island <= num_devices]
  return max(fitting, default=0)


def build_mesh(islands: int, data: int = 1, stage: int = 1,
               devices=None) -> Mesh:
  """The (island, data, stage) mesh for `islands` logical islands.

  Uses as many of `devices` (default: all) as fit: 'island' has
  device_islands(...) slots, each of data x stage devices. `jax.devices()`
  is ordered by process, so consecutive devices (one host's) land in the
  same island slot and only the 'island' axis crosses hosts.

  The axes are Auto rather than Explicit on purpose: cross-island
  collectives are written by hand inside a shard_map that is manual over
  'island' only, and inside an island XLA propagates the declared shardings.
  """
  devices = jax.devices() if devices is None else devices
  slots = device_islands(islands, data * stage, len(devices))
  if not slots:
    raise ValueError(
        f"one island needs data x stage = {data} x {stage} devices, "
        f"{len(devices)} available")
  grid = np.asarray(devices[:slots * data * stage]).reshape(slots, data, stage)
  return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 3)


def folded_islands(mesh: Mesh, islands: int) -> int:
  """Islands stacked on each 'island' slot of `mesh`."""
  return islands // mesh.shape[ISLAND]
