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

Blockwise codecs store one float32 scale per `block_size` values. Rounding is
to nearest, or stochastic (unbiased) when a PRNG key is given.
"""

import dataclasses

import jax
import jax.numpy as jnp

DENSE_CODECS = ("fp32", "bf16", "fp16", "int8", "int4")

# fp16's largest finite value is 65504; mapping a block's absmax to 2^14
# leaves headroom for the sum of a few islands' payloads after decoding.
_FP16_TARGET = 2.0 ** 14
_LEVELS = {"int8": 127, "int4": 7}


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
    else:
      step = jnp.broadcast_to(absmax / _LEVELS[self.name] / 2, blocks.shape)
    return step.reshape(-1)


def _pack_nibbles(q: jax.Array) -> jax.Array:
  """int8 values in [-7, 7] (even length) -> uint8, two per byte."""
  u = (q + 8).astype(jnp.uint8).reshape(-1, 2)
  return u[:, 0] | (u[:, 1] << 4)


def _unpack_nibbles(packed: jax.Array) -> jax.Array:
  low = (packed & 0xF).astype(jnp.int8) - 8
  high = (packed >> 4).astype(jnp.int8) - 8
  return jnp.stack([low, high], axis=1).reshape(-1)


def make_codec(name: str, block_size: int = 256) -> DenseCodec:
  """The codec called `name` (see DENSE_CODECS)."""
  if name not in DENSE_CODECS:
    raise ValueError(f"config.diloco.codec={name!r} is not one of {DENSE_CODECS}")
  return DenseCodec(name, block_size)

