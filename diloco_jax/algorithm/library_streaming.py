"""The library's Streaming DiLoCo (re-exported by library.py): the params
cut into fragments, each synced on its own staggered schedule so one
fragment's bytes cross the link at a time, and merged into the islands a
few inner steps after its send. Both forms: stacked islands [k, ...], or
one island inside shard_map with `axis_name`.
"""

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import optax

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import library_checks
from diloco_jax.algorithm import library_diloco
from diloco_jax.algorithm import outer as outer_lib
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.algorithm import outer_state as outer_state_lib
from diloco_jax.algorithm import streaming_rules
# Re-exported by library.py: the fragments and the schedule.
from diloco_jax.algorithm.streaming_rules import (  # pylint: disable=unused-import
    fragment_assignment, streaming_schedule)


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
  overlap = outer_overlaps.Streaming(
      num_fragments, assignment=(None if assignment is None
                                 else tuple(int(f) for f in assignment)))
  assignment, outer_opt_states = streaming_rules.init_fragments(
      params, overlap, outer_tx)
  base = library_diloco.init(params, outer_tx, num_islands,
                             compression=compression,
                             error_feedback=error_feedback, seed=seed)
  return StreamingState(
      outer_opt_states=outer_opt_states, codec_state=base.codec_state,
      residuals=base.residuals, assignment=assignment)


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
  # The outer object's send (outer.py), the same as every runtime's.
  algorithm = outer_lib.DiLoCo(
      outer_tx, compression_lib.as_compression(compression),
      outer_overlaps.Streaming(len(state.outer_opt_states),
                               assignment=state.assignment),
      error_feedback=state.residuals is not None)
  stacked = axis_name is None
  outer_state = outer_lib.OuterState(
      round=jnp.zeros((), jnp.int32),
      included=(jnp.ones(jax.tree.leaves(island_params)[0].shape[:1], bool)
                if stacked else jnp.ones((), bool)),
      outer_opt_state=state.outer_opt_states, codec_state=state.codec_state,
      residuals=state.residuals,
      recipe=outer_state_lib.Recipe(algorithm.codec, algorithm.overlap,
                                    algorithm.error_feedback,
                                    state.assignment))
  synced = algorithm.mean(global_params, island_params, outer_state,
                          weights=weights, key=key, axis_name=axis_name,
                          fragment=fragment)
  sent = algorithm.apply(global_params, None, outer_state, synced,
                         fragment=fragment)
  return sent.params, state.replace(
      outer_opt_states=sent.state.outer_opt_state,
      codec_state=sent.state.codec_state,
      residuals=sent.state.residuals), synced.included


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
  return streaming_rules.merge_fragment(global_params, island_params,
                                        state.assignment, fragment, alpha)
