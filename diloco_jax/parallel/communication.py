"""The one communication boundary: every cross-island collective goes here.

Everything here runs per logical island (inside `placement.island_map`) and
is the only code that crosses the slow link; each collective has a
companion that says how many bytes one island sends for it. Bytes are
counted per logical island, as if each were its own host, whether islands
sit on separate devices or are folded onto one. Codecs (compression.py) are
built from these primitives; the active-island mask and the choice of
communication devices plug in here and nowhere else.

Uncompressed (fp32) sums are a psum, counted as a ring all-reduce: each of
k peers sends 2(k-1) chunks of ceil(n/k) elements per array. A compressed
dense sum runs the two phases of that ring with encoded chunks: an
all_to_all of encoded chunks (reduce-scatter), decode and sum in
float32, re-encode the reduced chunk, all_gather. Each island then sends
2(k-1) encoded chunks of n/k values: the codec's full ratio at any k, where
an all-gather of whole payloads would send (k-1) payloads. Sparse codecs use
the same two phases (`chunked_reduce`) with their own chunk codec and
reduction. One island sends nothing when k = 1.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax.codecs import dense as codecs
from diloco_jax.parallel.mesh import ISLANDS
from diloco_jax.parallel import placement

# The island axes: a mesh axis name, or (device axis, folded vmap axis) for
# islands folded onto devices (mesh.ISLANDS, the default). Island i of a
# nested pair (D, a) is D * (folded size) + a. Levels of size 1 are skipped,
# so a one-device run holds no cross-device collective.
Axes = str | tuple[str, ...]


def _levels(axes: Axes) -> list[tuple[str, int]]:
  """(name, size) of each island axis, outermost first."""
  names = (axes,) if isinstance(axes, str) else tuple(axes)
  return [(name, jax.lax.axis_size(name)) for name in names]


def island_count(axes: Axes = ISLANDS) -> int:
  """k, the number of logical islands (a Python int)."""
  return math.prod(size for _, size in _levels(axes))


def island_index(axes: Axes = ISLANDS) -> jax.Array:
  """This island's index in 0..k-1."""
  index = jnp.zeros((), jnp.int32)
  for name, size in _levels(axes):
    index = index * size + (jax.lax.axis_index(name) if size > 1 else 0)
  return index


def island_psum(tree, axes: Axes = ISLANDS):
  """Sum over every island, the same on every island."""
  names = tuple(name for name, size in _levels(axes) if size > 1)
  return jax.lax.psum(tree, names) if names else tree


def island_all_gather(x: jax.Array, axes: Axes = ISLANDS) -> jax.Array:
  """Every island's `x`, stacked [k, ...] in island order."""
  x = x[None]
  for name, size in reversed(_levels(axes)):  # the folded axis first
    if size > 1:
      x = jax.lax.all_gather(x, name, axis=0, tiled=True)
  return x


def island_all_to_all(x: jax.Array, axes: Axes = ISLANDS) -> jax.Array:
  """Island j gets row j of every island's [k, ...] `x`, stacked by source.

  On nested axes the exchange runs level by level: row (E, b) goes to
  device slot E over the device axis, then to folded island b over the
  folded axis.
  """
  levels = _levels(axes)
  rows = x.reshape(*(size for _, size in levels), *x.shape[1:])
  for position, (name, size) in enumerate(levels):
    if size > 1:
      rows = jax.lax.all_to_all(rows, name, position, position, tiled=True)
  return rows.reshape(x.shape)


def weight_share(weight, axes: Axes = ISLANDS):
  """This island's share w_i / sum_j w_j of the total weight (a psum); 0
  when no island has weight (nothing is averaged, rather than 0 / 0)."""
  total = island_psum(weight, axes)
  return jnp.where(total > 0, weight / jnp.where(total > 0, total, 1), 0.0)


def weight_share_bytes(num_islands: int) -> int:
  """Bytes one island sends for `weight_share`."""
  return ring_allreduce_bytes(1, 4, num_islands)


