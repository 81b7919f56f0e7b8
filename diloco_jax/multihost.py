"""Several processes, one run: starting jax.distributed and moving host data.

Every process runs the same program (SPMD). A process holds the islands
whose device slots include its devices: with more islands than processes
each process holds several (folded) islands; with an island's 'data' or
'stage' devices spread over several processes, each of them holds that
island. A process reads the data of its own islands only.

Host-side values that differ between processes (an island's loss, a data
stream's position) are gathered here, with collectives over every process,
so that every process takes the same decisions (stop, roll back) and
process 0 can write the whole run's metrics and checkpoint metadata.
"""

import json
import os
from collections.abc import Mapping

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# The launcher (diloco_jax.launch) and users set these, as JAX reads
# JAX_COORDINATOR_ADDRESS itself.
NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "JAX_PROCESS_ID"
COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
# A process that stops sending heartbeats is declared dead after this long,
# and the others fail instead of waiting in a collective for it.
DEFAULT_HEARTBEAT_TIMEOUT_S = 30


def process_count_hint(num_processes: int | None = None) -> int:
  """How many processes the run will have, known before JAX starts.

  From the flag, the launcher's environment or SLURM's task count; 1 when
  none says (TPU pods and other auto-detected clusters report it only after
  jax.distributed starts, and need no CPU device count from it).
  """
  for value in (num_processes, os.environ.get(NUM_PROCESSES_ENV),
                os.environ.get("SLURM_NTASKS")):
    if value not in (None, ""):
      return max(int(value), 1)
  return 1


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None,
               heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S
               ) -> bool:
  """Starts jax.distributed when the run has several processes.

  Sources, in order: the arguments (main's flags); the environment
  variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID
  (what diloco_jax.launch sets); a cluster JAX detects itself (SLURM with
  several tasks, a multi-host TPU slice, Open MPI). Without any of them
  this is a no-op: one process. Must run before JAX initializes a backend.

  Returns:
    Whether jax.distributed was started.
  """
  coordinator_address = coordinator_address or os.environ.get(COORDINATOR_ENV)
  if num_processes is None and os.environ.get(NUM_PROCESSES_ENV):
    num_processes = int(os.environ[NUM_PROCESSES_ENV])
  if process_id is None and os.environ.get(PROCESS_ID_ENV):
    process_id = int(os.environ[PROCESS_ID_ENV])
  explicit = coordinator_address is not None
  if not explicit and not _cluster_detected():
    return False
  if explicit and num_processes == 1:
    return False
  jax.distributed.initialize(
      coordinator_address=coordinator_address, num_processes=num_processes,
      process_id=process_id, heartbeat_timeout_seconds=heartbeat_timeout_s)
  logging.info("process %d of %d (coordinator %s)", jax.process_index(),
               jax.process_count(), coordinator_address or "auto-detected")
  return True


def _cluster_detected() -> bool:
  """A multi-process cluster environment JAX can configure itself from."""
  if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1:
    return True
  if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
    return True
  # Multi-host TPU slices name their workers; one host needs no setup.
  hostnames = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  return len([h for h in hostnames.split(",") if h]) > 1


def idle_processes(mesh) -> list[int]:
  """The processes none of whose devices are in `mesh` (every process of a
  run must hold an island or a share of one)."""
  used = {device.process_index for device in mesh.devices.flat}
  return [p for p in range(jax.process_count()) if p not in used]


def local_islands(sharding, global_shape) -> range:
  """The islands (leading axis of `global_shape`) this process holds.

  Raises ValueError if they are not consecutive (the mesh puts each
  process's devices in consecutive island slots).
  """
  held = set()
  for index in sharding.addressable_devices_indices_map(
      tuple(global_shape)).values():
    island = index[0]
    held.add((island.start or 0,
              global_shape[0] if island.stop is None else island.stop))
  first, last = min(start for start, _ in held), max(stop for _, stop in held)
  covered = set().union(*(range(start, stop) for start, stop in held))
  if covered != set(range(first, last)):
    raise ValueError(
        f"this process's islands are not consecutive: {sorted(held)}")
  return range(first, last)


