"""What a checkpoint's arrays must satisfy: finite values and unchanged bits.

`inspect_state` runs on the devices, over the arrays where they are, and
returns a small record per leaf: a 64-bit content digest and whether every
value is finite. A checkpoint is written only when the whole state is
finite, with the digests beside it; on restore the digests are computed
again from what was read, so a flipped bit anywhere in the arrays' data is
noticed even when the files still parse.

The digest is two sums of the values' bits times odd position weights, in
uint32 arithmetic. Integer addition wraps exactly and in any order, so the
digest is the same whatever the sharding or island placement the state has,
and any single flipped bit changes it (an odd weight times 2^b is never 0
mod 2^32).
"""

import jax
import jax.numpy as jnp
import numpy as np

_WEIGHT_A = np.uint32(0x9E3779B1)  # odd constants: golden-ratio and murmur3
_WEIGHT_B = np.uint32(0x85EBCA6B)


def _bits(x: jax.Array) -> jax.Array:
  """The values' bit patterns as uint32, same shape."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
  return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)


def _position(shape) -> jax.Array:
  """Each element's row-major index (mod 2^32), built without a reshape so
  a sharded array is never regathered."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * (
        np.uint32(stride % 2**32))
    stride *= shape[axis]
  return index


def _leaf_record(x: jax.Array):
  bits = _bits(x)
  odd = _position(x.shape) * np.uint32(2) + np.uint32(1)
  digest = jnp.stack([jnp.sum(bits * (odd * _WEIGHT_A), dtype=jnp.uint32),
                      jnp.sum((bits ^ (bits >> 16)) * (odd * _WEIGHT_B),
                              dtype=jnp.uint32)])
  finite = (jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact)
            else jnp.bool_(True))
  return digest, finite


@jax.jit
def _records(leaves: list) -> list:
  return [_leaf_record(x) for x in leaves]


def _summarize(paths, records) -> tuple[dict[str, str], list[str]]:
  digests, nonfinite = {}, []
  for path, (digest, finite) in zip(paths, jax.device_get(records)):
    name = jax.tree_util.keystr(path)
    digests[name] = f"{int(digest[0]):08x}{int(digest[1]):08x}"
    if not finite:
      nonfinite.append(name)
  return digests, nonfinite


def inspect_state(state) -> tuple[dict[str, str], list[str]]:
  """Digests every leaf of `state` and lists the leaves holding NaN or inf.

  Returns:
    ({key path: 16 hex digits}, [key paths of non-finite leaves]); one small
    transfer from the devices.
  """
  paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(state)[0])
  return _summarize(paths, _records(list(leaves)))


def compile_inspector(abstract_state):
  """inspect_state for states shaped like `abstract_state`, compiled now
  (a run compiles it with its steps, off the training loop's clock)."""
  paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(abstract_state)[0])
  compiled = _records.lower(list(leaves)).compile()
  return lambda state: _summarize(paths, compiled(jax.tree.leaves(state)))


def digest_mismatch(saved: dict[str, str], current: dict[str, str]
                    ) -> str | None:
  """Names the first leaf whose digest differs, or None when all match."""
  for name in sorted(saved):
    if current.get(name) != saved[name]:
      return f"{name} does not match its checksum"
  return None
