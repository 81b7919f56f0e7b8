"""Several processes, one run: starting jax.distributed and moving host data.

Every process runs the same program (SPMD). A process holds the islands
whose device slots include its devices: with more islands than processes
each process holds several (folded) islands; with an island's 'data' or
'stage' devices spread over several processes, each of them holds that
island. A process reads the data of its own islands only.

Host-side values that differ between processes (an island's loss, a data
stream's position, a stop request) are exchanged here every step, so that
every process takes the same decisions (stop, roll back) and process 0 can
write the whole run's metrics and checkpoint metadata. They go through
jax.distributed's key-value store (the coordinator), from the host, not
through device collectives: a collective runs in a device's stream, so
each inner step would wait behind a cross-island round trip, and on a
link busy with a sync in flight (one-step delay) behind its queue. From
the host, the round trip overlaps the inner step already dispatched.
"""

import io
import itertools
import json
import os
from collections.abc import Mapping

import jax
import numpy as np
from absl import logging
from jax._src import distributed

from diloco_jax.parallel import peer_watch

# The launcher (diloco_jax.launch) and users set these, as JAX reads
# JAX_COORDINATOR_ADDRESS itself.
NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "JAX_PROCESS_ID"
COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
# A process that stops sending heartbeats is declared dead after this long,
# and the others fail instead of waiting in a collective for it.
DEFAULT_HEARTBEAT_TIMEOUT_S = 30
# How long an exchange waits for the other processes' values (a process
# still compiling or saving a checkpoint is slow, not dead: a dead one is
# reported by the heartbeats first).
EXCHANGE_TIMEOUT_MS = 60 * 60 * 1000


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
  peer_watch.start(distributed.global_state.client, jax.process_index(),
                   jax.process_count(), heartbeat_timeout_s)
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


def _encode(arrays: Mapping[str, np.ndarray]) -> bytes:
  buffer = io.BytesIO()
  np.savez(buffer, **arrays)
  return buffer.getvalue()


def _decode(payload: bytes) -> dict[str, np.ndarray]:
  with np.load(io.BytesIO(payload), allow_pickle=False) as arrays:
    return {name: arrays[name] for name in arrays.files}


# Exchanges are numbered in the order a process makes them; every process
# makes the same ones in the same order (SPMD), so the n-th of each meet.
_exchange_numbers = itertools.count()
# A process's posts are kept in blocks of this many, deleted a block at a
# time (one request; every request crosses the link).
_BLOCK = 64


def _post_key(process: int, number: int) -> str:
  return f"{_block_dir(process, number // _BLOCK)}{number}"


def _block_dir(process: int, block: int) -> str:
  return f"diloco_jax/exchange/{process}/{block}/"


def exchange(arrays: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
  """Every process's `arrays`, in process order (every process calls this
  at the same point of the program).

  Through the coordinator's key-value store: a process posts its own and
  reads the others', one request each. Once it has read everyone's n-th
  post, every process has posted its n-th, so has read every (n-1)-th:
  a process deletes its own posts a block at a time, two blocks behind.
  """
  if jax.process_count() == 1:
    return [dict(arrays)]
  client = distributed.global_state.client
  number = next(_exchange_numbers)
  me = jax.process_index()
  client.key_value_set_bytes(_post_key(me, number), _encode(arrays))
  posts = [dict(arrays) if p == me else _decode(
      client.blocking_key_value_get_bytes(_post_key(p, number),
                                          EXCHANGE_TIMEOUT_MS))
           for p in range(jax.process_count())]
  if number % _BLOCK == 0 and number >= 2 * _BLOCK:
    client.key_value_delete(_block_dir(me, number // _BLOCK - 2))
  return posts


def fetch(tree):
  """device_get for arrays that may span other processes' devices.

  Single-process (and fully replicated) arrays are fetched directly; every
  process's shards of the others come in one exchange (every process must
  call this at the same point).
  """
  return fetch_and_any(tree, False)[0]


def fetch_and_any(tree, flag: bool):
  """(fetch(tree), any_process(flag)) in one exchange: one round trip per
  step for a step's metrics and the stop requests."""
  leaves, treedef = jax.tree.flatten(tree)
  spread = [i for i, x in enumerate(leaves)
            if isinstance(x, jax.Array) and not x.is_fully_addressable
            and not x.is_fully_replicated]
  fetched = jax.device_get([x for i, x in enumerate(leaves)
                            if i not in spread])
  mine = {"flag": np.array(flag, np.bool_)}
  for j, i in enumerate(spread):
    x = leaves[i]
    for m, shard in enumerate(x.addressable_shards):
      mine[f"{j}.{m}.data"] = np.asarray(shard.data)
      mine[f"{j}.{m}.index"] = np.array(
          [(part.start or 0, size if part.stop is None else part.stop)
           for part, size in zip(shard.index, x.shape)],
          np.int64).reshape(-1, 2)
  gathered = [np.empty(leaves[i].shape, leaves[i].dtype) for i in spread]
  posts = exchange(mine)
  for post in posts:
    for name, data in post.items():
      if name.endswith(".data"):
        j, m, _ = name.split(".")
        index = post[f"{j}.{m}.index"]
        gathered[int(j)][tuple(slice(a, b) for a, b in index)] = data
  local, remote = iter(fetched), iter(gathered)
  values = treedef.unflatten([next(remote) if i in spread else next(local)
                              for i in range(len(leaves))])
  return values, any(bool(post["flag"]) for post in posts)


def any_process(flag: bool) -> bool:
  """Whether `flag` is set on any process (an exchange when several).

  A signal reaches the processes of a run at slightly different steps;
  deciding together makes every process stop at the same step.
  """
  return fetch_and_any((), flag)[1]


def gather_json(value) -> list:
  """Every process's JSON-serializable `value`, in process order (an
  exchange when several; every process must call this at the same point).
  """
  if jax.process_count() == 1:
    return [value]
  payload = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
  return [json.loads(post["json"].tobytes().decode())
          for post in exchange({"json": payload})]


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


def place(array: np.ndarray, sharding) -> jax.Array:
  """`array` (the same on every process) as a global array on `sharding`.

  A callback rather than device_put: each process materializes only the
  slices its own devices hold, so the same line works on many hosts.
  """
  return jax.make_array_from_callback(array.shape, sharding,
                                      lambda index: array[index])
