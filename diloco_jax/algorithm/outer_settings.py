"""The outer object's state as a TrainState holds it.

A run's TrainState keeps the outer fields beside the islands' (checkpoints
hold that pytree, so its fields stay the format); `outer_view` reads them
as the OuterState the outer object (outer.py) takes and `with_outer`
writes one back. Both only rename fields (the same arrays), so under jit
they cost nothing. Under eager updates the object's outer optimizer state
is each island's (TrainState.island_outer_opt_state); x's own
(TrainState.outer_opt_state) is the islands' average, formed at the end.
"""

import jax
import jax.numpy as jnp

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import outer as outer_lib
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.algorithm import outer_state
from diloco_jax.algorithm import state as state_lib


def _eager(outer: outer_lib.DiLoCo) -> bool:
  return isinstance(outer.overlap, outer_overlaps.Eager)


def outer_view(state: state_lib.TrainState, outer: outer_lib.DiLoCo,
               num_islands: int | None = None) -> outer_lib.OuterState:
  """`state`'s outer fields as `outer`'s state (every island counted as
  included: the view carries no last round's report). `num_islands`: k,
  for a state without the islands' params (an outer side's)."""
  if num_islands is None:
    num_islands = state_lib.num_islands(state)
  return outer_lib.OuterState(
      round=state.round,
      included=jnp.ones((num_islands,), bool),
      outer_opt_state=(state.island_outer_opt_state if _eager(outer)
                       else state.outer_opt_state),
      codec_state=state.codec_state, residuals=state.residuals,
      in_flight=state.in_flight, in_flight_valid=state.in_flight_valid,
      anchors=state.anchors, own_shares=state.own_shares,
      recipe=outer_state.Recipe(outer.codec, outer.overlap,
                                outer.error_feedback))


def with_outer(state: state_lib.TrainState, view: outer_lib.OuterState,
               outer: outer_lib.DiLoCo) -> state_lib.TrainState:
  """`state` with the outer fields of `view` (outer_view's inverse)."""
  fields = dict(round=view.round, codec_state=view.codec_state,
                residuals=view.residuals, in_flight=view.in_flight,
                in_flight_valid=view.in_flight_valid, anchors=view.anchors,
                own_shares=view.own_shares)
  fields["island_outer_opt_state" if _eager(outer)
         else "outer_opt_state"] = view.outer_opt_state
  return state.replace(**fields)


def overlap_of(state: state_lib.TrainState,
               warmup_rounds: int = 0) -> outer_overlaps.Overlap:
  """The overlap a TrainState's fields were made for (eager's own weight
  is not in them: the end of a run does not use it)."""
  if state.own_shares is not None:
    return outer_overlaps.eager(warmup_rounds=warmup_rounds)
  if state.in_flight is not None:
    return outer_overlaps.one_step_delay(rebase=state.anchors is not None)
  return outer_overlaps.no_overlap()


def from_settings(outer_opt, compression=None, overlap: str = "none",
                  eager_own_weight: float | None = None,
                  warmup_rounds: int = 0) -> outer_lib.DiLoCo:
  """The outer object of a compiled step's settings (config.diloco's
  overlap mode, own weight and warm-up rounds)."""
  spec = outer_overlaps.from_mode(overlap, eager_own_weight, warmup_rounds)
  return outer_lib.DiLoCo(outer_opt,
                          compression_lib.as_compression(compression), spec,
                          error_feedback=False)


def first_island(tree):
  """Island 0's entry of every leaf (of copies: each island's)."""
  return jax.tree.map(lambda a: a[0], tree)
