"""Chunked top-k in a few bits: SparseLoCo's payload.

A vector is viewed as rows of `chunk` values (the caller pads the last);
each row keeps its `keep` largest magnitudes, sent as:

  values     `bits` bits each: a sign bit and (bits - 1) bits of magnitude
             on a uniform grid from the row's smallest kept magnitude to
             its largest, rounded to the nearest level (or stochastically,
             unbiased, given a key);
  range      those two magnitudes, float32 (8 bytes a row);
  positions  where the kept values sit in the row, bit-packed at
             ceil(log2(chunk)) bits each, or a bitmask of the row
             (chunk bits) where that is smaller.

So a kept value costs bits + log2(chunk) bits: at 2 bits and chunks of
4096, 14 bits, plus 64 bits a row. Shapes are static: `payload_bytes` is
exact, and everything compiles into the outer step.
"""

import math

import jax
import jax.numpy as jnp


def position_bits(chunk: int) -> int:
  """Bits of one position in a row of `chunk` values."""
  return max(1, math.ceil(math.log2(chunk)))


def uses_bitmask(chunk: int, keep: int) -> bool:
  """Whether a bitmask of the row is smaller than its packed positions."""
  return chunk < keep * position_bits(chunk)


def _packed_bytes(count: int, width: int) -> int:
  return -(-count * width // 8)


def payload_bytes(rows: int, chunk: int, keep: int, bits: int) -> int:
  """Bytes of `rows` rows' payloads (what `encode` returns, exactly)."""
  positions = (_packed_bytes(chunk, 1) if uses_bitmask(chunk, keep)
               else _packed_bytes(keep, position_bits(chunk)))
  return rows * (8 + _packed_bytes(keep, bits) + positions)


def pack_bits(codes: jax.Array, width: int) -> jax.Array:
  """Unsigned codes [..., n] below 2**width -> uint8 [..., ceil(n w / 8)],
  least significant bit first."""
  *lead, n = codes.shape
  bits = (codes.astype(jnp.uint32)[..., None]
          >> jnp.arange(width, dtype=jnp.uint32)) & 1
  bits = bits.reshape(*lead, n * width)
  pad = _packed_bytes(n, width) * 8 - n * width
  bits = jnp.pad(bits, [(0, 0)] * len(lead) + [(0, pad)])
  bits = bits.reshape(*lead, -1, 8).astype(jnp.uint8)
  return jnp.sum(bits << jnp.arange(8, dtype=jnp.uint8), axis=-1,
                 dtype=jnp.uint8)


def unpack_bits(packed: jax.Array, n: int, width: int) -> jax.Array:
  """The inverse of pack_bits: uint8 [..., bytes] -> uint32 codes [..., n]."""
  *lead, _ = packed.shape
  bits = (packed[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
  bits = bits.reshape(*lead, -1)[..., :n * width].astype(jnp.uint32)
  bits = bits.reshape(*lead, n, width)
  return jnp.sum(bits << jnp.arange(width, dtype=jnp.uint32), axis=-1,
                 dtype=jnp.uint32)


def _levels(bits: int) -> int:
  return 2 ** (bits - 1)  # magnitude levels; the other bit is the sign


def encode(rows: jax.Array, keep: int, bits: int,
           key: jax.Array | None = None) -> dict:
  """Rows [n, chunk] -> their payload: each row's `keep` largest
  magnitudes in `bits` bits (2 <= bits <= 8) and their positions."""
  n, chunk = rows.shape
  magnitudes, positions = jax.lax.top_k(jnp.abs(rows), keep)
  # Increasing positions, so a bitmask and an index list decode alike.
  order = jnp.argsort(positions, axis=-1)
  positions = jnp.take_along_axis(positions, order, axis=-1)
  magnitudes = jnp.take_along_axis(magnitudes, order, axis=-1)
  signs = jnp.take_along_axis(rows, positions, axis=-1) < 0
  low = jnp.min(magnitudes, axis=-1, keepdims=True)
  high = jnp.max(magnitudes, axis=-1, keepdims=True)
  steps = _levels(bits) - 1
  spacing = jnp.where(high > low, (high - low) / max(steps, 1), 1.0)
  scaled = (magnitudes - low) / spacing  # in [0, steps]
  if key is None:
    level = jnp.round(scaled)
  else:  # unbiased: up with probability of the fractional part
    level = jnp.floor(scaled + jax.random.uniform(key, scaled.shape))
  level = jnp.clip(level, 0, steps).astype(jnp.uint32)
  codes = level | (signs.astype(jnp.uint32) << (bits - 1))
  if uses_bitmask(chunk, keep):
    mask = jnp.zeros((n, chunk), jnp.uint32).at[
        jnp.arange(n)[:, None], positions].set(1)
    packed_positions = pack_bits(mask, 1)
  else:
    packed_positions = pack_bits(positions, position_bits(chunk))
  return {"range": jnp.concatenate([low, high], axis=-1),
          "values": pack_bits(codes, bits),
          "positions": packed_positions}


def decode(payload: dict, chunk: int, keep: int, bits: int) -> jax.Array:
  """A payload back to dense float32 rows [n, chunk]."""
  codes = unpack_bits(payload["values"], keep, bits)
  low, high = payload["range"][:, :1], payload["range"][:, 1:]
  steps = _levels(bits) - 1
  spacing = jnp.where(high > low, (high - low) / max(steps, 1), 1.0)
  level = (codes & (_levels(bits) - 1)).astype(jnp.float32)
  magnitude = low + level * spacing
  values = jnp.where((codes >> (bits - 1)) & 1, -magnitude, magnitude)
  n = values.shape[0]
  if not uses_bitmask(chunk, keep):
    positions = unpack_bits(payload["positions"], keep,
                            position_bits(chunk)).astype(jnp.int32)
    return jnp.zeros((n, chunk), jnp.float32).at[
        jnp.arange(n)[:, None], positions].set(values)
  # The j-th set bit of a row holds its j-th value.
  mask = unpack_bits(payload["positions"], chunk, 1).astype(bool)
  slot = jnp.clip(jnp.cumsum(mask, axis=-1) - 1, 0, keep - 1)
  return jnp.where(mask, jnp.take_along_axis(values, slot, axis=-1), 0.0)
