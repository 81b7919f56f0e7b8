"""Sparse payloads: which values an island keeps, and how their positions
cross the link.

A sparse payload is `keep` float32 values and their positions in a vector of
`length`. Positions are sent either as indices (uint16 when the vector is
short enough, else int32) or as a bitmask of the whole vector, whichever is
smaller for the static (length, keep): a 1% top-k of a large tensor sends
indices, a 50% pruning sends a bitmask. Shapes are static, so everything
compiles into the outer step. `encode`/`decode` are the codec of one chunk
in the compressed reduce-scatter + all-gather (communication.chunked_reduce).
"""

import jax
import jax.numpy as jnp
import numpy as np


def keep_count(length: int, fraction: float) -> int:
  """Values kept out of `length` at `fraction` (at least one)."""
  return max(1, min(length, int(round(length * fraction))))


def select_largest(x: jax.Array, keep: int) -> jax.Array:
  """Positions of the `keep` largest |x| of a vector, in increasing order."""
  _, positions = jax.lax.top_k(jnp.abs(x), keep)
  return jnp.sort(positions)


def _index_dtype(length: int):
  return jnp.uint16 if length <= np.iinfo(np.uint16).max + 1 else jnp.int32


def uses_bitmask(length: int, keep: int) -> bool:
  """Whether a bitmask is smaller than an index list for (length, keep)."""
  index_bytes = keep * jnp.dtype(_index_dtype(length)).itemsize
  return _bitmask_bytes(length) < index_bytes


def _bitmask_bytes(length: int) -> int:
  return -(-length // 8)


def encode_positions(positions: jax.Array, length: int) -> jax.Array:
  """Increasing positions [keep] in [0, length) -> indices or a bitmask."""
  keep = positions.shape[0]
  if not uses_bitmask(length, keep):
    return positions.astype(_index_dtype(length))
  padded = _bitmask_bytes(length) * 8
  mask = jnp.zeros(padded, jnp.uint8).at[positions].set(1)
  weights = (1 << jnp.arange(8, dtype=jnp.uint8)).astype(jnp.uint8)
  return jnp.sum(mask.reshape(-1, 8) * weights, axis=1, dtype=jnp.uint8)


def _unpack_bits(encoded: jax.Array) -> jax.Array:
  bits = (encoded[:, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
  return bits.reshape(-1)


def encode(x: jax.Array, keep: int) -> dict:
  """The `keep` largest |x| of a vector x [length] as a sparse payload."""
  positions = select_largest(x, keep)
  return {"values": x[positions],
          "positions": encode_positions(positions, x.shape[0])}


def decode(payload: dict, length: int) -> jax.Array:
  """A sparse payload back to a dense float32 vector [length]."""
  values = payload["values"].astype(jnp.float32)
  keep = values.shape[0]
  if not uses_bitmask(length, keep):
    positions = payload["positions"].astype(jnp.int32)
    return jnp.zeros(length, jnp.float32).at[positions].set(values)
  # The j-th set bit holds the j-th value: a gather by running count, which
  # is far cheaper than finding the set positions (a sort-like nonzero).
  mask = _unpack_bits(payload["positions"])[:length].astype(bool)
  slot = jnp.clip(jnp.cumsum(mask) - 1, 0, keep - 1)
  return jnp.where(mask, values[slot], 0.0)


def payload_bytes(length: int, keep: int) -> int:
  """Bytes of `keep` float32 values and their encoded positions."""
  if uses_bitmask(length, keep):
    positions = _bitmask_bytes(length)
  else:
    positions = keep * jnp.dtype(_index_dtype(length)).itemsize
  return keep * 4 + positions
