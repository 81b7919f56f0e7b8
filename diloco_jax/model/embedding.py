"""The token-embedding look-up, with a gradient whose cost does not depend on
which tokens repeat.

The plain look-up (`jnp.take` of the table cast to the compute dtype, as
`nnx.Embed` does) differentiates into a scatter-add of every position's
gradient row into a [vocab, d_model] table in the compute dtype. Text
repeats tokens: byte-level source code is about a quarter spaces, and C4's
"the", "," and "." recur thousands of times in a batch, so thousands of
updates land on one row. On NVIDIA GPUs XLA's scatter resolves colliding
updates with atomics, and a bf16 atomic add (and, under jaxlib 0.10.2 to
0.11.0, an f32 one too) is a compare-and-swap loop that retries under
contention: the same step costs about twice as much on real text as on
random tokens. Accumulating in bf16 also loses the small updates once a
row's running sum is large.

`take_rows` gives the same forward values (the gather commutes with the
cast) and computes the table's gradient as a float32 sum over the positions
sorted by token id: XLA then knows the indices are sorted and, on GPU, adds
each run of equal ids in registers before one atomic per run and warp,
instead of one atomic per position. The sort is of the B x L token ids
alone (a few microseconds), the extra gather of the gradient rows a memory
pass over [B x L, d_model]. The result is exact in float32 up to the order
of summation, whatever the token distribution.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np


def take_rows(table: jax.Array, ids: jax.Array, dtype) -> jax.Array:
  """Rows `table[ids]` cast to `dtype`: [*ids.shape, table.shape[1]].

  Forward: gathers from `table` in its own dtype, then casts, which equals
  casting the table first. Backward: the table's gradient summed in
  float32 over positions sorted by id (see the module docstring), returned
  in the table's dtype. Ids index as in `jnp.take`: those in [-vocab, 0)
  count from the end, others outside the table give NaN rows and no
  gradient.
  """
  return _take_rows(table, ids, np.dtype(dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _take_rows(table, ids, dtype):
  return jnp.take(table, ids, axis=0).astype(dtype)


def _take_rows_forward(table, ids, dtype):
  # The table is a residual only for its shape and dtype: it is the param
  # itself, alive for the optimizer anyway, so keeping it costs no memory.
  return _take_rows(table, ids, dtype), (table, ids)


def _take_rows_backward(dtype, residuals, row_gradients):
  del dtype
  table, ids = residuals
  return sorted_row_sum(row_gradients, ids, table.shape[0]).astype(
      table.dtype), None


_take_rows.defvjp(_take_rows_forward, _take_rows_backward)


def sorted_row_sum(rows: jax.Array, ids: jax.Array,
                   num_rows: int) -> jax.Array:
  """float32 [num_rows, D]: out[v] = sum of rows[p] over positions p with
  ids[p] == v, the positions sorted by id first.

  `rows` is [*ids.shape, D] in any float dtype; ids in [-num_rows, 0)
  count from the end, others outside the table are dropped.
  """
  flat_ids = ids.reshape(-1)
  # Ids in [-num_rows, 0) count from the end, as jnp.take reads them; any
  # other id outside the table goes last and is dropped. Done before the
  # sort, so the ids the scatter sees are the sorted ones it is told of.
  flat_ids = jnp.where(flat_ids < 0, flat_ids + num_rows, flat_ids)
  flat_ids = jnp.where((flat_ids < 0) | (flat_ids >= num_rows), num_rows,
                       flat_ids)
  flat_rows = rows.reshape(flat_ids.shape[0], rows.shape[-1])
  positions = jnp.arange(flat_ids.shape[0], dtype=jnp.int32)
  # One key-value sort gives the sorted ids and the order to read rows in.
  sorted_ids, order = jax.lax.sort((flat_ids, positions), num_keys=1)
  sorted_rows = jnp.take(flat_rows, order, axis=0).astype(jnp.float32)
  zeros = jnp.zeros((num_rows, rows.shape[-1]), jnp.float32)
  return zeros.at[sorted_ids].add(sorted_rows, indices_are_sorted=True,
                                  mode="drop")
