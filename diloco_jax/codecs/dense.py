"""Dense codecs for pseudo-gradients: how a flat float32 chunk is encoded.

A codec turns a float32 vector into a payload (a dict of arrays, the bytes
that cross the island link) and back. Everything is jnp and shape-static, so
encoding and decoding compile into the outer step and XLA fuses them.

  fp32   no compression (the collective is a plain psum)
  bf16   round to bfloat16 (2x)
  fp16   float16 after dividing each block by a scale that maps its absmax
         to 2^14, so nothing overflows and small blocks keep their precision
         (OpenDiLoCo's lossless FP16 all-reduce needs the scaling)
  int8   blockwise absmax quantization to [-127, 127] (~4x)
  int4   blockwise absmax quantization to [-7, 7], two values per byte (~8x)
  fp4    blockwise 4-bit floats, e2m1 (sign, 2 exponent bits, 1 mantissa
         bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) with each block's
         absmax mapped to 6, two values per byte (~8x), as Streaming DiLoCo
         sends its pseudo-gradients

Blockwise codecs store one float32 scale per `block_size` values. Rounding is
to nearest, or stochastic (unbiased) when a PRNG key is given. int4's grid is
uniform; fp4's steps grow with magnitude (0.5 below 2, 1 up to 4, 2 up to 6,
in units of the scale), so values far below their block's absmax keep more
relative precision and the largest ones less.
"""

import dataclasses
import numbers

import jax
import jax.numpy as jnp

DENSE_CODECS = ("fp32", "bf16", "fp16", "int8", "int4", "fp4")

# fp16's largest finite value is 65504; mapping a block's absmax to 2^14
# leaves headroom for the sum of a few islands' payloads after decoding.
_FP16_TARGET = 2.0 ** 14
_LEVELS = {"int8": 127, "int4": 7}
# The e2m1 magnitudes, indexed by a code's low 3 bits (exponent, mantissa):
# the OCP microscaling FP4 encoding, bit 3 being the sign.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MAX = _E2M1[-1]


@dataclasses.dataclass(frozen=True)
class DenseCodec:
  """Encodes and decodes flat float32 vectors whose length is a multiple of
  `block_size`.

  Attributes:
    name: one of DENSE_CODECS.
    block_size: values per scale for the blockwise codecs.
  """
  name: str
  block_size: int = 256

  def __post_init__(self):
    size = self.block_size
    if isinstance(size, bool) or not isinstance(size, numbers.Integral):
      raise TypeError(f"block_size={size!r} must be a positive int (values "
                      "per scale of the blockwise codecs, e.g. 256)")
    if size < 1 or (size % 2 and self.name in ("int4", "fp4")):
      raise ValueError(
          f"block_size={size} is out of range for codec {self.name!r}: give "
          "a positive int (values per scale, e.g. 256)"
          + (", even: int4 and fp4 pack two values per byte"
             if self.name in ("int4", "fp4") else ""))

  @property
  def is_identity(self) -> bool:
    return self.name == "fp32"

  def encode(self, x: jax.Array, key: jax.Array | None = None) -> dict:
    """Encodes float32 x [n] (n a multiple of block_size) into a payload."""
    if self.name == "fp32":
      return {"values": x}
    if self.name == "bf16":
      return {"values": x.astype(jnp.bfloat16)}
    blocks = x.reshape(-1, self.block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=1, keepdims=True)
    if self.name == "fp16":
      scale = jnp.where(absmax > 0, absmax / _FP16_TARGET, 1.0)
      return {"values": (blocks / scale).astype(jnp.float16).reshape(-1),
              "scales": scale[:, 0]}
    if self.name == "fp4":
      scale = jnp.where(absmax > 0, absmax / _E2M1_MAX, 1.0)
      codes = _e2m1_codes(blocks / scale, key)
      return {"values": _pack_codes(codes.reshape(-1)),
              "scales": scale[:, 0]}
    levels = _LEVELS[self.name]
    scale = jnp.where(absmax > 0, absmax / levels, 1.0)
    scaled = blocks / scale
    if key is None:
      q = jnp.round(scaled)
    else:  # stochastic rounding: unbiased, E[q] = scaled
      q = jnp.floor(scaled + jax.random.uniform(key, scaled.shape))
    q = jnp.clip(q, -levels, levels).astype(jnp.int8).reshape(-1)
    if self.name == "int4":
      q = _pack_nibbles(q)
    return {"values": q, "scales": scale[:, 0]}

  def decode(self, payload: dict) -> jax.Array:
    """Decodes a payload back to float32 [n]."""
    values = payload["values"]
    if self.name in ("fp32", "bf16"):
      return values.astype(jnp.float32)
    if self.name == "int4":
      values = _unpack_nibbles(values)
    if self.name == "fp4":
      values = _e2m1_values(_unpack_codes(values))
    blocks = values.astype(jnp.float32).reshape(-1, self.block_size)
    return (blocks * payload["scales"][:, None]).reshape(-1)

  def payload_bytes(self, n: int) -> int:
    """Bytes of the payload of a vector of n values (n % block_size == 0)."""
    shapes = jax.eval_shape(self.encode,
                            jax.ShapeDtypeStruct((n,), jnp.float32))
    return sum(leaf.size * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(shapes))

  def max_abs_error(self, x: jax.Array) -> jax.Array:
    """The round-to-nearest error bound for each value of x [n]: half a step.

    Used by tests; for bf16/fp16 it is half a unit in the last place.
    """
    if self.name == "fp32":
      return jnp.zeros_like(x)
    if self.name == "bf16":
      return jnp.abs(x) * 2.0 ** -8
    blocks = x.reshape(-1, self.block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=1, keepdims=True)
    if self.name == "fp16":
      step = jnp.abs(blocks) * 2.0 ** -11 + absmax / _FP16_TARGET * 2.0 ** -24
    elif self.name == "fp4":
      scale = jnp.where(absmax > 0, absmax / _E2M1_MAX, 1.0)
      step = _e2m1_spacing(jnp.abs(blocks) / scale) / 2 * scale
    else:
      step = jnp.broadcast_to(absmax / _LEVELS[self.name] / 2, blocks.shape)
    return step.reshape(-1)


