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

The outer steps that follow these rules are outer_step.py's.
"""

import jax
import jax.numpy as jnp

OVERLAPS = ("none", "one_step_delay", "one_step_delay_rebase")
DELAYED_OVERLAPS = OVERLAPS[1:]


def is_delayed(overlap: str) -> bool:
  """Whether `overlap` applies each round's mean one round late."""
  if overlap not in OVERLAPS:
    raise ValueError(f"overlap={overlap!r} is not one of {OVERLAPS}")
  return overlap in DELAYED_OVERLAPS


def rebases(overlap: str) -> bool:
  """Whether `overlap` keeps the islands' progress across the delay."""
  return is_delayed(overlap) and overlap == "one_step_delay_rebase"


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
