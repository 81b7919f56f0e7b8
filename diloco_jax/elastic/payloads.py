"""What an elastic island sends the coordinator, and the mean made of it.

With a dense codec that compresses (bf16, fp16, int8, int4, fp4) the
island encodes its own pseudo-gradient, x - y plus its error-feedback
residual, as one flat vector, and sends the payload: what crosses Ray is
what the codec sends. The coordinator decodes each payload, takes the
weighted mean in float32 and steps x with the outer optimizer. The
residual, what the codec left out, stays on the island that made it.

With fp32, or a codec whose merge is a collective over every island's
values at once (top-k with its shared positions, sign pruning's election,
low rank's shared basis, SparseLoCo), the island sends its params and the
coordinator runs that collective over the islands stacked.

Pure functions over arrays and pytrees; the island and the coordinator
call them.
"""

import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.codecs import dense


def encoded_on_island(outer) -> bool:
  """Whether islands encode their pseudo-gradients themselves under the
  outer object `outer`: with a dense codec that compresses, unless each
  island keeps a point of its own (the delay with rebase, eager updates),
  whose rebase or own step at the coordinator needs its params."""
  compression = compression_lib.as_compression(outer.codec)
  return (compression.is_dense and not compression.is_identity
          and not outer.keeps_island_points)


def flatten(tree) -> jax.Array:
  """A params-shaped tree as one float32 vector (leaves in tree order)."""
  return ravel_pytree(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32),
                                   tree))[0]


def unflatten(values: jax.Array, like):
  """`values` [n] as a tree shaped like `like` (float32 leaves)."""
  _, unravel = ravel_pytree(jax.tree.map(
      lambda a: jnp.zeros(a.shape, jnp.float32), like))
  return unravel(values)


def encode(values: jax.Array, codec: dense.DenseCodec,
           key: jax.Array | None = None) -> dict:
  """The payload of a float32 vector [n]: zero-padded to whole blocks of
  the codec, then encoded (`key`: stochastic rounding, or None)."""
  padded = jnp.pad(values, (0, -values.size % codec.block_size))
  return codec.encode(padded, key)


def decode(payload: dict, codec: dense.DenseCodec, size: int) -> jax.Array:
  """The float32 vector [size] a payload carries."""
  return codec.decode(payload)[:size]


def island_payload(x, y, residual, codec: dense.DenseCodec,
                   feedback_decay: float = 1.0, key=None):
  """One island's send (traceable): (payload, residual after it).

  The pseudo-gradient x - y (flat), plus `residual` times the decay when
  the run keeps error feedback (`residual` None: it does not), through the
  codec; the new residual is what the codec left out of it.
  """
  values = flatten(x) - flatten(y)
  if residual is not None:
    values = values + feedback_decay * residual
  payload = encode(values, codec, key)
  if residual is None:
    return payload, None
  return payload, values - decode(payload, codec, values.size)


def weighted_mean(decoded: jax.Array, weights: jax.Array):
  """The weighted mean over the islands' decoded pseudo-gradients [k, n]
  (traceable): (mean [n], included [k], anyone). An island with weight 0
  or a non-finite value takes no part (zeroed before any arithmetic: NaN
  x 0 is NaN)."""
  finite = jnp.all(jnp.isfinite(decoded), axis=1)
  included = (weights > 0) & finite
  weights = jnp.where(included, weights, 0.0)
  decoded = jnp.where(included[:, None], decoded, 0.0)
  total = jnp.sum(weights)
  anyone = total > 0
  mean = jnp.sum(weights[:, None] * decoded, axis=0) / jnp.where(
      anyone, total, 1.0)
  return mean, included, anyone


def nbytes(tree) -> int:
  """Bytes of a tree of arrays (what a result's arrays take through
  Ray)."""
  return sum(int(leaf.size) * leaf.dtype.itemsize
             for leaf in jax.tree.leaves(tree))
