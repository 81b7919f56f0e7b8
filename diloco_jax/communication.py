"""The one communication boundary: every cross-island reduction goes here.

`island_mean` runs inside a shard_map over the 'island' axis and is the only
place the program crosses the slow link; `island_mean_bytes` says how many
bytes one island sends for it. Codecs, the active-island mask and the choice
of communication devices plug in here and nowhere else.

Uncompressed (fp32) means are a psum, counted as a ring all-reduce: each of
k peers sends 2(k-1) chunks of ceil(n/k) elements per array. A compressed
mean runs the two phases of that ring with encoded chunks (DESIGN.md §1.3):
an all_to_all of encoded chunks (reduce-scatter), decode and sum in float32,
re-encode the reduced chunk, all_gather. Each island then sends 2(k-1)
encoded chunks of n/k values: the codec's full ratio at any k, where an
all-gather of whole payloads would send (k-1) payloads. One island sends
nothing when k = 1.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from diloco_jax import codecs
from diloco_jax.mesh import ISLAND


def island_mean(tree, weight, axis_name: str = ISLAND,
                codec: codecs.DenseCodec | None = None,
                key: jax.Array | None = None, return_sent: bool = False):
  """Weighted mean of `tree` over the islands, identical on every island.

  Must be called inside a shard_map (or pmap) that names `axis_name`.

  Args:
    tree: this island's pytree of arrays (e.g. its pseudo-gradient).
    weight: this island's scalar weight (tokens it processed; 0 if inactive).
    axis_name: the mesh axis along which islands are laid out.
    codec: how values cross the link; None or fp32 sends them uncompressed.
    key: a PRNG key for the codec's stochastic rounding (None: nearest).
    return_sent: also return what this island's contribution became after
      encoding, in `tree`'s units (for error feedback).

  Returns:
    sum_i w_i * tree_i / sum_i w_i (with each island's contribution passed
    through the codec), in the leaves' own dtypes; with `return_sent`, the
    pair (mean, sent).
  """
  if codec is not None and not codec.is_identity:
    mean, sent = _compressed_island_mean(tree, weight, axis_name, codec, key)
  else:
    total_weight = jax.lax.psum(weight, axis_name)
    # Accumulate in float32 whatever the leaves' dtype: summing in low
    # precision loses the small pseudo-gradients of late training.
    weighted = jax.tree.map(lambda x: x.astype(np.float32) * weight, tree)
    summed = jax.lax.psum(weighted, axis_name)
    mean = jax.tree.map(
        lambda s, x: (s / total_weight).astype(x.dtype), summed, tree)
    sent = tree
  return (mean, sent) if return_sent else mean


def _chunk_length(num_values: int, num_islands: int, block_size: int) -> int:
  """Values per island chunk: n/k rounded up to whole codec blocks."""
  return math.ceil(num_values / (num_islands * block_size)) * block_size


def _compressed_island_mean(tree, weight, axis_name: str,
                            codec: codecs.DenseCodec, key):
  num_islands = jax.lax.psum(1, axis_name)
  flat, unravel = ravel_pytree(
      jax.tree.map(lambda x: x.astype(jnp.float32), tree))
  share = weight / jax.lax.psum(weight, axis_name)
  n = flat.size
  chunk = _chunk_length(n, num_islands, codec.block_size)
  chunks = jnp.pad(flat * share, (0, chunk * num_islands - n)).reshape(
      num_islands, chunk)
  send_keys = reduce_key = None
  if key is not None:  # independent rounding noise per chunk and phase
    send_keys = jax.random.split(jax.random.fold_in(key, 0), num_islands)
    reduce_key = jax.random.fold_in(key, 1)
  # Reduce-scatter: island i receives every island's encoded chunk i.
  sent = jax.vmap(codec.encode)(chunks, send_keys)
  received = jax.tree.map(
      lambda p: jax.lax.all_to_all(p, axis_name, 0, 0, tiled=True), sent)
  reduced_chunk = jnp.sum(jax.vmap(codec.decode)(received), axis=0)
  # All-gather the re-encoded reduced chunks.
  gathered = jax.tree.map(
      lambda p: jax.lax.all_gather(p, axis_name, axis=0),
      codec.encode(reduced_chunk, reduce_key))
  mean = jax.vmap(codec.decode)(gathered).reshape(-1)[:n]
  # What this island's contribution became, back in its own units; an
  # island with no weight sent nothing.
  sent_flat = jax.vmap(codec.decode)(sent).reshape(-1)[:n]
  sent_flat = jnp.where(share > 0, sent_flat / jnp.where(share > 0, share, 1),
                        0.0)
  cast = lambda values: jax.tree.map(lambda v, x: v.astype(x.dtype),
                                     unravel(values), tree)
  return cast(mean), cast(sent_flat)


def ring_allreduce_bytes(num_elements: int, itemsize: int,
                         num_islands: int) -> int:
  """Bytes one peer sends in a ring all-reduce of one array."""
  if num_islands <= 1:
    return 0
  chunk = math.ceil(num_elements / num_islands)
  return 2 * (num_islands - 1) * chunk * itemsize


def island_mean_bytes(tree, num_islands: int,
                      codec: codecs.DenseCodec | None = None) -> int:
  """Bytes one island sends for `island_mean(tree, weight, codec=codec)`.

  Args:
    tree: a pytree of arrays or of jax.ShapeDtypeStruct with one island's
      shapes (no leading island dimension).
    num_islands: k, the size of the 'island' axis.
    codec: as passed to island_mean.
  """
  # The scalar weight's psum, then the values.
  total = ring_allreduce_bytes(1, 4, num_islands)
  if codec is not None and not codec.is_identity:
    if num_islands <= 1:
      return 0
    n = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))
    chunk = _chunk_length(n, num_islands, codec.block_size)
    # (k-1) encoded chunks out in the all_to_all, (k-1) in the all_gather.
    return total + 2 * (num_islands - 1) * codec.payload_bytes(chunk)
  # Values are reduced in float32 (see island_mean).
  for leaf in jax.tree.leaves(tree):
    total += ring_allreduce_bytes(int(np.prod(leaf.shape)), 4, num_islands)
  return total
