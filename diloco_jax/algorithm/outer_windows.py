"""The outer step for results that arrive one at a time: asynchronous
islands, each starting its next call the moment its result is in.

    window = outer.open_window(x, state)
    for each island's result as it arrives:
      scale = arrival_scale(its tokens, the window's tokens, overtaken, k)
      synced = outer.arrival_mean(x, state, island=i, island_params=y_i,
                                  start=the x its call started from,
                                  scale=scale)
      x, state, window = outer.add_arrival(window, synced)
      if the window holds a round's worth of results:
        window = outer.open_window(x, state)

Each result's pseudo-gradient (against the x its call started from, times
its scale) joins its window's sum, and x is always the outer step on that
sum from the window's first x and state. The outer optimizer's state (its
momentum) therefore moves once a window, as a round's does: stepped once
per result it would compound Nesterov's momentum over results that are
stale to each other (the failure Liu et al. 2024, asynchronous Local-SGD,
mend with a delayed Nesterov update). A window holding one result per
island, scaled by its share of the tokens, moves x, the optimizer state
and the residuals as a synchronous round's token-weighted mean does.

Each result goes through the codec alone, unscaled, as an island that
encodes its own pseudo-gradient sends it; its share is applied after.
Where a round's collective works on the islands' results together (int8's
all-reduce requantizes their sum; low rank factors their mean with shared
bases), a window differs from a round by that codec's error.

The plain outer step only: the overlaps and Streaming DiLoCo put a
round's mean in flight or split it, which results that never wait for
each other have no round to do.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from diloco_jax.algorithm import island_mean as island_mean_lib
from diloco_jax.algorithm import outer_checks
from diloco_jax.algorithm import outer_rules


class Window(NamedTuple):
  """A window of results in progress (`open_window`, `add_arrival`).

  Attributes:
    params: x when the window opened.
    state: the outer state then.
    total: the window's scaled pseudo-gradients summed (float32,
      params-shaped).
    included: which islands' results it holds ([k] bool).
    codec_state: the codec's state after its last result (low rank's
      ranks; None for codecs without one).
  """
  params: Any
  state: Any
  total: Any
  included: jax.Array
  codec_state: Any


def open_window(params, state) -> Window:
  """A window opening at x = `params` and outer state `state` (stacked)."""
  return Window(params, state,
                jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32),
                             params),
                jnp.zeros_like(state.included), state.codec_state)


def arrival_mean(outer, params, state, island, island_params, start, *,
                 scale=1.0, key: jax.Array | None = None
                 ) -> island_mean_lib.IslandMean:
  """One island's result as the `mean` that `add_arrival` takes: its
  pseudo-gradient against `start` (the x its call started from) through
  the codec, with its error feedback, then times `scale` (as a round
  weights each island's decoded pseudo-gradient, so its residual keeps
  the unscaled remainder). `island` (an int, traced or not) picks the
  island's slot of the stacked state; x and `state` are as they stand
  now, so its residual and the codec state move on from the results
  already applied."""
  outer_checks.check_window(outer, state, "arrival_mean")
  num_islands = state.included.shape[0]
  # The other islands' slots hold x against x: weight 0, they send nothing.
  put = lambda tree: jax.tree.map(
      lambda x, a: jnp.broadcast_to(x, (num_islands,) + x.shape)
      .at[island].set(a), params, tree)
  synced = island_mean_lib.island_mean(
      put(start), put(island_params),
      weights=jax.nn.one_hot(island, num_islands),
      residuals=state.residuals, codec_state=state.codec_state,
      compression=outer.codec, key=key, stacked_reference=True)
  return synced._replace(mean=jax.tree.map(lambda m: m * scale,
                                           synced.mean))


def add_arrival(outer, window: Window, synced: island_mean_lib.IslandMean):
  """(x, state, window): x and the outer state after the outer step on
  the window's sum with `synced.mean` added, from the window's first x
  and state; the window holding it. A result that is not finite
  (`synced.anyone` False) changes nothing."""
  outer_checks.check_window(outer, window.state, "add_arrival")
  taken = synced.anyone
  total = jax.tree.map(lambda t, m: t + jnp.where(taken, m, 0.0),
                       window.total, synced.mean)
  included = window.included | synced.included
  codec_state = outer_rules.keep_unless(taken, synced.codec_state,
                                        window.codec_state)
  # The residuals (an island left out keeps its own) and the codec state
  # are the latest result's; x and the optimizer state move on from the
  # window's first.
  x, state = outer.take(window.params, window.state, synced._replace(
      mean=total, included=included, anyone=jnp.any(included),
      codec_state=codec_state))
  return x, state, window._replace(total=total, included=included,
                                   codec_state=codec_state)


def arrival_scale(weight: float, window_weight: float, overtaken: int,
                  members: int) -> float:
  """What a result's pseudo-gradient is multiplied by when it reaches x:
  its `weight` (tokens times corpus share) over the window's
  (`window_weight`: the members' calls together), divided by 1 + how many
  windows late it is: the results applied since its call started
  (`overtaken`) beyond the one each other member sends meanwhile, in
  windows of `members` results (the staleness rule of late results)."""
  late = max(0, overtaken - (members - 1)) / members
  return weight / window_weight / (1 + late)
