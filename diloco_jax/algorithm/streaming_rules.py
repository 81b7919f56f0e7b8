"""Streaming DiLoCo's rules on pytrees: which leaves form each fragment,
what runs after each inner step, a fragment's outer step and its merge.
The outer object under streaming (outer.py) runs them.
"""

import math

import jax
import numpy as np
import optax

from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.algorithm import island_mean as island_mean_lib
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.algorithm import outer_rules
from diloco_jax.algorithm import outer_state
from diloco_jax.algorithm import schedule as schedule_lib


def init_fragments(params, overlap, outer_tx: optax.GradientTransformation):
  """(assignment, outer optimizer states) of a streaming `overlap` for the
  global `params`: each leaf's fragment (the overlap's own, or
  `fragment_assignment`'s), checked, and one outer state per fragment."""
  assignment = overlap.assignment or fragment_assignment(
      params, overlap.num_fragments)
  check_assignment(params, assignment, overlap.num_fragments)
  return assignment, tuple(
      outer_tx.init(fragments_lib.select(params, assignment, f))
      for f in range(overlap.num_fragments))


def fragment_assignment(params, num_fragments: int) -> tuple[int, ...]:
  """The fragment of each leaf of `params` (jax.tree.leaves order).

  A tree with transformer blocks under a 'blocks' list (ours, or any with
  that name) is cut into consecutive blocks of equal count, the embedding
  with the first and the rest with the last; any other tree into
  `num_fragments` runs of consecutive leaves of about equal size. Pass
  your own tuple to `streaming_init` to cut it otherwise.
  """
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  if any(fragments_lib.block_index(path) is not None for path in paths):
    return fragments_lib.leaf_fragments(params, num_fragments)
  return _runs_of_equal_size(params, num_fragments)


def _runs_of_equal_size(params, num_fragments: int) -> tuple[int, ...]:
  sizes = [math.prod(leaf.shape) for leaf in jax.tree.leaves(params)]
  if not 1 <= num_fragments <= len(sizes):
    raise ValueError(f"{num_fragments} fragments need 1 to {len(sizes)} "
                     "leaves")
  # A leaf goes to the fragment its middle value falls in, then the
  # fragments are made consecutive and none empty: each leaf at most one
  # past the one before, and the last leaves open the last fragments.
  middles = np.cumsum(sizes) - np.asarray(sizes) / 2
  assignment = (middles * num_fragments // sum(sizes)).astype(int).tolist()
  assignment[0] = 0
  for leaf in range(1, len(sizes)):
    assignment[leaf] = min(max(assignment[leaf], assignment[leaf - 1]),
                           assignment[leaf - 1] + 1)
  for leaf in reversed(range(len(sizes))):
    assignment[leaf] = max(assignment[leaf],
                           num_fragments - (len(sizes) - leaf))
  return tuple(assignment)


def streaming_schedule(step: int, *, inner_steps: int, num_fragments: int,
                       total_steps: int, fragment_delay: int = 0
                       ) -> list[tuple[str, int]]:
  """What to run after inner step `step` (1-based, a host int), in order:
  ("send", p) then `fragment_send`; ("merge", p) then `fragment_merge`.

  Fragment p is sent at the steps t with t = p * H / P (mod H), H =
  `inner_steps`, P = `num_fragments`, and merged `fragment_delay` (tau)
  steps later (at once with tau = 0). At `total_steps` every fragment is
  sent and merged, so the final x holds all the islands' work.
  """
  schedule = schedule_lib.Schedule(
      mode="diloco", inner_steps=inner_steps, total_steps=total_steps,
      fragments=num_fragments, fragment_delay=fragment_delay,
      streaming=True)
  return [(action.kind, action.fragment) for action in schedule.after(step)]


def object_schedule(overlap, step: int, *, inner_steps: int,
                    total_steps: int) -> list[tuple[str, int]]:
  """The outer object's `schedule` under `overlap` (streaming(...)'s):
  `streaming_schedule`, without the merges where fragment_delay is 0 (the
  object's update merges at once)."""
  if not isinstance(overlap, outer_overlaps.Streaming):
    raise ValueError(f"schedule: overlap {overlap} syncs the whole "
                     "model every inner_steps steps; schedule belongs to "
                     "streaming(...)")
  actions = streaming_schedule(
      step, inner_steps=inner_steps, num_fragments=overlap.num_fragments,
      total_steps=total_steps, fragment_delay=overlap.fragment_delay)
  if overlap.fragment_delay == 0:
    return [(kind, p) for kind, p in actions if kind == "send"]
  return actions


def check_assignment(params, assignment, num_fragments: int) -> None:
  """`assignment` gives each leaf of `params` one of the fragments
  0..num_fragments - 1, each used."""
  if (len(assignment) != len(jax.tree.leaves(params))
      or set(assignment) != set(range(num_fragments))):
    raise ValueError(f"assignment {assignment} must give each of the "
                     f"{len(jax.tree.leaves(params))} leaves one of the "
                     f"fragments 0..{num_fragments - 1}, each used")


def step_parts(outer_tx: optax.GradientTransformation,
               parts: fragments_lib.FragmentParts,
               synced: island_mean_lib.IslandMean
               ) -> fragments_lib.FragmentParts:
  """A fragment's outer step on its parts (fragments.fragment_parts):
  its leaves of x stepped on `synced`, the islands' mean over those
  leaves, unless no island took part (then x, the outer state and the
  codec state stay); the residuals are the mean's."""
  x, outer_opt_state, codec_state = outer_rules.fragment_step(
      outer_tx, parts.x, parts.outer_opt_state,
      (None if parts.codec_state is None
       else (parts.codec_state, synced.codec_state)),
      synced.mean, synced.anyone)
  return fragments_lib.FragmentParts(x, outer_opt_state, synced.residuals,
                                     codec_state)


def apply_fragment(outer, params, island_params, state, synced,
                   fragment: int) -> outer_state.Update:
  """The outer object's `apply` of fragment `fragment`'s send: x's leaves
  of it stepped on `synced`, the round counted, and `island_params` (None
  will do) merged at once where fragment_delay is 0."""
  x, state = fragments_lib.with_fragment_parts(
      params, state, fragment, outer.step_fragment(
          fragments_lib.fragment_parts(params, state, fragment), synced))
  state = state.replace(included=synced.included, round=state.round + 1)
  if outer.overlap.fragment_delay == 0 and island_params is not None:
    island_params = outer.merge(x, island_params, state, fragment=fragment)
  return outer_state.Update(x, island_params, state)


def merge_fragment(params, island_params, assignment, fragment: int,
                   alpha: float):
  """A fragment's merge: every island's leaves of `fragment` become
  alpha * y + (1 - alpha) * x (an island whose fragment is not finite
  takes x); the islands stacked [k, ...] or one island's trees (the merge
  is local)."""
  x = fragments_lib.select(params, assignment, fragment)
  y = fragments_lib.select(island_params, assignment, fragment)
  stacked = y[0].ndim > x[0].ndim
  if not stacked:
    y = [leaf[None] for leaf in y]
  merged = fragments_lib.blend(x, y, alpha)
  if not stacked:
    merged = [leaf[0] for leaf in merged]
  return fragments_lib.replace(island_params, assignment, fragment, merged)

