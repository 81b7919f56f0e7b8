"""Placing a library state inside shard_map: which of its fields are each
island's own, and the specs that split them over the islands' axis.

The per-island form (`axis_name=...`) wants each island's residuals (and,
for eager updates, its own outer state and share) on that island's device,
and everything else replicated. Make the state stacked, `init(...,
num_islands=k)`, so those fields carry a leading axis of k; give shard_map
`island_specs(state, "islands")` for it; inside, `this_island(state)`
turns the device's block into one island's state for the update, and
`island_block(state)` turns the result back for out_specs:

  specs = diloco.island_specs(state, "islands")
  def outer_on_each_island(x, y, state, weight):
    x, state, _ = diloco.outer_update(x, y[0] ..., diloco.this_island(state),
                                      ..., axis_name="islands")
    return x, diloco.island_block(state)
  jax.shard_map(..., in_specs=(P(), P("islands"), specs, P("islands")),
                out_specs=(P(), specs))
"""
import jax
from jax.sharding import PartitionSpec

from diloco_jax.algorithm import library_diloco
from diloco_jax.algorithm import library_eager
from diloco_jax.algorithm import library_streaming
from diloco_jax.algorithm import outer as outer_lib
from diloco_jax.algorithm import outer_overlaps

# Each state type's fields that hold one entry per island.
_PER_ISLAND_FIELDS = {
    library_diloco.DiLoCoState: ("residuals",),
    library_eager.EagerState: ("outer_opt_states", "residuals",
                               "own_shares"),
    library_streaming.StreamingState: ("residuals",),
}


def _fields(state) -> tuple[str, ...]:
  if isinstance(state, outer_lib.OuterState):
    # Under eager updates each island steps its own outer state.
    eager = isinstance(state.recipe.overlap, outer_overlaps.Eager)
    return ("included", "residuals", "anchors", "own_shares") + (
        ("outer_opt_state",) if eager else ())
  for kind, fields in _PER_ISLAND_FIELDS.items():
    if isinstance(state, kind):
      return fields
  raise TypeError(
      f"{type(state).__name__} is not a state of outer.init, init, "
      "eager_init or streaming_init")


def _map_per_island(state, fn):
  """`state` with fn applied to every array of its per-island fields."""
  return state.replace(**{
      name: jax.tree.map(fn, getattr(state, name))
      for name in _fields(state) if getattr(state, name) is not None})


def island_specs(state, axis_name: str):
  """shard_map partition specs for a stacked state (made with
  num_islands=k): its per-island fields split over `axis_name` (one
  island per device), the rest replicated. A tree of `state`'s shape."""
  replicated = jax.tree.map(lambda _: PartitionSpec(), state)
  return _map_per_island(replicated, lambda _: PartitionSpec(axis_name))


def this_island(block):
  """Inside shard_map: this device's block of a stacked state (its
  per-island fields [1, ...]) as one island's state, as the per-island
  form of outer_update, eager_update and fragment_send take it."""
  for name in _fields(block):
    for leaf in jax.tree.leaves(getattr(block, name)):
      if leaf.ndim == 0 or leaf.shape[0] != 1:
        raise ValueError(
            f"this_island: state.{name} has a leaf of shape {leaf.shape}, "
            "not a block of one island: give shard_map the stacked state "
            "(init(..., num_islands=k)) with island_specs(state, axis) as "
            "its spec")
  return _map_per_island(block, lambda a: a[0])


def island_block(state):
  """Inside shard_map: one island's state back as this device's block of
  the stacked state (for out_specs=island_specs(...))."""
  return _map_per_island(state, lambda a: a[None])
