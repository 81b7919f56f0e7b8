"""Codecs that work on each matrix of a pseudo-gradient: sign pruning,
top-k and low rank (compression.py sends everything else dense).

A matrix is a leaf of rank >= 2, viewed as [rows, cols] by
lowrank.matrix_view:

  sign_prune        per neuron (column), keep the (1 - prune_rate) largest
                    magnitudes; merge as TIES-merging does: elect each
                    coordinate's sign by weighted mass, average the
                    islands that agree with it.
  topk              per island chunk of each matrix (n/k values), keep the
                    topk_fraction largest magnitudes; merge by weighted sum.
  lowrank           one warm-started power-iteration step at a fixed rank
                    (PowerSGD); float32 factors, all-reduced.
  adaptive_lowrank  the same, with each matrix's rank chosen every round
                    from [min_rank, max_rank] to keep energy_fraction of
                    the energy, and factors sent through `factor_codec`
                    (any dense codec, e.g. int4 or fp4) in a compressed
                    all-reduce.

The sparse codecs (sign_prune, topk) carry values + positions through the
compressed reduce-scatter + all-gather (communication.chunked_reduce): the
island that merges a chunk cuts the merge back to the codec's sparsity
before the all-gather, so each island sends 2(k-1)/k of a payload at any k.
What that cut drops is charged to the merging island, whose error feedback
(if on) sends it next round. `matrix_bytes` counts what each collective
sends. `compression` arguments here are compression.Compression settings.
"""

import math

import jax
import jax.numpy as jnp

from diloco_jax.codecs import lowrank
from diloco_jax.codecs import sparse
from diloco_jax.parallel import communication


def matrices_mean(leaves, indices, share, compression, codec_state,
                  leaf_keys, axes, means: list, sents: list):
  """The structured codec on each matrix `indices` of `leaves` (this
  island's, weighted by its `share`); writes each one's mean and what was
  sent into `means` and `sents`, and returns the new codec state.

  Matrices of one shape share one compiled body, run in a loop
  (`lax.map`): compile time grows with the number of distinct shapes, not
  with depth.
  """
  if compression.name == "sign_prune" and indices:
    island_shares = communication.gather(share, axes)  # [k]

  def one_matrix(m, leaf_state, leaf_key):
    if compression.is_lowrank:
      return _lowrank_mean(m, share, leaf_state, compression, leaf_key,
                           axes)
    if compression.name == "topk":
      return (*_topk_mean(m, share, compression, axes), None)
    return (*_sign_prune_mean(m, share, island_shares, compression,
                              axes), None)

  new_state = list(codec_state) if compression.is_lowrank else None
  stack = lambda items: jax.tree.map(lambda *xs: jnp.stack(xs), *items)
  for group in _groups_by_shape(indices, leaves):
    ms = stack([leaves[i].astype(jnp.float32).reshape(
        lowrank.matrix_view(leaves[i].shape)) for i in group])
    states = (stack([codec_state[indices.index(i)] for i in group])
              if compression.is_lowrank else None)
    keys = None if leaf_keys[0] is None else stack(
        [leaf_keys[i] for i in group])
    if len(group) == 1:
      first = lambda tree: jax.tree.map(lambda x: x[0], tree)
      outputs = jax.tree.map(lambda x: x[None],
                             one_matrix(first(ms), first(states), first(keys)))
    else:
      outputs = jax.lax.map(lambda xs: one_matrix(*xs), (ms, states, keys))
    group_means, group_sents, group_states = outputs
    for g, i in enumerate(group):
      means[i] = group_means[g].reshape(leaves[i].shape)
      sents[i] = group_sents[g].reshape(leaves[i].shape)
      if compression.is_lowrank:
        new_state[indices.index(i)] = jax.tree.map(lambda x, g=g: x[g],
                                                   group_states)
  return tuple(new_state) if compression.is_lowrank else codec_state


def _groups_by_shape(indices, leaves) -> list[list[int]]:
  """`indices` grouped by their leaves' matrix views, in first-seen order."""
  groups = {}
  for i in indices:
    groups.setdefault(lowrank.matrix_view(leaves[i].shape), []).append(i)
  return list(groups.values())


def _topk_mean(m, share, compression, axes):
  # Top-k per island chunk (n/k values), so the reduce-scatter + all-gather
  # carries sparse chunks both ways; the reduced chunk is cut back to the
  # same count before the all-gather.
  num_islands = communication.island_count(axes)
  chunks, chunk = _flat_chunks(m * share, num_islands)
  keep = sparse.keep_count(chunk, compression.topk_fraction)
  total, sent, unsent = communication.chunked_reduce(
      chunks, lambda x, _: sparse.encode(x, keep),
      lambda p: sparse.decode(p, chunk), axes=axes)
  unchunk = lambda x: x.reshape(-1)[:m.size].reshape(m.shape)
  return unchunk(total), _attributed(unchunk(sent), unchunk(unsent), share)


def _sign_prune_mean(m, share, island_shares, compression,
                     axes):
  # A neuron is a column (output feature); prune among its incoming values.
  # Island j merges neurons j*c .. (j+1)*c - 1 and prunes the merged neurons
  # again at the same rate for the all-gather.
  num_islands = communication.island_count(axes)
  rows, cols = m.shape
  per_island = math.ceil(cols / num_islands)
  neurons = jnp.pad((m * share).T, ((0, per_island * num_islands - cols),
                                    (0, 0)))
  keep = sparse.keep_count(rows, 1.0 - compression.prune_rate)
  encode = lambda x, _: jax.vmap(sparse.encode, (0, None))(x, keep)
  decode = lambda p: jax.vmap(sparse.decode, (0, None))(p, rows)
  total, sent, unsent = communication.chunked_reduce(
      neurons.reshape(num_islands, per_island, rows), encode, decode,
      lambda received: _ties_merge(received, island_shares),
      axes=axes)
  unchunk = lambda x: x.reshape(-1, rows)[:cols].T
  return unchunk(total), _attributed(unchunk(sent), unchunk(unsent), share)


