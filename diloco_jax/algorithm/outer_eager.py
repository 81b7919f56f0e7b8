"""Eager updates' parts of the outer object (outer.py): each island's own
outer step at a round's start, and the islands settling on their average
at a run's end (overlap.py states the rule). Pure functions over the
object's state, in the form `outer_state.Form` says.
"""

import jax
import jax.numpy as jnp
import optax

from diloco_jax.algorithm import island_trees
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.algorithm import outer_rules
from diloco_jax.algorithm import outer_state


def start(outer_tx: optax.GradientTransformation,
          overlap: outer_overlaps.Eager, island_params,
          state: outer_state.OuterState, included, landed, mean, weights,
          form: outer_state.Form, wait=None):
  """Each island's own outer step on the `landed` mean with its part
  swapped (outer_rules.eager_steps), or in a round that waits on this
  round's `mean` (default: the state's in flight): (points, state)."""
  weights = jnp.broadcast_to(
      jnp.asarray(1.0 if weights is None else weights, jnp.float32),
      jnp.shape(included))
  # The share rule's total is over the weights every island knows before
  # the collective.
  total = None if form.stacked else jax.lax.psum(weights, form.axis_name)
  waited = None
  if wait is None and overlap.warmup_rounds:
    wait = state.round <= overlap.warmup_rounds  # counts this round
  if wait is not None and wait is not False:
    mean = (state.in_flight, state.in_flight_valid) if mean is None else mean
    waited = (wait, *mean)
  points, outer_states, shares = outer_rules.eager_steps(
      outer_tx, form.one(state.anchors), form.one(island_params),
      form.one(state.outer_opt_state), form.one(state.own_shares),
      *landed, form.one(weights), form.one(included), stages=form.stages,
      own_weight=overlap.own_weight, waited=waited, total_weight=total)
  points = form.unone(points)
  return points, state.replace(anchors=points,
                               outer_opt_state=form.unone(outer_states),
                               own_shares=form.unone(shares))


def settle(outer_tx: optax.GradientTransformation,
           state: outer_state.OuterState, form: outer_state.Form):
  """Eager's end: the last mean lands, each island steps on the rest of
  it, and every island, x and the outer state become their average:
  (x, islands, state)."""
  points, outer_states = outer_rules.eager_last_steps(
      outer_tx, form.one(state.anchors), form.one(state.outer_opt_state),
      form.one(state.own_shares), state.in_flight, state.in_flight_valid,
      form.stages)
  if form.stacked:
    x = island_trees.islands_average(points)
    average_state = island_trees.islands_average(outer_states)
  else:
    average = lambda tree: jax.tree.map(
        lambda a: outer_state.mean_over(a[0], form.axis_name), tree)
    x, average_state = average(points), average(outer_states)
  islands = form.copies(x)
  return x, islands, state.replace(
      anchors=islands, outer_opt_state=form.copies(average_state),
      own_shares=jax.tree.map(jnp.zeros_like, state.own_shares),
      in_flight=jax.tree.map(jnp.zeros_like, state.in_flight),
      in_flight_valid=jnp.zeros((), bool))


def average_point(state: outer_state.OuterState, axis_name: str | None):
  """The islands' average point (their anchors' mean): stacked with
  `axis_name` None, else a mean over that axis."""
  if axis_name is None:
    return island_trees.islands_average(state.anchors)
  return jax.tree.map(lambda a: outer_state.mean_over(a, axis_name),
                      state.anchors)
