"""DiLoCo's synchronizations, as the loop runs them after an inner step.

The schedule (algorithm/schedule.py) says which programs run after a step:
an outer step, the flush of a delayed mean, or Streaming DiLoCo's
per-fragment sends and merges. `Syncs` weighs the islands, runs those
programs (compiled on the compute devices, or the outer side's with
outer_placement='host') and counts what crossed the island link.
"""

import numpy as np

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import schedule as schedule_lib
from diloco_jax.analysis import link_bytes
from diloco_jax.parallel import multihost
from diloco_jax.run import setup as setup_lib
from diloco_jax.telemetry import counters


def run_actions(actions, state, programs, weights, host_outer=None):
  """Runs the schedule's synchronization programs after a step, in order:
  the compiled ones, or with outer_placement='host' `host_outer`'s (a
  merge then takes the fragment's x from it)."""
  outer = programs if host_outer is None else host_outer
  for action in actions:
    if action.kind == schedule_lib.OUTER:
      state = outer.outer_step(state, weights)
    elif action.kind == schedule_lib.FLUSH:
      state = outer.flush(state)  # the last update in flight
    elif action.kind == schedule_lib.SEND:
      state = outer.sends[action.fragment](state, weights)
    elif action.kind == schedule_lib.MERGE:
      merge = programs.merges[action.fragment]
      state = (merge(state) if host_outer is None
               else merge(state, host_outer.fragment_x(action.fragment)))
    else:
      raise ValueError(f"unknown schedule action {action}")
  return state


def rank_indices(state) -> tuple[int, ...] | None:
  """The low-rank codecs' ranks for this round, chosen last round (a small
  fetch of the codec state's indices)."""
  indices = compression_lib.rank_indices(state.outer.codec_state)
  return None if indices is None else tuple(indices)


class Syncs:
  """Runs a run's synchronizations and counts their bytes.

  Attributes:
    link_bytes: what one island sends for each sync (analysis.link_bytes).
    mean_rank: the low-rank codecs' mean rank at the last sync, or None.
  """

  def __init__(self, setup: setup_lib.RunSetup):
    config = setup.config
    self._setup = setup
    self._schedule = setup.run_config.schedule
    self._tokens_per_island_step = (config.data.batch_size
                                    * config.data.sequence_length)
    self.link_bytes = link_bytes.LinkBytes(
        config, setup.abstract_state.global_params, setup.islands,
        setup.spec.compression, setup.spec.layout)
    self.mean_rank = None

  def sync_bytes(self, state) -> int:
    """What one island sends in one sync of every param, at this round's
    ranks."""
    return self.link_bytes.sync(rank_indices(state))

  def after(self, step: int, state, programs, synced: np.ndarray,
            progress: counters.Progress):
    """Runs the schedule's syncs after `step` among the `synced` islands
    and counts their bytes in `progress`.

    Returns:
      (state, excluded): the state after them, and the islands left out of
      them for having diverged.
    """
    setup = self._setup
    actions = self._schedule.after(step)
    if not actions:
      return state, np.zeros(setup.islands, bool)
    # Islands are weighted by the tokens they processed this round (the
    # same for every island) times their share of the corpus; those not
    # synced this round get weight 0. Islands that diverged are left out
    # too (the programs mask them on the device; this counts them).
    weights = multihost.place(
        (progress.island_round_steps * self._tokens_per_island_step
         * setup.data.island_shares * synced).astype(np.float32),
        setup.weights_shape.sharding)
    excluded = synced & ~multihost.fetch(programs.check_islands(state))
    host_outer = setup.host_outer
    ranks = rank_indices(state if host_outer is None
                         else host_outer.outer_state)
    self.mean_rank = (None if not ranks else float(np.mean(
        [setup.spec.compression.ranks[i] for i in ranks])))
    state = run_actions(actions, state, programs, weights, host_outer)
    self.link_bytes.count_syncs(progress, actions, ranks,
                                int((synced & ~excluded).sum()))
    return state, excluded