def _pack_codes(codes: jax.Array) -> jax.Array:
  """4-bit codes (uint8 in [0, 15], even length) -> uint8, two per byte.

  Value 2i goes in byte i's low nibble, value 2i + 1 in its high nibble.
  """
  u = codes.astype(jnp.uint8).reshape(-1, 2)
  return u[:, 0] | (u[:, 1] << 4)


def _unpack_codes(packed: jax.Array) -> jax.Array:
  """The inverse of _pack_codes: uint8 codes in [0, 15], twice as many."""
  return jnp.stack([packed & 0xF, packed >> 4], axis=1).reshape(-1)


def _pack_nibbles(q: jax.Array) -> jax.Array:
  """int8 values in [-7, 7] (even length) -> uint8, two per byte."""
  return _pack_codes((q + 8).astype(jnp.uint8))


def _unpack_nibbles(packed: jax.Array) -> jax.Array:
  return _unpack_codes(packed).astype(jnp.int8) - 8


def _e2m1_spacing(magnitude: jax.Array) -> jax.Array:
  """The e2m1 grid's spacing around each magnitude (in units of the scale).

  The grid is uniform within [0, 2), [2, 4) and [4, 6], with steps 0.5, 1
  and 2, and each range's upper end (2, 4, 6) is a grid point, so rounding
  within a range never needs the next range's grid.
  """
  return jnp.where(magnitude < 2, 0.5, jnp.where(magnitude < 4, 1.0, 2.0))


def _e2m1_codes(scaled: jax.Array, key: jax.Array | None) -> jax.Array:
  """4-bit e2m1 codes (uint8) of values already divided by their scale.

  Magnitudes are clipped to 6 (the block's absmax can land a float error
  above it). Rounding is to the nearest grid point, ties to the even code
  (mantissa bit 0), as IEEE and the OCP FP4 cast do; with a key, it is
  stochastic between the two neighbouring grid points, unbiased: the upper
  one is taken with probability (a - lower) / (upper - lower).
  """
  magnitude = jnp.minimum(jnp.abs(scaled), _E2M1_MAX)
  step = _e2m1_spacing(magnitude)
  steps = magnitude / step  # exact: step is a power of two
  if key is None:
    # Half to even on `steps` is ties to even on the code: within each
    # range the code is `steps` plus an even offset (below).
    n = jnp.round(steps)
  else:
    # Comparing against the fraction, rather than floor(steps + u), keeps
    # float rounding of the sum from ever skipping past the upper neighbour.
    lower = jnp.floor(steps)
    n = lower + (jax.random.uniform(key, steps.shape) < steps - lower)
  # Code of a grid point: steps + 0 below 2 (codes 0-4), + 2 in [2, 4)
  # (steps 2-4 -> codes 4-6), + 4 in [4, 6] (steps 2-3 -> codes 6-7).
  offset = jnp.where(magnitude < 2, 0, jnp.where(magnitude < 4, 2, 4))
  index = n.astype(jnp.uint8) + offset.astype(jnp.uint8)
  # A negative value rounded to 0 keeps its sign bit (code 8, -0.0): it
  # decodes to a zero all the same.
  return index | jnp.where(scaled < 0, 8, 0).astype(jnp.uint8)


def _e2m1_values(codes: jax.Array) -> jax.Array:
  """float32 values (in units of the scale) of 4-bit e2m1 codes."""
  table = jnp.array(_E2M1 + tuple(-v for v in _E2M1), jnp.float32)
  return table[codes.astype(jnp.int32)]


def make_codec(name: str, block_size: int = 256) -> DenseCodec:
  """The codec called `name` (see DENSE_CODECS)."""
  if name not in DENSE_CODECS:
    raise ValueError(f"config.diloco.codec={name!r} is not one of {DENSE_CODECS}")
  return DenseCodec(name, block_size)

