"""The outer object's state (outer.py): what it carries from round to
round, what made it, and the two forms its calls take (stacked islands, or
one island's trees inside shard_map)."""

import dataclasses
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import island_trees
from diloco_jax.algorithm import outer_overlaps


@dataclasses.dataclass(frozen=True)
class Recipe:
  """What made an OuterState (static): the codec, the overlap, whether it
  keeps residuals and, for streaming, each leaf's fragment."""
  codec: compression_lib.Compression
  overlap: outer_overlaps.Overlap
  error_feedback: bool
  assignment: tuple[int, ...] | None = None

  def describe(self) -> str:
    return (f"codec {self.codec.name!r}, overlap {self.overlap}, "
            f"error_feedback={self.error_feedback}")


class OuterState(flax.struct.PyTreeNode):
  """What the outer step carries from round to round.

  Attributes:
    round: outer steps taken (int32).
    included: which islands took part in the last round's mean ([k]
      stacked, this island's scalar per island; all True before the
      first): weight > 0 and a finite pseudo-gradient. An island left out
      for not being finite wants a fresh inner optimizer state.
    outer_opt_state: the outer optimizer's state of x; eager updates: each
      island's of its own point ([k, ...] or this island's); streaming: a
      tuple, one per fragment.
    codec_state: the codec's (low-rank bases and ranks), or None.
    residuals: error feedback: what each island's codec left unsent
      (shaped like the islands' params), or None.
    in_flight, in_flight_valid: with a one-round-late mean (delay, eager),
      the last round's mean (float32, x-shaped) and whether it holds one.
    anchors: where each island started its round (the delay with rebase),
      or each island's own point x_m (eager); shaped like the islands'
      params, or None.
    own_shares: eager: each island's part of the mean in flight, u_m.
    recipe: the object that made it (static).
  """
  round: jax.Array
  included: jax.Array
  outer_opt_state: Any
  codec_state: Any = None
  residuals: Any = None
  in_flight: Any = None
  in_flight_valid: Any = None
  anchors: Any = None
  own_shares: Any = None
  recipe: Recipe = flax.struct.field(pytree_node=False, default=None)


class Update(NamedTuple):
  """What `update` and `finish` return.

  Attributes:
    params: the new x (eager updates: x as given; the model is
      `outer.model(x, state)`, the islands' average point).
    islands: what each island starts its next round from ([k, ...] or
      this island's).
    state: the next OuterState.
  """
  params: Any
  islands: Any
  state: OuterState


class Form(NamedTuple):
  """The stacked rules applied to one island's trees (per island: a
  leading axis of one added and taken off again)."""
  stacked: bool
  axis_name: str | None
  num_islands: int | None  # k, stacked
  stages: int = 1  # pipeline stages: a stage axis on params-shaped leaves

  def one(self, tree):
    return tree if self.stacked else jax.tree.map(lambda a: a[None], tree)

  def unone(self, tree):
    return tree if self.stacked else jax.tree.map(lambda a: a[0], tree)

  def copies(self, tree):
    """Every island starts from `tree`: [k, ...] copies, or itself."""
    if not self.stacked:
      return tree
    return island_trees.stack_islands(tree, self.num_islands)


def form_of(state: OuterState, axis_name, stages: int = 1) -> Form:
  """The form `state` is in: stacked ([k] islands' `included`) or one
  island's."""
  stacked = state.included.ndim == 1
  return Form(stacked, axis_name,
              state.included.shape[0] if stacked else None, stages)


def mean_over(leaf, axis_name):
  """The islands' mean of `leaf` (floats; integer leaves such as a step
  count are the same on every island)."""
  if jnp.issubdtype(leaf.dtype, jnp.floating):
    return jax.lax.pmean(leaf.astype(jnp.float32),
                         axis_name).astype(leaf.dtype)
  return leaf
