"""The outer step's rules on pytrees, shared by the outer object
(outer.py) and the programs built from its pieces: x's outer optimizer
step, and eager updates' steps of every island's own point (overlap.py
states the rules).
"""

import jax
import jax.numpy as jnp
import optax

from diloco_jax.algorithm import overlap as overlap_lib
from diloco_jax.parallel.stages import per_stage


def keep_unless(changed, new, old):
  """`new` where the scalar bool `changed` holds, else `old` (leafwise)."""
  return jax.tree.map(lambda n, o: jnp.where(changed, n, o), new, old)


def outer_update(outer_opt, global_params, outer_opt_state, update,
                 takes_effect, stages: int = 1):
  """(x, outer state) after the outer optimizer's step on `update`, or both
  unchanged when `takes_effect` is False (momentum alone would move x).
  With `stages` > 1 (staged trees) each stage steps its own layers with
  its own outer state."""
  def step(x, opt_state, update):
    updates, new_state = outer_opt.update(update, opt_state, x)
    return optax.apply_updates(x, updates), new_state

  new_global, new_state = per_stage(step, stages)(global_params,
                                                  outer_opt_state, update)
  return (keep_unless(takes_effect, new_global, global_params),
          keep_unless(takes_effect, new_state, outer_opt_state))


def eager_steps(outer_opt: optax.GradientTransformation, points,
                island_params, outer_states, old_shares, landed,
                landed_valid, weights, sends, stages: int = 1,
                own_weight: float | None = None, waited=None,
                total_weight=None):
  """Eager updates' rule on stacked islands [islands, ...] (see
  eager_islands): each island's point x_m steps with its own outer state
  on D(r-1) - u_m(r-1) + u_m(r), u_m(r) from its fresh pseudo-gradient
  x_m - y_m. Returns (points, outer_states, shares u_m(r)).
  `total_weight`: the islands' total weight where `weights` are only some
  of them (default their sum)."""
  pseudo_grads = jax.tree.map(
      lambda a, y: a.astype(jnp.float32) - y.astype(jnp.float32),
      points, island_params)
  shares = overlap_lib.own_shares(pseudo_grads, weights, sends, own_weight,
                                  total_weight)
  updates = overlap_lib.eager_updates(landed, landed_valid, old_shares,
                                      shares)
  if waited is not None:
    updates, shares = overlap_lib.block_on_mean(*waited, updates, shares)
  points, outer_states = island_outer_steps(outer_opt, points, outer_states,
                                            updates, stages)
  return points, outer_states, shares


def eager_last_steps(outer_opt: optax.GradientTransformation, points,
                     outer_states, shares, in_flight, in_flight_valid,
                     stages: int = 1):
  """The end of an eager run on stacked islands: the last mean lands and
  each island steps its point on the rest of it, D(R) - u_m(R) (exactly
  zero with one island). Returns (points, outer_states)."""
  updates = overlap_lib.eager_updates(
      in_flight, in_flight_valid, shares,
      jax.tree.map(jnp.zeros_like, shares))
  return island_outer_steps(outer_opt, points, outer_states, updates, stages)


def island_outer_steps(outer_opt: optax.GradientTransformation, points,
                       outer_states, updates, stages: int = 1):
  """(x_m, outer states) [islands, ...] after every island's own outer step
  from its point x_m on its `updates` (eager updates); an island whose
  update is zero does not step (momentum alone would move it)."""
  def one_island(x, opt_state, update):
    moves = jnp.any(jnp.stack([jnp.any(u != 0)
                               for u in jax.tree.leaves(update)]))
    return outer_update(outer_opt, x, opt_state, update, moves, stages)

  return jax.vmap(one_island)(points, outer_states, updates)


def fragment_step(outer_tx: optax.GradientTransformation, x, outer_opt_state,
                  codec_state, mean, anyone):
  """One fragment's outer step on its round's mean (Streaming DiLoCo):
  (x, outer state, codec state) of the fragment, x stepped on `mean`
  unless no island took part (`anyone` False: nothing moves, and the codec
  state the collective returned, `codec_state` as given otherwise, is the
  old one then). `codec_state` is a pair (old, new) or None."""
  x, outer_opt_state = outer_update(outer_tx, x, outer_opt_state, mean,
                                    anyone)
  if codec_state is not None:
    old, new = codec_state
    codec_state = keep_unless(anyone, new, old)
  return x, outer_opt_state, codec_state