def global_batch(local_batch: np.ndarray, sharding, global_shape
                 ) -> jax.Array:
  """The global [islands, ...] array from this process's islands' rows.

  `local_batch` holds every row of this process's islands (a process
  sharing an island with others still reads the island's whole batch; each
  device takes its own slice).
  """
  return jax.make_array_from_process_local_data(sharding, local_batch,
                                                tuple(global_shape))


def fetch(tree):
  """device_get for arrays that may span other processes' devices.

  Single-process (and fully replicated) arrays are fetched directly; the
  others are gathered from every process, all in one collective (every
  process must call this at the same point).
  """
  leaves, treedef = jax.tree.flatten(tree)
  spread = [i for i, x in enumerate(leaves)
            if isinstance(x, jax.Array) and not x.is_fully_addressable
            and not x.is_fully_replicated]
  fetched = jax.device_get([x for i, x in enumerate(leaves)
                            if i not in spread])
  gathered = (multihost_utils.process_allgather(
      [leaves[i] for i in spread], tiled=True) if spread else [])
  local, remote = iter(fetched), iter(gathered)
  return treedef.unflatten([np.asarray(next(remote)) if i in spread
                            else next(local) for i in range(len(leaves))])


def _process_mesh() -> Mesh:
  """A mesh of one device per process: each process's first device.

  The small host-value gathers run there and nowhere else. jax's own
  process_allgather spans every device, the outer device of
  config.diloco.outer_placement='host' (each process's LAST CPU device)
  included, so a gather each step would queue behind the collective in
  flight there and stall the islands until it lands.
  """
  first = {}
  for device in jax.devices():
    first.setdefault(device.process_index, device)
  return Mesh(np.array([first[p] for p in sorted(first)]), ("processes",))


def _identity(x):
  return x


def process_allgather(value) -> np.ndarray:
  """[processes, *shape]: every process's numpy `value`, stacked in
  process order (a collective: every process calls it at the same point
  with the same shape and dtype)."""
  value = np.asarray(value)
  if jax.process_count() == 1:
    return value[None]
  mesh = _process_mesh()
  local = next(d for d in mesh.devices.flat
               if d.process_index == jax.process_index())
  spread = jax.make_array_from_single_device_arrays(
      (mesh.size,) + value.shape, NamedSharding(mesh, P("processes")),
      [jax.device_put(value[None], local)])
  gathered = jax.jit(_identity, out_shardings=NamedSharding(mesh, P()))(
      spread)
  return np.asarray(gathered.addressable_data(0))


def any_process(flag: bool) -> bool:
  """Whether `flag` is set on any process (a collective when several).

  A signal reaches the processes of a run at slightly different steps;
  deciding together makes every process stop at the same step.
  """
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.any(process_allgather(np.array([flag], np.bool_))))


def gather_json(value) -> list:
  """Every process's JSON-serializable `value`, in process order.

  One process: [value]. Otherwise two small collectives (the lengths, then
  the padded bytes); every process must call this at the same point.
  """
  if jax.process_count() == 1:
    return [value]
  payload = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
  lengths = process_allgather(np.array(payload.size, np.int32))
  padded = np.zeros(int(np.max(lengths)), np.uint8)
  padded[:payload.size] = payload
  gathered = process_allgather(padded)
  return [json.loads(bytes(row[:int(n)]).decode())
          for row, n in zip(gathered, lengths)]


def merge_island_states(state: Mapping, islands: range,
                        num_islands: int) -> dict:
  """A data source's state for all islands, from each process's own.

  A source's state is either the same on every process ({'step': n}: batches
  are a function of the step) or lists per-island positions of its own
  islands under 'islands'; those are gathered into one list of
  `num_islands` (an island held by several processes has one position).
  """
  if "islands" not in state:
    return dict(state)
  merged = [None] * num_islands
  for shard in gather_json({"first": islands.start,
                            "islands": state["islands"]}):
    for offset, position in enumerate(shard["islands"]):
      if merged[shard["first"] + offset] is None:
        merged[shard["first"] + offset] = position
  return {**state, "islands": merged}
