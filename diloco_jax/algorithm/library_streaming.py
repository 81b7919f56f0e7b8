"""The library's Streaming DiLoCo (re-exported by library.py): the params
cut into fragments, each synced on its own staggered schedule so one
fragment's bytes cross the link at a time, and merged into the islands a
few inner steps after its send. Both forms: stacked islands [k, ...], or
one island inside shard_map with `axis_name`.
"""

import math
from typing import NamedTuple, Sequence

import flax.struct
import jax
import numpy as np
import optax

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.algorithm import library_checks
from diloco_jax.algorithm import library_diloco
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import schedule as schedule_lib


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


class StreamingState(flax.struct.PyTreeNode):
  """What Streaming DiLoCo carries between sends.

  Attributes:
    outer_opt_states: the outer optimizer's state of each fragment's
      leaves of x (a tuple, one per fragment).
    codec_state: the codec's state (low-rank bases), or None.
    residuals: error feedback's residuals ([k, ...] or this island's), or
      None.
    assignment: each leaf's fragment (static, not traced).
  """
  outer_opt_states: tuple
  codec_state: object
  residuals: object
  assignment: tuple = flax.struct.field(pytree_node=False)


def streaming_init(params, outer_tx: optax.GradientTransformation,
                   num_fragments: int, num_islands: int | None = None, *,
                   assignment: Sequence[int] | None = None,
                   compression: compression_lib.Compression | None = None,
                   error_feedback: bool = False,
                   seed: int = 0) -> StreamingState:
  """The state before the first send; `num_islands` k for stacked islands,
  None for the per-island form; `assignment` each leaf's fragment
  (default `fragment_assignment`)."""
  library_checks.check_num_islands(num_islands, "streaming_init")
  library_checks.check_error_feedback(compression, error_feedback,
                                      "streaming_init")
  if assignment is None:
    assignment = fragment_assignment(params, num_fragments)
  assignment = tuple(int(f) for f in assignment)
  check_assignment(params, assignment, num_fragments)
  base = library_diloco.init(params, outer_tx, num_islands,
                             compression=compression,
                             error_feedback=error_feedback, seed=seed)
  return StreamingState(
      outer_opt_states=tuple(
          outer_tx.init(fragments_lib.select(params, assignment, f))
          for f in range(num_fragments)),
      codec_state=base.codec_state, residuals=base.residuals,
      assignment=assignment)


def fragment_send(global_params, island_params, state: StreamingState,
                  fragment: int, outer_tx: optax.GradientTransformation, *,
                  weights=None,
                  compression: compression_lib.Compression | None = None,
                  axis_name: str | None = None, key: jax.Array | None = None):
  """A fragment's send: its pseudo-gradients' mean across the islands
  (through the codec, with its residuals and codec state only) and one
  outer step of its leaves of x. The islands keep training; fold x into
  them with `fragment_merge` (tau steps later). `weights`, `compression`,
  `axis_name`, `key` as in `outer_update`.

  Returns:
    (global_params, state, included): x with the fragment stepped (the
    others as they were), the next state, which islands took part.
  """
  library_checks.check_fragment(fragment, len(state.outer_opt_states),
                                "fragment_send")
  library_checks.check_assignment(state.assignment, global_params,
                                  "fragment_send")
  library_checks.check_update(
      global_params, island_params, residuals=state.residuals,
      codec_state=state.codec_state, weights=weights,
      compression=compression, axis_name=axis_name,
      made_by="streaming_init", used_by="fragment_send")
  sent = send_fragment(
      global_params, island_params, state.outer_opt_states,
      state.codec_state, state.residuals, state.assignment, fragment,
      outer_tx, weights=weights, compression=compression,
      axis_name=axis_name, key=key)
  return sent.params, state.replace(
      outer_opt_states=sent.outer_opt_states, codec_state=sent.codec_state,
      residuals=sent.residuals), sent.included


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
  x = select(global_params)
  synced = library_diloco.island_mean(
      x, select(island_params), weights=weights,
      residuals=select(residuals), codec_state=fragment_codec_state,
      compression=compression, axis_name=axis_name, key=key)
  x, outer_state = outer_step_lib.outer_update(
      outer_tx, x, outer_opt_states[fragment], synced.mean, synced.anyone)
  outer_states = list(outer_opt_states)
  outer_states[fragment] = outer_state
  if fragment_codec_state is not None:
    codec_state = list(codec_state)
    kept = outer_step_lib.keep_unless(synced.anyone, synced.codec_state,
                                      fragment_codec_state)
    for i, entry in zip(positions, kept):
      codec_state[i] = entry
    codec_state = tuple(codec_state)
  if residuals is not None:
    residuals = fragments_lib.replace(residuals, assignment, fragment,
                                      synced.residuals)
  return FragmentSent(
      fragments_lib.replace(global_params, assignment, fragment, x),
      tuple(outer_states), codec_state, residuals, synced.included)


def fragment_merge(global_params, island_params, state: StreamingState,
                   fragment: int, alpha: float = 0.0, *,
                   axis_name: str | None = None):
  """A fragment's merge: every island's leaves of the fragment become
  alpha * y + (1 - alpha) * x (alpha 0: x itself); an island whose
  fragment is not finite takes x. Returns the islands' params ([k, ...]
  stacked, or this island's with `axis_name`; the merge itself is local)."""
  library_checks.check_fragment(fragment, len(state.outer_opt_states),
                                "fragment_merge")
  library_checks.check_assignment(state.assignment, global_params,
                                  "fragment_merge")
  # Stacked or one island's trees (the merge is local: without axis_name
  # either form, the same for every leaf).
  library_checks.check_islands(global_params, island_params,
                               None if axis_name is None else False)
  del axis_name  # no collective: each island blends its own leaves
  assignment = state.assignment
  x = fragments_lib.select(global_params, assignment, fragment)
  y = fragments_lib.select(island_params, assignment, fragment)
  stacked = y[0].ndim > x[0].ndim
  if not stacked:
    y = [leaf[None] for leaf in y]
  merged = fragments_lib.blend(x, y, alpha)
  if not stacked:
    merged = [leaf[0] for leaf in merged]
  return fragments_lib.replace(island_params, assignment, fragment, merged)
