"""The islands' compressed mean of their pseudo-gradients, in both forms
(stacked islands under a jax.vmap, or one island's inside shard_map with
`axis_name`): the collective every outer step starts from, the library's
and the outer object's (outer.py) alike.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import island_sync as island_sync_lib

# The islands' axis name of the stacked form (a jax.vmap inside).
_STACKED_AXIS = "diloco_islands"


class IslandMean(NamedTuple):
  """What `pseudo_gradient_mean` returns.

  Attributes:
    mean: the weighted mean of the pseudo-gradients through the codec
      (params-shaped, one copy; accumulated in float32).
    residuals: each island's new error-feedback residual (what its codec
      left unsent; [k, ...] or this island's), or None.
    codec_state: the codec's next state (the same for every island).
    included: whether each island took part ([k] or a scalar): weight > 0
      and a finite pseudo-gradient.
    finite: whether each island's pseudo-gradient was finite.
    anyone: whether any island took part (a scalar, the same everywhere).
  """
  mean: object
  residuals: object
  codec_state: object
  included: jax.Array
  finite: jax.Array
  anyone: jax.Array


def island_mean(reference, island_params, *, weights=None, residuals=None,
                codec_state=None, compression=None, axis_name=None,
                key=None, stacked_reference=False) -> IslandMean:
  """The islands' weighted mean of reference - y_i (plus each one's
  error-feedback residual) through the codec, accumulated in float32
  (library_diloco.pseudo_gradient_mean is this with its argument checks;
  the updates check their own arguments first, with their own names)."""
  compression = compression_lib.as_compression(compression)
  if axis_name is not None:
    weight = jnp.asarray(1.0 if weights is None else weights, jnp.float32)
    out = island_sync_lib.sync_island(reference, island_params, residuals,
                                      codec_state, weight, compression, key,
                                      axes=axis_name)
    anyone = jax.lax.psum(out[3].astype(jnp.int32), axis_name) > 0
    return IslandMean(*out, anyone)
  num_islands = jax.tree.leaves(island_params)[0].shape[0]
  weights = (jnp.ones((num_islands,), jnp.float32) if weights is None
             else jnp.asarray(weights, jnp.float32))
  keys = None if key is None else jax.random.split(key, num_islands)
  sync = jax.vmap(
      lambda x, y, e, w, k: island_sync_lib.sync_island(
          x, y, e, codec_state, w, compression, k, axes=_STACKED_AXIS),
      in_axes=(0 if stacked_reference else None, 0,
               None if residuals is None else 0, 0,
               None if keys is None else 0),
      axis_name=_STACKED_AXIS)
  mean, residuals, codec_state, included, finite = sync(
      reference, island_params, residuals, weights, keys)
  first = lambda tree: jax.tree.map(lambda a: a[0], tree)
  return IslandMean(first(mean), residuals, first(codec_state), included,
                    finite, jnp.any(included))
