"""Streaming DiLoCo's sends on devices of their own
(config.diloco.outer_placement='host', compiled/host_outer.py): one fragment at
a time, only that fragment's island leaves cross, its collective and outer
step run on the outer devices while the islands train, and its merge
`fragment_delay` steps later takes the fragment's new x back."""

import functools

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.compiled.outer_side import OuterSide, outer_part
from diloco_jax.parallel.outer_devices import move
from diloco_jax.parallel import placement


class FragmentOuter(OuterSide):
  """Streaming DiLoCo's sends on the outer devices: each fragment's island
  leaves go out, its collective and outer step run there while the islands
  train, and its merge takes the fragment's x back (`fragment_x`)."""

  def __init__(self, mesh, islands: int, compute_mesh, *, outer, sync,
               fsdp: bool):
    super().__init__(mesh, islands, compute_mesh, fsdp)
    self._send_parts = fragments_lib.make_send_parts(outer, sync)
    self._fragments = outer.overlap.num_fragments
    # Per fragment, its jitted send; each leaf's fragment (the state's).
    self._fragment_sends = self._assignment = None

  def load(self, state: state_lib.TrainState) -> state_lib.TrainState:
    islands_side = super().load(state)
    self._build_fragment_sends(self._outer)
    return islands_side

  def _build_fragment_sends(self, outer) -> None:
    """Per fragment, send(parts, island_leaves, weights, step) -> parts on
    the outer devices, for the layout of `outer` (the outer side's state,
    concrete or abstract). Each takes and gives its fragment's parts only,
    so a send in flight holds up no other fragment's merge."""
    if self._fragment_sends is not None:
      return
    self._assignment = outer.outer.recipe.assignment
    # The parts' shardings, read off the state's shapes placed on them.
    placed = placement.with_shardings(outer, self._outer_shardings(outer))

    def send(fragment, parts, island_leaves, weights, step):
      return self._send_parts(
          parts, island_leaves, weights,
          fragments_lib.send_index(step, self._fragments, fragment))

    self._fragment_sends = [
        jax.jit(functools.partial(send, p),
                out_shardings=jax.tree.map(lambda a: a.sharding,
                                           self._parts(placed, p)))
        for p in range(self._fragments)]

  def _parts(self, outer, fragment: int) -> fragments_lib.FragmentParts:
    return fragments_lib.fragment_parts(outer.global_params, outer.outer,
                                        fragment)

  def compile_in_background(self, state) -> None:
    outer = outer_part(state)
    self._build_fragment_sends(placement.with_shardings(
        outer, self._outer_shardings(outer)))
    super().compile_in_background(state)

  def _compile_all(self, outer, islands_state, weights) -> dict:
    step = jax.ShapeDtypeStruct(islands_state.step.shape,
                                islands_state.step.dtype,
                                sharding=NamedSharding(self.mesh, P()))
    return {"_fragment_sends": [
        send.lower(self._parts(outer, p),
                   fragments_lib.select(islands_state.island_params,
                                        self._assignment, p),
                   weights, step).compile()
        for p, send in enumerate(self._fragment_sends)]}

  @property
  def sends(self) -> tuple:
    """Per fragment, send(state, weights) -> state. The fragment's island
    leaves go out and its collective and outer step are queued on the
    outer devices; the islands' side comes back unchanged (its merge folds
    the new x in, from `fragment_x`)."""
    return tuple(functools.partial(self._send_fragment, p)
                 for p in range(self._fragments))

  def _send_fragment(self, fragment: int, state: state_lib.TrainState,
                     weights: jax.Array) -> state_lib.TrainState:
    self._use_compiled()
    parts = self._fragment_sends[fragment](
        self._parts(self._outer, fragment),
        move(fragments_lib.select(state.island_params, self._assignment,
                                  fragment), self._on_islands),
        move(weights, self._on_islands),
        move(state.step, NamedSharding(self.mesh, P())))
    x, outer = fragments_lib.with_fragment_parts(
        self._outer.global_params, self._outer.outer, fragment, parts)
    self._outer = self._outer.replace(global_params=x, outer=outer)
    return state

  def fragment_x(self, fragment: int) -> list:
    """The fragment's leaves of x on the compute devices, for its merge
    (they arrive once its send is done)."""
    select = functools.partial(fragments_lib.select,
                               assignment=self._assignment, fragment=fragment)
    return move(select(self._outer.global_params),
                select(self._x_shardings))

  def current(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """The islands' side with the outer side's x (waits for the fragments
    in flight)."""
    return state.replace(global_params=self._x_on_compute())
