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


def largest_mask(x: jax.Array, keep: int) -> jax.Array:
  """Boolean mask of the `keep` largest |x| of a vector (ties: lowest
  positions first).

  A small `keep` (top-k's 1%) comes from `lax.top_k`. A large one (pruning
  half of each neuron) is found without sorting, where `lax.top_k` is slow
  on CPU: the keep-th largest magnitude is bisected over the bit patterns of
  |x| (as uint32 they order like the floats), 32 counting passes.
  """
  length = x.shape[0]
  if keep * _TOP_K_MAX_SHARE <= length:
    _, positions = jax.lax.top_k(jnp.abs(x), keep)  # ties: lowest first
    return jnp.zeros(length, bool).at[positions].set(True)
  bits = jax.lax.bitcast_convert_type(jnp.abs(x).astype(jnp.float32),
                                      jnp.uint32)

  def narrow(_, bounds):
    # Invariant: at least `keep` values are >= lo; the threshold is <= hi.
    lo, hi = bounds
    mid = lo + (hi - lo + 1) // 2
    enough = jnp.sum(bits >= mid) >= keep
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

  threshold, _ = jax.lax.fori_loop(
      0, 32, narrow, (jnp.uint32(0), jnp.uint32(_INF_BITS)))
  above = bits > threshold
  ties = bits == threshold
  room = keep - jnp.sum(above)
  return above | (ties & (jnp.cumsum(ties) <= room))


_INF_BITS = 0x7F800000  # +inf's bit pattern: no |x| but NaN is larger
# lax.top_k beats bisection up to keep = length / 64 (2 CPU cores: 4x faster
# at 1%, 2.4x slower at 50%).
_TOP_K_MAX_SHARE = 64


def _index_dtype(length: int):
  return jnp.uint16 if length <= np.iinfo(np.uint16).max + 1 else jnp.int32


def uses_bitmask(length: int, keep: int) -> bool:
  """Whether a bitmask is smaller than an index list for (length, keep)."""
  index_bytes = keep * jnp.dtype(_index_dtype(length)).itemsize
  return _bitmask_bytes(length) < index_bytes


def _bitmask_bytes(length: int) -> int:
  return -(-length // 8)


def _pack_bits(mask: jax.Array) -> jax.Array:
  padded = jnp.pad(mask, (0, _bitmask_bytes(mask.shape[0]) * 8 - mask.shape[0]))
  weights = (1 << jnp.arange(8, dtype=jnp.uint8)).astype(jnp.uint8)
  return jnp.sum(padded.reshape(-1, 8).astype(jnp.uint8) * weights, axis=1,
                 dtype=jnp.uint8)


def _unpack_bits(encoded: jax.Array) -> jax.Array:
  bits = (encoded[:, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
  return bits.reshape(-1)


def encode(x: jax.Array, keep: int) -> dict:
  """The `keep` largest |x| of a vector x [length] as a sparse payload:
  their values in position order, and their positions as indices or a
  bitmask (see uses_bitmask)."""
  length = x.shape[0]
  mask = largest_mask(x, keep)
  # The j-th kept value goes to slot j; the others are dropped.
  slot = jnp.where(mask, jnp.cumsum(mask) - 1, keep)
  compact = lambda v: jnp.zeros(keep, v.dtype).at[slot].set(v, mode="drop")
  if uses_bitmask(length, keep):
    positions = _pack_bits(mask)
  else:
    positions = compact(jnp.arange(length, dtype=jnp.int32)).astype(
        _index_dtype(length))
  return {"values": compact(x), "positions": positions}


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
