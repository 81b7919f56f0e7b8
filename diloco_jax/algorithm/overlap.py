"""How an outer step meets the local training: the overlap rules.

config.diloco.overlap:

  'none'                    each round's mean is applied at once; the
                            islands wait for the collective.
  'one_step_delay'          (DiLoCoX) round r's mean D(r) is applied at the
                            end of round r + 1, so its collective has all of
                            round r + 1 to arrive; every island starts round
                            r + 1 from x_r = OuterOpt(x_{r-1}, D(r - 1)).
  'one_step_delay_rebase'   the same timing, but no island discards its
                            round: it starts round r + 1 from x_r plus its
                            own progress of round r (whose mean is still in
                            flight), measured from its anchor a_i, the point
                            it started the round from (`rebase`).
  'eager'                   (eager updates, after Kale et al. 2025) the
                            same timing for the islands' mean, but each
                            island m steps its own copy of the outer point
                            x_m with its own outer optimizer state at once,
                            on its fresh pseudo-gradient in place of its
                            part of the mean still in flight:
                              D~_m(r) = D(r-1) - u_m(r-1) + u_m(r),
                              u_m(r) = c d_m(r),
                            x_m(r) = OuterOpt_m(x_m(r-1), D~_m(r)), and
                            starts round r + 1 from x_m(r); d_m(r) is taken
                            against x_m(r-1) (its anchor). When D(r) lands,
                            it replaces the island's u_m(r) in the next D~;
                            nothing is recomputed. c is
                            config.diloco.eager_own_weight, 1 unless set:
                            the island applies its whole round at once, so
                            the islands' average point steps as DiLoCo's x
                            does without overlap.
  'eager_share'             the paper's rule: the same, with u_m(r) the
                            island's share of the mean, w_m d_m(r) / sum_j
                            w_j, so the others' part of the round is a round
                            late.
                            Under either, the run's first
                            config.diloco.overlap_warmup_rounds rounds wait
                            for their own mean: u_m(r) = D(r), so every
                            island steps as DiLoCo's x (`block_on_mean`).
                            With either, x, the model the run is judged by,
                            is the islands' average point, formed to
                            evaluate and at the end (after the rest of the
                            last mean, D(R) - u_m(R), is applied the same
                            way).

The outer steps that follow these rules are outer_step.py's.
"""

import jax
import jax.numpy as jnp

OVERLAPS = ("none", "one_step_delay", "one_step_delay_rebase", "eager",
            "eager_share")
DELAYED_OVERLAPS = OVERLAPS[1:]
EAGER_OVERLAPS = ("eager", "eager_share")
# The modes whose islands take their pseudo-gradients against a point of
# their own (an anchor per island) rather than the shared x.
ANCHORED_OVERLAPS = ("one_step_delay_rebase",) + EAGER_OVERLAPS


def is_delayed(overlap: str) -> bool:
  """Whether `overlap` applies each round's mean one round late."""
  if overlap not in OVERLAPS:
    raise ValueError(f"overlap={overlap!r} is not one of {OVERLAPS}")
  return overlap in DELAYED_OVERLAPS


def is_eager(overlap: str) -> bool:
  """Whether `overlap` steps each island's own outer point at once."""
  return is_delayed(overlap) and overlap in EAGER_OVERLAPS


def anchored(overlap: str) -> bool:
  """Whether the islands' pseudo-gradients are taken against anchors of
  their own (state.anchors) rather than the shared x."""
  return is_delayed(overlap) and overlap in ANCHORED_OVERLAPS


def own_shares(pseudo_grads, weights: jax.Array, sends: jax.Array,
               own_weight: float | None = None, total=None):
  """u_m = w_m d_m / sum_j w_j per island (stacked like `pseudo_grads`, in
  float32): each island's share of the mean it is about to send, or
  u_m = own_weight * d_m; 0 for an island not in `sends` [islands] (no
  weight, or a pseudo-gradient that is not finite).

  The total is over the weights every island knows before the collective
  (the round's schedule): sum(weights), or `total` where the stacked
  islands are a part of them (one island's, inside shard_map). The landed mean is normalized over the islands
  that took part and replaces these shares a round later, so a difference
  between the two lasts one round.

  Why a weight of its own: the share (the paper's) keeps the islands' points
  close but leaves the others' part of the round's progress a round late;
  own_weight = 1 applies the island's whole round at once (nothing late if
  the islands agree) but lets its points drift from the others' for a
  round. Between the two, each island's point holds part of both.
  """
  if own_weight is None:
    total = jnp.sum(weights) if total is None else total
    share = jnp.where(sends, weights / jnp.where(total > 0, total, 1.0), 0.0)
  else:
    share = jnp.where(sends, jnp.float32(own_weight), 0.0)
  def one(d):
    column = lambda v: v.reshape((-1,) + (1,) * (d.ndim - 1))
    # NaN x 0 is still NaN: a diverged island's values are dropped first.
    return jnp.where(column(sends), column(share) * d.astype(jnp.float32),
                     0.0)
  return jax.tree.map(one, pseudo_grads)


def eager_updates(in_flight, in_flight_valid, old_shares, new_shares):
  """D~_m = D(r-1) - u_m(r-1) + u_m(r) per island (float32, stacked like
  the shares): the landed mean with each island's stale share of it
  swapped for its fresh one. Before any mean has landed (round 0, or a
  round no island took part in) D(r-1) and u_m(r-1) count as 0."""
  def one(mean, old, new):
    landed = jnp.where(in_flight_valid, mean[None] - old, 0.0)
    return landed + new
  return jax.tree.map(one, in_flight, old_shares, new_shares)


def block_on_mean(blocking, mean, mean_valid, updates, shares):
  """(updates, shares) of a round that waits for its own mean D(r) (the
  eager overlap's warm-up), or the given ones when `blocking` is False.

  Waiting, every island steps on D(r) as DiLoCo's x does, and D(r) is
  its share, u_m(r) = D(r), so when D(r) lands a round later it cancels
  exactly. With no mean (no island took part) both are 0: no step.
  """
  def pick(m, given):
    waited = jnp.where(mean_valid, m, 0.0)[None]
    return jnp.where(blocking, jnp.broadcast_to(waited, given.shape), given)
  return (jax.tree.map(pick, mean, updates),
          jax.tree.map(pick, mean, shares))


def rebase(island_params, anchors, x, keep: jax.Array):
  """(island params, anchors) for the next round of the rebasing delay.

  An island in `keep` [islands] starts it from x plus its progress since
  its anchor, y_i <- x + (y_i - a_i), the rest from x; either way its new
  anchor is where it starts. Sums in float32, so low-precision params lose
  no more than their own rounding.
  """
  def one(y, a, new_x):
    progress = y.astype(jnp.float32) - a.astype(jnp.float32)
    kept = keep.reshape((-1,) + (1,) * (y.ndim - 1))
    return jnp.where(kept, new_x.astype(jnp.float32)[None] + progress,
                     new_x[None]).astype(y.dtype)
  island_params = jax.tree.map(one, island_params, anchors, x)
  return island_params, island_params