def _ties_merge(weighted, island_shares):
  """TIES-merging's disjoint mean of [k, ...] share-weighted island values.

  Each coordinate's sign is elected by weighted mass; the result is the
  weighted mean of the islands whose (nonzero) value agrees with it.
  """
  elected = jnp.sign(jnp.sum(weighted, axis=0))
  agrees = (jnp.sign(weighted) == elected) & (weighted != 0)
  weights = island_shares.reshape((-1,) + (1,) * (weighted.ndim - 1))
  mass = jnp.sum(jnp.where(agrees, weighted, 0.0), axis=0)
  weight = jnp.sum(jnp.where(agrees, weights, 0.0), axis=0)
  return jnp.where(weight > 0, mass / jnp.where(weight > 0, weight, 1.0), 0.0)


def _flat_chunks(x, num_islands: int):
  """x flattened and zero-padded to [num_islands, chunk]; and chunk."""
  chunk = math.ceil(x.size / num_islands)
  flat = jnp.pad(x.reshape(-1), (0, chunk * num_islands - x.size))
  return flat.reshape(num_islands, chunk), chunk


def _attributed(sent, unsent, share):
  """What an island's contribution counts as, in its own units.

  Its own encoded values, less what re-encoding the chunk it reduced
  dropped: with error feedback the island keeps that mass and sends it
  next round. Under a summing merge (top-k) the islands' attributed
  contributions add up to the mean exactly. An island with no weight sent
  nothing.
  """
  return communication.unscale(sent - unsent, share)


def _lowrank_mean(m, share, leaf_state, compression, key,
                  axes):
  ranks = compression.ranks
  adaptive = compression.name == "adaptive_lowrank"
  factor_codec = compression.factor_codec if adaptive else None
  keys = (None, None) if key is None else jax.random.split(key)

  def at_rank(index):
    r = ranks[index]

    # Factors cross the link component-major ([r, n] flattened): each
    # quantization block then holds one component, whose scale is its own
    # rather than the strongest component's (their magnitudes follow the
    # singular values, so a row-major block would zero the weak ones).
    def factor_sum(factor, key):
      total, sent = communication.dense_sum(factor.T.reshape(-1), axes,
                                            factor_codec, key)
      return (total.reshape(factor.shape[::-1]).T,
              sent.reshape(factor.shape[::-1]).T)

    def run(m, share, basis):
      p, _ = factor_sum((m * share) @ basis[:, :r], keys[0])
      p_hat = lowrank.orthonormalize(p)
      coefficients = m.T @ p_hat  # [cols, r]
      c, c_sent = factor_sum(coefficients * share, keys[1])
      c_sent = communication.unscale(c_sent, share)
      next_index = jnp.array(index, jnp.int32)
      if adaptive:
        energy, _ = communication.dense_sum(
            share * jnp.concatenate([jnp.sum(coefficients ** 2, axis=0),
                                     jnp.sum(m ** 2)[None]]), axes)
        next_index = lowrank.choose_rank_index(
            energy[:r], energy[r], ranks, index, compression.energy_fraction)
      return (p_hat @ c.T, p_hat @ c_sent.T, lowrank.next_basis(c, basis),
              next_index)

    return run

  args = (m, share, leaf_state["basis"])
  if len(ranks) == 1:
    outputs = at_rank(0)(*args)
  else:
    outputs = jax.lax.switch(leaf_state["rank_index"],
                             [at_rank(i) for i in range(len(ranks))], *args)
  mean, sent, basis, rank_index = outputs
  return mean, sent, {"basis": basis, "rank_index": rank_index}


def matrix_bytes(shape, num_islands: int, compression,
                 rank_index: int | None = None) -> int:
  """Bytes one island sends for the matrix of `shape` in matrices_mean;
  `rank_index`: adaptive_lowrank's ladder index this round (None: the top
  of the ladder)."""
  k = num_islands
  rows, cols = lowrank.matrix_view(shape)
  if compression.name == "topk":
    chunk = math.ceil(rows * cols / k)
    return communication.chunked_reduce_bytes(
        sparse.payload_bytes(
            chunk, sparse.keep_count(chunk, compression.topk_fraction)), k)
  if compression.name == "sign_prune":
    keep = sparse.keep_count(rows, 1.0 - compression.prune_rate)
    return communication.chunked_reduce_bytes(
        math.ceil(cols / k) * sparse.payload_bytes(rows, keep), k)
  index = len(compression.ranks) - 1 if rank_index is None else rank_index
  return _lowrank_bytes(rows, cols, compression.ranks[index], k, compression)


def _lowrank_bytes(rows: int, cols: int, rank: int, k: int,
                   compression) -> int:
  if compression.name == "lowrank":
    return (communication.dense_sum_bytes(rows * rank, k)
            + communication.dense_sum_bytes(cols * rank, k))
  codec = compression.factor_codec
  return (communication.dense_sum_bytes(rows * rank, k, codec)
          + communication.dense_sum_bytes(cols * rank, k, codec)
          + communication.dense_sum_bytes(rank + 1, k))  # the energies
