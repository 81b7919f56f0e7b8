"""The device mesh: named axes ('island', 'data', 'stage').

'island' is the slow link between islands (across data centers, DCN or
processes); 'data' is data parallelism inside an island; 'stage' is pipeline
parallelism inside an island. Unused axes have size 1.
"""

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

ISLAND = "island"
DATA = "data"
STAGE = "stage"
AXES = (ISLAND, DATA, STAGE)


def build_mesh(islands: int, data: int = 1, stage: int = 1,
               devices=None) -> Mesh:
  """Builds the (island, data, stage) mesh from the first devices.

  `jax.devices()` is ordered by process, so consecutive devices (one host's)
  land in the same island and only the 'island' axis crosses hosts.

  The axes are Auto rather than Explicit on purpose: collectives are written
  by hand inside shard_map, and the rest of the program lets XLA propagate
  shardings from the arrays we place.
  """
  devices = jax.devices() if devices is None else devices
  needed = islands * data * stage
  if needed > len(devices):
    raise ValueError(
        f"mesh {islands}x{data}x{stage} needs {needed} devices, "
        f"{len(devices)} available")
  grid = np.asarray(devices[:needed]).reshape(islands, data, stage)
  return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 3)
