"""SparseLoCo's collective: each island's chunked top-k payload gathered by
every island and summed there.

Each leaf is cut into equal chunks of at most `chunk_size` values (a leaf
smaller than that is one chunk of its own size; padding with zeros makes
up the last chunk, by less than one value per chunk);
chunks of one length from every leaf form one array of rows, so a model
compiles a handful of top-k's whatever its depth. Each island encodes its
rows (codecs/sparse_chunks.py) and the payloads are all-gathered with the
islands' weight shares: islands pick different positions, so the sum is
formed where it is used rather than reduced on the way (the mean is denser
than any one payload, up to k x density). Each island sends (k - 1)
payloads (a ring all-gather).
"""

import math

import jax
import jax.numpy as jnp

from diloco_jax.codecs import sparse
from diloco_jax.codecs import sparse_chunks
from diloco_jax.parallel import communication
from diloco_jax.parallel.mesh import ISLANDS


def _chunk_length(size: int, chunk_size: int) -> int:
  """The chunks of a leaf of `size` values: as few as hold at most
  `chunk_size` values each, of equal length (the last padded by less than
  one value per chunk), so no chunk is mostly padding."""
  chunks = max(1, -(-size // chunk_size))
  return max(1, -(-size // chunks))


def _groups(shapes, chunk_size: int) -> dict[int, list[int]]:
  """Leaf indices by their chunk length, in leaf order."""
  groups = {}
  for i, shape in enumerate(shapes):
    groups.setdefault(_chunk_length(math.prod(shape), chunk_size),
                      []).append(i)
  return groups


def _rows(leaf: jax.Array, chunk: int) -> jax.Array:
  flat = leaf.astype(jnp.float32).reshape(-1)
  pad = -flat.shape[0] % chunk
  return jnp.pad(flat, (0, pad)).reshape(-1, chunk)


def island_mean(tree, weight, compression, key: jax.Array | None = None,
                axes=ISLANDS):
  """The weighted mean of the islands' `tree`s, each sent as its chunks'
  top-k in compression.value_bits bits (per island, inside
  placement.island_map; `compression` a Compression named 'sparseloco').

  Returns (mean, sent, None): the mean, the same on every island, and what
  this island's tree became after encoding (its error feedback keeps the
  rest); SparseLoCo's codec keeps no state.
  """
  leaves, treedef = jax.tree.flatten(tree)
  share = communication.weight_share(weight, axes)
  means, sents = list(leaves), list(leaves)
  groups = _groups([x.shape for x in leaves], compression.chunk_size)
  shares = communication.gather(share, axes)  # [k]
  for g, (chunk, indices) in enumerate(groups.items()):
    rows = [_rows(leaves[i], chunk) for i in indices]
    keep = sparse.keep_count(chunk, compression.density)
    group_key = None if key is None else jax.random.fold_in(key, g)
    payload = sparse_chunks.encode(jnp.concatenate(rows), keep,
                                   compression.value_bits, group_key)
    decode = lambda p: sparse_chunks.decode(p, chunk, keep,
                                            compression.value_bits)
    sent = decode(payload)
    total = jnp.einsum("k,krc->rc", shares, jax.vmap(decode)(
        communication.gather(payload, axes)))
    start = 0
    for i, leaf_rows in zip(indices, rows):
      stop = start + leaf_rows.shape[0]
      size, shape = leaves[i].size, leaves[i].shape
      means[i] = total[start:stop].reshape(-1)[:size].reshape(shape)
      sents[i] = sent[start:stop].reshape(-1)[:size].reshape(shape)
      start = stop
  cast = lambda values: jax.tree.unflatten(
      treedef, [v.astype(x.dtype) for v, x in zip(values, leaves)])
  return cast(means), cast(sents), None


def mean_bytes(tree, num_islands: int, compression) -> int:
  """Bytes one island sends for `island_mean`: the weight share's
  all-reduce, and (k - 1) copies of its share and of its payload."""
  if num_islands <= 1:
    return 0
  shapes = [leaf.shape for leaf in jax.tree.leaves(tree)]
  payload = 0
  for chunk, indices in _groups(shapes, compression.chunk_size).items():
    rows = sum(-(-math.prod(shapes[i]) // chunk) for i in indices)
    payload += sparse_chunks.payload_bytes(
        rows, chunk, sparse.keep_count(chunk, compression.density),
        compression.value_bits)
  return (communication.weight_share_bytes(num_islands)
          + communication.gather_bytes(4, num_islands)  # the shares
          + communication.gather_bytes(payload, num_islands))
