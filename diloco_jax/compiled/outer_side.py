"""What every outer side (compiled/host_outer.py) shares: the fields it holds
and a base class that moves them to the outer devices and back."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax.algorithm import state as state_lib
from diloco_jax.compiled import background
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel.outer_devices import move
from diloco_jax.parallel import placement

# The outer state's fields only the outer side holds with 'host' (and
# under every overlap but eager updates, whose outer optimizer states are
# the islands' own, the outer optimizer's state). The round count and
# which islands took part are on both sides (the islands' side's, which
# checkpoints take, is set by the islands' own masks).
OUTER_FIELDS = ("in_flight", "in_flight_valid", "residuals", "codec_state")
# Those only the islands hold: their own points and shares in flight.
_ISLAND_FIELDS = ("anchors", "own_shares")


def _outer_fields(state: state_lib.TrainState) -> tuple[str, ...]:
  """The outer state's fields the outer side holds for `state`."""
  if state_lib.eager(state):
    return OUTER_FIELDS
  return OUTER_FIELDS + ("outer_opt_state",)


def outer_part(state: state_lib.TrainState) -> state_lib.TrainState:
  """The part of `state` the outer side holds: x and `_outer_fields` of
  its outer state (the islands' params, inner states, anchors and, with
  eager updates, their own outer states and shares stay with them)."""
  held = _outer_fields(state)
  return state.replace(
      island_params=None, inner_opt_state=None,
      outer=state.outer.replace(**{
          field: None for field in _ISLAND_FIELDS + ("outer_opt_state",)
          if field not in held}))


def strip(state: state_lib.TrainState) -> state_lib.TrainState:
  """The islands' side of `state`: without the outer side's fields."""
  return state.replace(outer=state.outer.replace(
      **{field: None for field in _outer_fields(state)}))


class OuterSide:
  """What every outer side does: it holds x and the outer fields on the
  outer devices, takes them there from a whole state (`load`), and gives
  them back for a checkpoint (`assemble`). Subclasses run the algorithm's
  pieces there and compile them from shapes (`_compile_all`)."""

  def __init__(self, mesh, islands: int, compute_mesh, fsdp: bool):
    """`mesh`: the outer devices' island mesh (one device per process)."""
    self.mesh = mesh
    self._islands = islands
    self._compute_mesh = compute_mesh
    self._fsdp = fsdp
    self._outer = None  # the outer side's TrainState (no island fields)
    # Where x and the outer fields live on the compute devices.
    self._x_shardings = self._compute_shardings = None
    self._compiling = None  # a Future of {attribute: compiled program}

  @property
  def outer_state(self) -> state_lib.TrainState:
    """The outer side's state (x, outer and codec states, the mean in
    flight), e.g. for the codec's current ranks."""
    return self._outer

  @property
  def _on_islands(self) -> NamedSharding:
    """Stacked per-island arrays on the outer devices."""
    return NamedSharding(self.mesh, P(mesh_lib.ISLAND))

  @property
  def _island_trees(self) -> NamedSharding:
    """The islands' params (or anchors) on the outer devices: with
    pipeline stages each stage's part on that stage's outer device only."""
    if self.mesh.shape[mesh_lib.STAGE] == 1:
      return self._on_islands
    return NamedSharding(self.mesh, P(mesh_lib.ISLAND, mesh_lib.STAGE))

  def _outer_shardings(self, outer):
    return state_lib.state_shardings(outer, self.mesh)

  def load(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """Takes the outer fields of a whole `state` (as restored or
    initialized) to the outer devices; returns the islands' side."""
    outer = outer_part(state)
    self._outer = move(outer, self._outer_shardings(outer))
    self._compute_shardings = state_lib.state_shardings(
        outer, self._compute_mesh, self._fsdp)
    self._x_shardings = self._compute_shardings.global_params
    return strip(state)

  def assemble(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """The whole state (for a checkpoint): the islands' side with the outer
    fields and x (streaming: with the fragments sent and not yet merged)
    copied back beside it, in their on-device layout."""
    held = _outer_fields(state)
    whole = state.replace(
        global_params=self._outer.global_params,
        outer=state.outer.replace(**{field: getattr(self._outer.outer, field)
                                     for field in held}))
    targets = state_lib.state_shardings(whole, self._compute_mesh,
                                        self._fsdp)
    return whole.replace(
        global_params=move(whole.global_params, targets.global_params),
        outer=whole.outer.replace(**{
            field: move(getattr(whole.outer, field),
                        getattr(targets.outer, field)) for field in held}))

  def current(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """The islands' side with the outer side's x, e.g. to evaluate it
    (DiLoCo's islands hold x already)."""
    return state

  def compile_in_background(self, state) -> None:
    """Starts compiling the outer side's programs from the shapes of the
    whole `state` (abstract, as checkpoints hold it), so the first sync
    does not compile them; the first one waits for the result."""
    outer = outer_part(state)
    outer = placement.with_shardings(outer, self._outer_shardings(outer))
    on_islands = lambda tree: jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                       sharding=self._island_trees), tree)
    islands_state = state.replace(
        island_params=on_islands(state.island_params),
        outer=state.outer.replace(anchors=on_islands(state.outer.anchors)))
    self._compiling = background.submit(
        "compile-outer", self._compile_all, outer, islands_state,
        jax.ShapeDtypeStruct((self._islands,), jnp.float32,
                             sharding=self._on_islands))

  def _compile_all(self, outer, islands_state, weights) -> dict:
    """{attribute: compiled program} for the abstract `outer` side, the
    islands' fields `islands_state` as the outer devices receive them and
    the islands' `weights`."""
    raise NotImplementedError

  def _use_compiled(self) -> None:
    if self._compiling is not None:
      for name, compiled in self._compiling.result().items():
        setattr(self, name, compiled)
      self._compiling = None

  def _x_on_compute(self):
    return move(self._outer.global_params, self._x_shardings)
