"""Low-rank approximation of pseudo-gradient matrices by power iteration.

The collective parts live in compression.py; these are the local pieces:
how a tensor is viewed as a matrix, the candidate ranks, the warm-start
basis and the energy rule that picks the next round's rank.

Each round, for a matrix M_i on island i and an orthonormal basis Q
[cols, r] carried from the previous round (one power-iteration step, as in
PowerSGD):
  P = sum_i w_i M_i Q          (all-reduced, [rows, r])
  P^ = orthonormal basis of P  (identical on every island)
  C = sum_i w_i M_i^T P^       (all-reduced, [cols, r])
  mean ~= P^ C^T               (exact when the mean has rank <= r)
The next round's basis is C's left singular vectors, so the iteration keeps
refining the same subspace across rounds (warm start) instead of starting
from noise.
"""

import math

import jax
import jax.numpy as jnp


def matrix_view(shape) -> tuple[int, int]:
  """(rows, cols) of a tensor viewed as a matrix: the last axis is the
  columns (a kernel's output features), the others are flattened."""
  return math.prod(shape[:-1]), shape[-1]


def rank_ladder(min_rank: int, max_rank: int) -> tuple[int, ...]:
  """The ranks an adaptive codec chooses from: min_rank, doubling, max_rank.

  Each rank is one compiled branch of the outer step, so the ladder is
  geometric rather than every integer in [min_rank, max_rank].
  """
  ranks = [min_rank]
  while ranks[-1] * 2 < max_rank:
    ranks.append(ranks[-1] * 2)
  if ranks[-1] != max_rank:
    ranks.append(max_rank)
  return tuple(ranks)


def orthonormalize(m: jax.Array) -> jax.Array:
  """An orthonormal basis [n, r] of the columns of m [n, r] (n >= r)."""
  q, _ = jnp.linalg.qr(m)
  return q


def initial_basis(key: jax.Array, cols: int, max_rank: int) -> jax.Array:
  """A random orthonormal [cols, max_rank] basis for the first round."""
  return orthonormalize(jax.random.normal(key, (cols, max_rank), jnp.float32))


def next_basis(coefficients: jax.Array, basis: jax.Array) -> jax.Array:
  """The warm start for the next round.

  Args:
    coefficients: C [cols, r], this round's all-reduced M^T P^.
    basis: the [cols, max_rank] basis this round started from.

  Returns:
    [cols, max_rank]: C's left singular vectors (strongest first), then the
    old basis's remaining columns, orthonormalized, so a higher rank next
    round still starts from a sensible subspace.
  """
  r = coefficients.shape[1]
  u, _, _ = jnp.linalg.svd(coefficients, full_matrices=False)
  return orthonormalize(jnp.concatenate([u, basis[:, r:]], axis=1))


def choose_rank_index(component_energy: jax.Array, total_energy: jax.Array,
                      ranks: tuple[int, ...], current_index: int,
                      energy_fraction: float) -> jax.Array:
  """The ladder index of the next round's rank.

  Args:
    component_energy: [r] the (weighted) energy of the pseudo-gradients
      along each of this round's r = ranks[current_index] basis directions.
    total_energy: their total energy (squared Frobenius norm).
    ranks: the ladder (see rank_ladder).
    current_index: this round's index into `ranks` (static).
    energy_fraction: the fraction of the total energy to keep.

  Returns:
    The smallest ladder index whose rank keeps `energy_fraction` of the
    energy, judged from this round's directions (strongest first); one step
    up the ladder when even rank r keeps less.
  """
  captured = jnp.cumsum(jnp.sort(component_energy)[::-1])
  fraction = captured / jnp.maximum(total_energy, 1e-30)
  candidates = jnp.array([fraction[rank - 1] >= energy_fraction
                          for rank in ranks[:current_index + 1]])
  lowest_sufficient = jnp.argmax(candidates)
  up = min(current_index + 1, len(ranks) - 1)
  return jnp.where(jnp.any(candidates), lowest_sufficient, up).astype(
      jnp.int32)
