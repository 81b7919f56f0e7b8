"""Streaming DiLoCo's rules on pytrees: which leaves form each fragment,
what runs after each inner step, and a fragment's send. The library's
streaming pieces and the outer object under streaming (outer.py) both
run them.
"""

import math
from typing import NamedTuple

import jax
import numpy as np
import optax

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.algorithm import island_mean as island_mean_lib
from diloco_jax.algorithm import outer_rules
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


def check_assignment(params, assignment, num_fragments: int) -> None:
  """`assignment` gives each leaf of `params` one of the fragments
  0..num_fragments - 1, each used."""
  if (len(assignment) != len(jax.tree.leaves(params))
      or set(assignment) != set(range(num_fragments))):
    raise ValueError(f"assignment {assignment} must give each of the "
                     f"{len(jax.tree.leaves(params))} leaves one of the "
                     f"fragments 0..{num_fragments - 1}, each used")


class FragmentSent(NamedTuple):
  """What `send_fragment` gives: x with the fragment stepped, and the
  per-fragment outer states, codec state and residuals after it, and which
  islands took part."""
  params: object
  outer_opt_states: tuple
  codec_state: object
  residuals: object
  included: jax.Array


def send_fragment(global_params, island_params, outer_opt_states,
                  codec_state, residuals, assignment, fragment: int,
                  outer_tx: optax.GradientTransformation, *, weights,
                  compression, axis_name, key) -> FragmentSent:
  """A fragment's send on checked arguments (fragment_send's, and the
  outer object's under streaming): its mean through the codec with its
  own residuals and codec state, then the outer step of its leaves."""
  compression = compression_lib.as_compression(compression)
  select = lambda tree: (None if tree is None else
                         fragments_lib.select(tree, assignment, fragment))
  positions = fragments_lib.codec_positions(global_params, compression,
                                            assignment, fragment)
  fragment_codec_state = (None if codec_state is None
                          else tuple(codec_state[i] for i in positions))
  synced = island_mean_lib.island_mean(
      select(global_params), select(island_params), weights=weights,
      residuals=select(residuals), codec_state=fragment_codec_state,
      compression=compression, axis_name=axis_name, key=key)
  return step_fragment(global_params, outer_opt_states, codec_state,
                       residuals, assignment, fragment, outer_tx, synced,
                       compression)


def step_fragment(global_params, outer_opt_states, codec_state, residuals,
                  assignment, fragment: int,
                  outer_tx: optax.GradientTransformation,
                  synced: island_mean_lib.IslandMean,
                  compression) -> FragmentSent:
  """A fragment's outer step on its mean formed elsewhere (`send_fragment`'s
  second half; or a mean decoded from payloads the islands encoded
  themselves): `synced` is over the fragment's leaves (in leaf order), its
  residuals those leaves' too, or None."""
  compression = compression_lib.as_compression(compression)
  positions = fragments_lib.codec_positions(global_params, compression,
                                            assignment, fragment)
  fragment_codec_state = (None if codec_state is None
                          else tuple(codec_state[i] for i in positions))
  x, outer_state, kept = outer_rules.fragment_step(
      outer_tx, fragments_lib.select(global_params, assignment, fragment),
      outer_opt_states[fragment],
      (None if fragment_codec_state is None
       else (fragment_codec_state, synced.codec_state)),
      synced.mean, synced.anyone)
  outer_states = list(outer_opt_states)
  outer_states[fragment] = outer_state
  if kept is not None:
    codec_state = list(codec_state)
    for i, entry in zip(positions, kept):
      codec_state[i] = entry
    codec_state = tuple(codec_state)
  if residuals is not None:
    residuals = fragments_lib.replace(residuals, assignment, fragment,
                                      synced.residuals)
  return FragmentSent(
      fragments_lib.replace(global_params, assignment, fragment, x),
      tuple(outer_states), codec_state, residuals, synced.included)


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

