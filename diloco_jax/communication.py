"""The one communication boundary: every cross-island reduction goes here.

`island_mean` runs inside a shard_map over the 'island' axis and is the only
place the program crosses the slow link; `island_mean_bytes` says how many
bytes one island sends for it. Codecs, the active-island mask and the choice
of communication devices plug in here and nowhere else.

Byte accounting assumes the collective is a ring all-reduce: each of k peers
sends 2(k-1) chunks of ceil(n/k) elements per array (reduce-scatter, then
all-gather). One island sends nothing when k = 1.
"""

import math

import jax
import numpy as np

from diloco_jax.mesh import ISLAND


def island_mean(tree, weight, axis_name: str = ISLAND):
  """Weighted mean of `tree` over the islands, computed with lax.psum.

  Must be called inside a shard_map (or pmap) that names `axis_name`.

  Args:
    tree: this island's pytree of arrays (e.g. its pseudo-gradient).
    weight: this island's scalar weight (tokens it processed; 0 if inactive).
    axis_name: the mesh axis along which islands are laid out.

  Returns:
    sum_i w_i * tree_i / sum_i w_i, identical on every island.
  """
  total_weight = jax.lax.psum(weight, axis_name)
  # Accumulate in float32 whatever the leaves' dtype: summing in low
  # precision loses the small pseudo-gradients of late training.
  weighted = jax.tree.map(lambda x: x.astype(np.float32) * weight, tree)
  summed = jax.lax.psum(weighted, axis_name)
  return jax.tree.map(
      lambda s, x: (s / total_weight).astype(x.dtype), summed, tree)


def ring_allreduce_bytes(num_elements: int, itemsize: int,
                         num_islands: int) -> int:
  """Bytes one peer sends in a ring all-reduce of one array."""
  if num_islands <= 1:
    return 0
  chunk = math.ceil(num_elements / num_islands)
  return 2 * (num_islands - 1) * chunk * itemsize


def island_mean_bytes(tree, num_islands: int) -> int:
  """Bytes one island sends for `island_mean(tree, weight)`.

  Args:
    tree: a pytree of arrays or of jax.ShapeDtypeStruct with one island's
      shapes (no leading island dimension).
    num_islands: k, the size of the 'island' axis.
  """
  # Values are reduced in float32 (see island_mean), plus the scalar weight.
  total = ring_allreduce_bytes(1, 4, num_islands)
  for leaf in jax.tree.leaves(tree):
    total += ring_allreduce_bytes(int(np.prod(leaf.shape)), 4, num_islands)
  return total