def chunked_reduce(chunks, encode, decode, reduce=None,
                   keys: jax.Array | None = None, axes: Axes = ISLANDS):
  """The two phases of a ring all-reduce, carrying encoded chunks.

  Island j reduces chunk j: an all_to_all hands it every island's encoded
  chunk j (reduce-scatter), it decodes them, reduces them in float32 and
  re-encodes the result, and an all_gather hands every island every reduced
  chunk. Each island sends 2(k-1) encoded chunks, the codec's ratio at any k.

  Args:
    chunks: [k, ...] this island's contribution, one chunk per island.
    encode: (chunk, key or None) -> payload (a pytree of static-shape arrays).
    decode: payload -> float32 chunk.
    reduce: [k, ...] every island's decoded chunk, in island order ->
      reduced chunk; None sums them.
    keys: None, or k + 1 PRNG keys for the encoder (the sent chunks', then
      the reduced chunk's).
    axes: the island axes.

  Returns:
    (total, sent, unsent), each [k, ...]: the reduced chunks as every island
    decodes them; this island's chunks after encoding; and what re-encoding
    this island's reduced chunk dropped, at its own chunk index (zeros at
    the others).
  """
  send_keys, reduce_key = (None, None) if keys is None else (keys[:-1],
                                                             keys[-1])
  sent = jax.vmap(encode)(chunks, send_keys)
  received = jax.tree.map(lambda p: island_all_to_all(p, axes), sent)
  decoded = jax.vmap(decode)(received)
  reduced = (jnp.sum(decoded, axis=0) if reduce is None
             else reduce(decoded))
  reduced_payload = encode(reduced, reduce_key)
  gathered = gather(reduced_payload, axes)
  total = jax.vmap(decode)(gathered)
  own = island_index(axes)
  unsent = jnp.zeros_like(chunks).at[own].set(
      reduced - decode(reduced_payload))
  return total, jax.vmap(decode)(sent), unsent


def chunked_reduce_bytes(chunk_payload_bytes: int, num_islands: int) -> int:
  """Bytes one island sends in `chunked_reduce`: (k-1) chunks per phase."""
  return 2 * max(num_islands - 1, 0) * chunk_payload_bytes


def dense_sum(values: jax.Array, axes: Axes = ISLANDS,
              codec: codecs.DenseCodec | None = None,
              key: jax.Array | None = None):
  """Sum over islands of a flat float32 vector, through a dense codec.

  Args:
    values: this island's contribution [n] (already weighted).
    axes: the island axes.
    codec: None or fp32 for a plain psum; otherwise `chunked_reduce` with
      the codec on each chunk.
    key: PRNG key for the codec's stochastic rounding (None: nearest).

  Returns:
    (sum, sent): the sum [n], identical on every island, and what this
    island's contribution became after encoding [n].
  """
  if codec is None or codec.is_identity:
    return island_psum(values, axes), values
  num_islands = island_count(axes)
  n = values.size
  codec = _chunk_codec(codec, n, num_islands)
  chunk = _chunk_length(n, num_islands, codec.block_size)
  chunks = jnp.pad(values, (0, chunk * num_islands - n)).reshape(
      num_islands, chunk)
  keys = None
  if key is not None:  # independent rounding noise per chunk and phase
    keys = jax.random.split(key, num_islands + 1)
  total, sent, _ = chunked_reduce(chunks, codec.encode, codec.decode,
                                  keys=keys, axes=axes)
  return total.reshape(-1)[:n], sent.reshape(-1)[:n]


def dense_sum_bytes(num_values: int, num_islands: int,
                    codec: codecs.DenseCodec | None = None) -> int:
  """Bytes one island sends for `dense_sum` of `num_values` values."""
  if num_islands <= 1:
    return 0
  if codec is None or codec.is_identity:
    return ring_allreduce_bytes(num_values, 4, num_islands)
  codec = _chunk_codec(codec, num_values, num_islands)
  chunk = _chunk_length(num_values, num_islands, codec.block_size)
  return chunked_reduce_bytes(codec.payload_bytes(chunk), num_islands)


def gather(payload, axes: Axes = ISLANDS):
  """Every island's payload (a pytree of arrays), stacked [islands, ...]."""
  return jax.tree.map(lambda p: island_all_gather(p, axes), payload)


def gather_bytes(payload_bytes: int, num_islands: int) -> int:
  """Bytes one island sends in a ring all-gather of its payload."""
  return max(num_islands - 1, 0) * payload_bytes


