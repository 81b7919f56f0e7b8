"""Pytree helpers over the islands' leading axis, shared by the run's
state (state.py) and the outer object (outer.py)."""

import jax
import jax.numpy as jnp

from diloco_jax.algorithm import compression as compression_lib


def stack_islands(tree, n: int):
  """`tree` broadcast to `n` islands: [n, ...] per leaf."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), tree)


def zeros_per_island(params, num_islands: int):
  """float32 zeros shaped [num_islands, ...] like every leaf of `params`."""
  return jax.tree.map(
      lambda x: jnp.zeros((num_islands,) + x.shape, jnp.float32), params)


def islands_average(tree):
  """The float32 mean over the leading islands axis of every floating
  leaf (in its dtype); other leaves (step counts) from island 0."""
  return jax.tree.map(
      lambda v: (jnp.mean(v.astype(jnp.float32), axis=0).astype(v.dtype)
                 if jnp.issubdtype(v.dtype, jnp.floating) else v[0]),
      tree)


def init_codec_state(params, compression, seed: int, layout=None):
  """The codec's initial state for logical `params`: one per stage of
  `layout` (a parallel.stages.StageLayout; stacked [S, ...]), or one for
  the whole tree."""
  compression = compression_lib.as_compression(compression)
  if layout is None:
    return compression_lib.init_codec_state(params, compression, seed)
  return jax.vmap(lambda piece: compression_lib.init_codec_state(
      piece, compression, seed))(layout.split_params(params))
