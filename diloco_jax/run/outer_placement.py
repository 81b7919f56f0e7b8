"""Where the outer step runs: with the islands, or on devices of its own.

config.diloco.outer_placement:

  'device'  x, the outer optimizer state, the codec's state and the
            cross-island collective live on the compute devices, and a
            round ends with one program holding all of it.
  'host'    they live on one other device per process: the host's CPU
            device beside GPUs or TPUs (DiLoCo and OpenDiLoCo keep the outer
            state in host memory, off the accelerator), or, on CPU-only
            hosts, a CPU device set aside for it. The islands' params cross
            to it at a round's end (FSDP islands' shards gathered from
            their devices) and the new x comes back.

XLA runs one device's programs in order, so a collective on the compute
devices waits for the inner steps queued there and they wait for it. On a
device of its own, the collective of a round with
overlap='one_step_delay' runs while the islands train the next round: the
next round needs only x_r, which depends on the previous round's mean,
already arrived. With 'one_step_delay_rebase' the islands' anchors cross
too (the pseudo-gradients are taken against them) but stay with the
islands, which rebase their progress onto x_r themselves.

Streaming DiLoCo's sends go there the same way, one fragment at a time:
only that fragment's island leaves cross, the collective and the outer
optimizer's step run on the outer devices while the islands train, and the
merge `fragment_delay` steps later takes the fragment's new x back.

`HostOuter` holds the outer side's state between rounds and offers the
loop the same `outer_step(state, weights)`, `flush(state)` and per-fragment
`sends` as the compiled on-device programs (a merge takes
`fragment_x(p)`); the islands' side of the state then carries no outer
fields (`strip`), and `assemble` puts them back for a checkpoint, which
stays the same pytree whichever the placement.
"""

import collections
import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import diloco
from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel import placement

PLACEMENTS = ("device", "host")

# The TrainState fields that live on the outer side with 'host'.
OUTER_FIELDS = ("outer_opt_state", "in_flight", "in_flight_valid",
                "residuals", "codec_state")


def split_devices(devices) -> tuple[list, list]:
  """(compute devices, outer devices) for outer_placement='host'.

  With accelerators among `devices`, each process's first CPU device is its
  outer device and every accelerator computes. On CPU-only hosts each
  process's last device of `devices` is set aside for the outer side.

  Raises:
    ValueError: a process would be left without a compute device.
  """
  by_process = collections.defaultdict(list)
  for device in devices:
    by_process[device.process_index].append(device)
  if any(d.platform != "cpu" for d in devices):
    cpus = {}
    for device in jax.devices("cpu"):
      cpus.setdefault(device.process_index, device)
    return list(devices), [cpus[p] for p in sorted(by_process)]
  compute, outer = [], []
  for process in sorted(by_process):
    local = by_process[process]
    if len(local) < 2:
      raise ValueError(
          "config.diloco.outer_placement='host' on CPU-only hosts sets a "
          "CPU device aside per process, beside those the islands compute "
          f"on; process {process} has {len(local)} (diloco_jax.main adds "
          "one; with --cpu_devices or XLA_FLAGS, ask for one more)")
    compute += local[:-1]
    outer.append(local[-1])
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


def _outer_side(state: diloco.TrainState) -> diloco.TrainState:
  """The part of `state` the outer side holds: x and OUTER_FIELDS (the
  islands' params, anchors and inner states stay with them)."""
  return state.replace(island_params=None, inner_opt_state=None,
                       anchors=None)


def strip(state: diloco.TrainState) -> diloco.TrainState:
  """The islands' side of `state`: without the outer fields."""
  return state.replace(**{field: None for field in OUTER_FIELDS})