def island_mean(tree, weight, axes: Axes = ISLANDS,
                codec: codecs.DenseCodec | None = None,
                key: jax.Array | None = None, return_sent: bool = False,
                stripes: int = 1):
  """Weighted mean of `tree` over the islands, identical on every island.

  Must be called per island, inside `placement.island_map` (or a
  shard_map/vmap that names `axes`).

  Args:
    tree: this island's pytree of arrays (e.g. its pseudo-gradient).
    weight: this island's scalar weight (tokens it processed; 0 if inactive).
    axes: the island axes.
    codec: how values cross the link; None or fp32 sends them uncompressed.
    key: a PRNG key for the codec's stochastic rounding (None: nearest).
    return_sent: also return what this island's contribution became after
      encoding, in `tree`'s units (for error feedback).
    stripes: the island's 'data' devices when its arrays are split over
      them (FSDP): a compressed sum then runs per device on its own shards
      (placement.stripe), never gathering the tree.

  Returns:
    sum_i w_i * tree_i / sum_i w_i (with each island's contribution passed
    through the codec), in the leaves' own dtypes; with `return_sent`, the
    pair (mean, sent).
  """
  share = weight_share(weight, axes)
  if codec is None or codec.is_identity:
    # Accumulate in float32 whatever the leaves' dtype: summing in low
    # precision loses the small pseudo-gradients of late training. Each
    # leaf is reduced where it lies, shard by shard under FSDP.
    weighted = jax.tree.map(lambda x: x.astype(np.float32) * share, tree)
    summed = island_psum(weighted, axes)
    mean = jax.tree.map(lambda s, x: s.astype(x.dtype), summed, tree)
    return (mean, tree) if return_sent else mean
  matrix, unstripe = placement.stripe(tree, stripes)
  mean, sent = striped_sum(matrix * share, axes, codec, key)
  # What this island's contribution became, back in its own units; an
  # island with no weight sent nothing.
  sent = unscale(sent, share)
  return (unstripe(mean), unstripe(sent)) if return_sent else unstripe(mean)


def striped_sum(matrix: jax.Array, axes: Axes = ISLANDS,
                codec: codecs.DenseCodec | None = None,
                key: jax.Array | None = None):
  """`dense_sum` of each row of `matrix` [stripes, n] (see placement.stripe).

  Returns:
    (sum, sent), both [stripes, n].
  """
  if matrix.shape[0] == 1:
    total, sent = dense_sum(matrix[0], axes, codec, key)
    return total[None], sent[None]
  keys = None if key is None else jax.random.split(key, matrix.shape[0])
  return jax.vmap(lambda row, k: dense_sum(row, axes, codec, k),
                  in_axes=(0, None if keys is None else 0))(matrix, keys)


def island_mean_bytes(tree, num_islands: int,
                      codec: codecs.DenseCodec | None = None,
                      stripes: int = 1) -> int:
  """Bytes one island sends for `island_mean(tree, weight, codec=codec)`.

  Args:
    tree: a pytree of arrays or of jax.ShapeDtypeStruct with one island's
      shapes (no leading island dimension).
    num_islands: k, the number of logical islands.
    codec: as passed to island_mean.
    stripes: as passed to island_mean: with FSDP every device of the island
      sends its own shards' part.
  """
  total = stripes * weight_share_bytes(num_islands)
  shapes = [tuple(leaf.shape) for leaf in jax.tree.leaves(tree)]
  if codec is not None and not codec.is_identity:
    width = placement.stripe_width(shapes, stripes)
    return total + stripes * dense_sum_bytes(width, num_islands, codec)
  # Values are reduced in float32, one all-reduce per leaf and device: a
  # split leaf's shard on each device, a replicated leaf whole on each.
  for shape in shapes:
    size = int(np.prod(shape))
    if stripes > 1 and placement.stripe_axis(shape, stripes) is not None:
      total += stripes * ring_allreduce_bytes(size // stripes, 4, num_islands)
    else:
      total += stripes * ring_allreduce_bytes(size, 4, num_islands)
  return total


def unscale(sent: jax.Array, share) -> jax.Array:
  """Divides what an island sent by its weight share (0 where it has none)."""
  return jnp.where(share > 0, sent / jnp.where(share > 0, share, 1), 0.0)


def _chunk_length(num_values: int, num_islands: int, block_size: int) -> int:
  """Values per island chunk: n/k rounded up to whole codec blocks."""
  return math.ceil(num_values / (num_islands * block_size)) * block_size


def _chunk_codec(codec: codecs.DenseCodec, num_values: int,
                 num_islands: int) -> codecs.DenseCodec:
  """The codec with blocks no longer than one island's chunk.

  Small vectors (low-rank factors) would otherwise be padded to k whole
  blocks; a shorter block keeps the padding under one even-sized block.
  """
  per_island = math.ceil(num_values / num_islands)
  block = min(codec.block_size, per_island + per_island % 2)
  return dataclasses.replace(codec, block_size=max(block, 2))


def ring_allreduce_bytes(num_elements: int, itemsize: int,
                         num_islands: int) -> int:
  """Bytes one peer sends in a ring all-reduce of one array."""
  if num_islands <= 1:
    return 0
  chunk = math.ceil(num_elements / num_islands)
  return 2 * (num_islands - 1) * chunk * itemsize