class HostOuter:
  """The outer side of a run with outer_placement='host'.

  Holds x, the outer optimizer state, the mean in flight and the codec's
  state (residuals included) on the outer devices, and runs there the
  collective and the outer optimizer. The loop calls `outer_step` and
  `flush` as it would the compiled on-device programs.
  """

  def __init__(self, outer_devices, islands: int, compute_mesh,
               outer_opt: optax.GradientTransformation, compression,
               inner_opt: optax.GradientTransformation,
               rounding_seed: int | None = None, restart_dropped: bool = False,
               overlap: str = "none", fragments: int | None = None,
               fsdp: bool = False):
    """`fragments`: P for Streaming DiLoCo (None: DiLoCo's whole-model
    outer step). `fsdp`: the islands' arrays are split over their 'data'
    devices (config.mesh.fsdp); the outer side holds whole islands and
    encodes each in the same stripes as those devices would."""
    self.mesh = mesh_lib.build_mesh(islands, 1, 1, outer_devices)
    self._compute_mesh = compute_mesh
    self._fsdp = fsdp
    self._x_shardings = None  # where x lives on the compute devices
    self._islands = islands
    self._delayed = diloco.is_delayed(overlap)
    self._rebased = diloco.rebases(overlap)
    self._fragments = fragments
    self._compression = compression_lib.as_compression(compression)
    self._inner_opt = inner_opt
    self._restart_dropped = restart_dropped
    self._outer = None  # the outer side's TrainState (no island fields)
    sync = diloco.make_island_sync(
        self.mesh, compression, rounding_seed,
        stripes=compute_mesh.shape[mesh_lib.DATA] if fsdp else 1,
        reference_per_island=self._rebased)
    self._send_parts = fragments_lib.make_send_parts(outer_opt, sync)
    # Streaming: per fragment, its jitted send, and where its leaves sit
    # among the params and the codec state (built from the state's layout).
    self._fragment_sends = self._assignment = self._positions = None
    mesh = self.mesh

    def send(outer, island_params, weights, start):
      """The collective of the pseudo-gradients start - y_i on the outer
      devices (`start`: the x the islands started the round from, or with
      the rebasing delay their anchors); without the delay, the outer
      optimizer's step on its mean too."""
      mean, residuals, codec_state, included, _ = sync(
          start, island_params, outer.residuals,
          outer.codec_state, weights, outer.round)
      anyone = jnp.any(included)
      codec_state = jax.tree.map(lambda n, o: jnp.where(anyone, n, o),
                                 codec_state, outer.codec_state)
      outer = outer.replace(residuals=residuals, codec_state=codec_state,
                            round=outer.round + 1)
      if self._delayed:
        outer = outer.replace(
            in_flight=jax.tree.map(lambda m: m.astype(jnp.float32), mean),
            in_flight_valid=anyone)
      else:
        x, outer_state = diloco.outer_update(
            outer_opt, outer.global_params, outer.outer_opt_state, mean,
            anyone)
        outer = outer.replace(global_params=x, outer_opt_state=outer_state)
      return placement.constrain(outer, diloco.state_shardings(outer, mesh))

    def apply(outer):
      """One-step delay: x steps on the mean in flight, which is then
      spent."""
      x, outer_state = diloco.outer_update(
          outer_opt, outer.global_params, outer.outer_opt_state,
          outer.in_flight, outer.in_flight_valid)
      outer = outer.replace(
          global_params=x, outer_opt_state=outer_state,
          in_flight=jax.tree.map(jnp.zeros_like, outer.in_flight),
          in_flight_valid=jnp.zeros((), jnp.bool_))
      return placement.constrain(outer, diloco.state_shardings(outer, mesh))

    self._send = jax.jit(send)
    self._apply = jax.jit(apply)
    self._compiling = None  # a Future of (send, apply), compiled from shapes

    def reset(state, x, restart, keep, ends_round):
      """The islands' side for the next round (diloco.next_round)."""
      state = diloco.next_round(state, x, restart, keep, inner_opt).replace(
          round=state.round + int(ends_round))
      return placement.constrain(
          state, diloco.state_shardings(state, compute_mesh, fsdp))

    self._reset = jax.jit(reset, donate_argnums=0, static_argnums=4)
    self._finite = jax.jit(diloco.islands_finite)

  def compile_in_background(self, state) -> None:
    """Starts compiling the outer side's collective and update from the
    shapes of the whole `state` (abstract, as checkpoints hold it), so the
    first round's end does not compile them. The first outer_step waits for
    the result."""
    island = NamedSharding(self.mesh, P(mesh_lib.ISLAND))
    outer = _outer_side(state)
    outer = placement.with_shardings(
        outer, diloco.state_shardings(outer, self.mesh))
    on_islands = lambda tree: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=island),
        tree)
    island_params = on_islands(state.island_params)
    start = (on_islands(state.anchors) if self._rebased
             else outer.global_params)
    weights = jax.ShapeDtypeStruct((self._islands,), jnp.float32,
                                   sharding=island)

    if self._fragments:
      self._build_fragment_sends(outer)
      step = jax.ShapeDtypeStruct(state.step.shape, state.step.dtype,
                                  sharding=NamedSharding(self.mesh, P()))

    def compile_all() -> dict:
      """The compiled programs, by the attribute they replace."""
      if self._fragments:
        return {"_fragment_sends": [
            send.lower(self._parts(outer, p),
                       fragments_lib.select(island_params, self._assignment,
                                            p),
                       weights, step).compile()
            for p, send in enumerate(self._fragment_sends)]}
      compiled = {"_send": self._send.lower(outer, island_params, weights,
                                            start).compile()}
      if self._delayed:
        compiled["_apply"] = self._apply.lower(outer).compile()
      return compiled

    pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="compile-outer")
    self._compiling = pool.submit(compile_all)
    pool.shutdown(wait=False)

  def _use_compiled(self) -> None:
    if self._compiling is not None:
      for name, compiled in self._compiling.result().items():
        setattr(self, name, compiled)
      self._compiling = None

  def _build_fragment_sends(self, outer) -> None:
    """Streaming: per fragment, send(parts, island_leaves, weights, step)
    -> parts on the outer devices, for the layout of `outer` (the outer
    side's state, concrete or abstract). Each takes and gives its
    fragment's parts only, so a send in flight holds up no other
    fragment's merge."""
    if self._fragment_sends is not None:
      return
    params = outer.global_params
    self._assignment = fragments_lib.leaf_fragments(params, self._fragments)
    self._positions = [fragments_lib.codec_positions(
        params, self._compression, self._assignment, p)
                       for p in range(self._fragments)]
    shardings = diloco.state_shardings(outer, self.mesh)

    def send(fragment, parts, island_leaves, weights, step):
      return self._send_parts(
          parts, island_leaves, weights,
          fragments_lib.send_index(step, self._fragments, fragment))

    self._fragment_sends = [
        jax.jit(functools.partial(send, p),
                out_shardings=self._parts(shardings, p))
        for p in range(self._fragments)]

  def _parts(self, outer, fragment: int) -> fragments_lib.FragmentParts:
    return fragments_lib.fragment_parts(outer, self._assignment,
                                        self._positions[fragment], fragment)

  @property
  def outer_state(self) -> diloco.TrainState:
    """The outer side's state (x, outer and codec states, the mean in
    flight), e.g. for the codec's current ranks."""
    return self._outer

  def load(self, state: diloco.TrainState) -> diloco.TrainState:
    """Takes the outer fields of a whole `state` (as restored or
    initialized) to the outer devices; returns the islands' side."""
    outer = _outer_side(state)
    self._outer = move(outer, diloco.state_shardings(outer, self.mesh))
    self._x_shardings = diloco.state_shardings(
        outer, self._compute_mesh, self._fsdp).global_params
    if self._fragments:
      self._build_fragment_sends(self._outer)
    return strip(state)

  def assemble(self, state: diloco.TrainState) -> diloco.TrainState:
    """The whole state (for a checkpoint): the islands' side with the outer
    fields and x (streaming: with the fragments sent and not yet merged)
    copied back beside it, in their on-device layout."""
    outer = {field: getattr(self._outer, field)
             for field in OUTER_FIELDS + ("global_params",)}
    whole = state.replace(**outer)
    targets = diloco.state_shardings(whole, self._compute_mesh, self._fsdp)
    return state.replace(**{field: move(value, getattr(targets, field))
                            for field, value in outer.items()})

  def outer_step(self, state: diloco.TrainState, weights: jax.Array):
    """The round's end: the islands' params go out, x comes back."""
    self._use_compiled()
    finite = self._finite(state)
    restart = ~finite
    if self._restart_dropped:
      restart = restart | (weights <= 0)
    keep = finite & (weights > 0)  # the islands in this round's mean
    island_sharding = NamedSharding(self.mesh, P(mesh_lib.ISLAND))
    island_params = move(state.island_params, island_sharding)
    outer_weights = move(weights, island_sharding)
    if self._rebased:  # each island's a_i
      start = move(state.anchors, island_sharding)
    else:  # s_r, the x this round started from
      start = self._outer.global_params
    if self._delayed:
      # x_r from the mean that has had this round to arrive; the new
      # collective is queued after it, on the outer devices only, so the
      # islands' next round waits for x_r alone.
      self._outer = self._apply(self._outer)
      x = self._x_on_compute()
      self._outer = self._send(self._outer, island_params, outer_weights,
                               start)
    else:
      self._outer = self._send(self._outer, island_params, outer_weights,
                               start)
      x = self._x_on_compute()
    return self._reset(state, x, restart, keep, True)

  def flush(self, state: diloco.TrainState):
    """The end of a one-step-delay run: the last mean is applied."""
    self._use_compiled()
    self._outer = self._apply(self._outer)
    nobody = jnp.zeros((diloco.num_islands(state),), bool)
    return self._reset(state, self._x_on_compute(), nobody, nobody, False)

  @property
  def sends(self) -> tuple:
    """Streaming: per fragment, send(state, weights) -> state. The
    fragment's island leaves go out and its collective and outer step are
    queued on the outer devices; the islands' side comes back unchanged
    (its merge folds the new x in, from `fragment_x`)."""
    return tuple(functools.partial(self._send_fragment, p)
                 for p in range(self._fragments or 0))

  def _send_fragment(self, fragment: int, state: diloco.TrainState,
                     weights: jax.Array) -> diloco.TrainState:
    self._use_compiled()
    island = NamedSharding(self.mesh, P(mesh_lib.ISLAND))
    parts = self._fragment_sends[fragment](
        self._parts(self._outer, fragment),
        move(fragments_lib.select(state.island_params, self._assignment,
                                  fragment), island),
        move(weights, island),
        move(state.step, NamedSharding(self.mesh, P())))
    self._outer = fragments_lib.with_fragment_parts(
        self._outer, self._assignment, self._positions[fragment], fragment,
        parts)
    return state

  def fragment_x(self, fragment: int) -> list:
    """Streaming: the fragment's leaves of x on the compute devices, for
    its merge (they arrive once its send is done)."""
    select = functools.partial(fragments_lib.select,
                               assignment=self._assignment, fragment=fragment)
    return move(select(self._outer.global_params),
                select(self._x_shardings))

  def current(self, state: diloco.TrainState) -> diloco.TrainState:
    """The islands' side with the outer side's x, e.g. to evaluate it.
    With Streaming DiLoCo that waits for the fragments in flight; with
    DiLoCo the islands hold x already."""
    if not self._fragments:
      return state
    return state.replace(global_params=self._x_on_compute())

  def _x_on_compute(self):
    return move(self._outer.global_params, self._x_shardings)
