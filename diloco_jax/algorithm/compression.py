"""Codecs over pytrees: how a whole pseudo-gradient crosses the island link.

Dense codecs (fp32, bf16, fp16, int8, int4, fp4; see codecs.py) encode the
whole flattened tree and reduce it with a compressed reduce-scatter +
all-gather.
Structured codecs work on each matrix (a tensor of rank >= 2, viewed as
[rows, cols] by lowrank.matrix_view); vectors and tensors too small to gain
go through the `fallback` dense codec:

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
(if on) sends it next round.

Every codec returns what each island's contribution became after encoding
(for error feedback) and runs inside the one jitted outer step; byte counts
mirror the collectives exactly (`mean_bytes`).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from diloco_jax.codecs import dense as codecs
from diloco_jax.parallel import communication
from diloco_jax.codecs import lowrank
from diloco_jax.parallel import multihost
from diloco_jax.codecs import sparse
from diloco_jax.parallel.mesh import ISLANDS

STRUCTURED_CODECS = ("sign_prune", "topk", "lowrank", "adaptive_lowrank")
CODECS = codecs.DENSE_CODECS + STRUCTURED_CODECS


@dataclasses.dataclass(frozen=True)
class Compression:
  """A codec over pytrees and its settings (built by `from_config`).

  Attributes:
    name: one of CODECS.
    dense: for a dense codec, the codec of the whole tree; for a structured
      one, the fallback codec of its vectors and small tensors.
    prune_rate: sign_prune: the fraction of each neuron's values dropped.
    topk_fraction: topk: the fraction of each matrix's values kept.
    ranks: low-rank codecs: the candidate ranks, ascending (one for lowrank).
    energy_fraction: adaptive_lowrank: the energy each matrix's rank keeps.
    factor_codec: low-rank codecs: how the factors cross the link.
  """
  name: str
  dense: codecs.DenseCodec
  prune_rate: float = 0.5
  topk_fraction: float = 0.01
  ranks: tuple[int, ...] = (4,)
  energy_fraction: float = 0.9
  factor_codec: codecs.DenseCodec = codecs.DenseCodec("fp32")

  @property
  def is_dense(self) -> bool:
    return self.name in codecs.DENSE_CODECS

  @property
  def is_lowrank(self) -> bool:
    return self.name in ("lowrank", "adaptive_lowrank")

  @property
  def is_identity(self) -> bool:
    return self.is_dense and self.dense.is_identity

  def is_structured_leaf(self, shape) -> bool:
    """Whether a leaf of this shape goes through the structured codec."""
    if self.is_dense or len(shape) < 2:
      return False
    rows, cols = lowrank.matrix_view(shape)
    if self.is_lowrank:
      # Worth factoring only if the largest rank's factors save at least a
      # quarter of the matrix.
      max_rank = self.ranks[-1]
      return (max_rank <= min(rows, cols)
              and 4 * max_rank * (rows + cols) <= 3 * rows * cols)
    return True


def from_config(diloco_config) -> Compression:
  """The Compression described by config.diloco (see config_schema)."""
  c = diloco_config
  block = c.codec_block_size
  if c.codec in codecs.DENSE_CODECS:
    return Compression(c.codec, codecs.make_codec(c.codec, block))
  fallback = codecs.make_codec(c.fallback_codec, block)
  if c.codec == "lowrank":
    return Compression(c.codec, fallback, ranks=(c.lowrank.rank,))
  if c.codec == "adaptive_lowrank":
    return Compression(
        c.codec, fallback,
        ranks=lowrank.rank_ladder(c.lowrank.min_rank, c.lowrank.max_rank),
        energy_fraction=c.lowrank.energy_fraction,
        factor_codec=codecs.make_codec(c.lowrank.factor_codec, block))
  return Compression(c.codec, fallback, prune_rate=c.prune_rate,
                     topk_fraction=c.topk_fraction)


def as_compression(codec) -> Compression:
  """`codec` as a Compression: None is fp32, a DenseCodec covers the tree."""
  if codec is None:
    return Compression("fp32", codecs.DenseCodec("fp32"))
  if isinstance(codec, codecs.DenseCodec):
    return Compression(codec.name, codec)
  return codec


def init_codec_state(params, compression: Compression, seed: int = 0):
  """The codec's replicated state, or None for codecs that keep none.

  Low-rank codecs keep, per factored matrix (in tree-leaf order), the
  warm-start basis [cols, max_rank] and the ladder index of the rank to use
  next round (starting at the top).
  """
  if not compression.is_lowrank:
    return None
  keys = jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params)))
  state = []
  for key, leaf in zip(keys, jax.tree.leaves(params)):
    if compression.is_structured_leaf(leaf.shape):
      _, cols = lowrank.matrix_view(leaf.shape)
      state.append({
          "basis": lowrank.initial_basis(key, cols, compression.ranks[-1]),
          "rank_index": jnp.array(len(compression.ranks) - 1, jnp.int32)})
  return tuple(state)


def island_mean(tree, weight, compression: Compression, codec_state=None,
                key: jax.Array | None = None, axes=ISLANDS,
                stripes: int = 1):
  """Weighted mean of `tree` over the islands through `compression`.

  Must be called per island, inside `placement.island_map`.

  Args:
    tree: this island's pytree (e.g. its pseudo-gradient plus residual).
    weight: this island's scalar weight (0 if it sends nothing).
    compression: the codec.
    codec_state: as made by init_codec_state (replicated).
    key: PRNG key for stochastic rounding, or None for round to nearest.
    axes: the island axes (see communication).
    stripes: the island's devices its arrays are split over (FSDP); dense
      codecs only (structured codecs work on whole matrices).

  Returns:
    (mean, sent, codec_state): the mean, identical on every island; what
    this island's contribution became after encoding, in `tree`'s units;
    and the codec's state for the next round.
  """
  if compression.is_dense:
    mean, sent = communication.island_mean(
        tree, weight, axes, compression.dense, key, return_sent=True,
        stripes=stripes)
    return mean, sent, codec_state
  if stripes > 1:
    raise ValueError(f"codec {compression.name!r} works on whole matrices; "
                     "FSDP islands need a dense codec")
  leaves, treedef = jax.tree.flatten(tree)
  share = communication.weight_share(weight, axes)
  structured = [compression.is_structured_leaf(x.shape) for x in leaves]
  leaf_keys = [None if key is None else jax.random.fold_in(key, i)
               for i in range(len(leaves) + 1)]
  means, sents = list(leaves), list(leaves)
  small = [i for i, s in enumerate(structured) if not s]
  if small:
    _small_leaves_mean(leaves, small, share, compression, leaf_keys[-1],
                       axes, means, sents)
  matrices = [i for i, s in enumerate(structured) if s]
  new_state = _matrices_mean(leaves, matrices, share, compression,
                             codec_state, leaf_keys, axes, means, sents)
  cast = lambda values: jax.tree.unflatten(
      treedef, [v.astype(x.dtype) for v, x in zip(values, leaves)])
  return cast(means), cast(sents), new_state


def _small_leaves_mean(leaves, indices, share, compression: Compression,
                       key, axes, means: list, sents: list) -> None:
  """Vectors and small tensors: one dense collective for all of them.

  Writes each leaf's mean and what was sent into `means` and `sents`.
  """
  flat, unravel = ravel_pytree([leaves[i].astype(jnp.float32)
                                for i in indices])
  total, sent = communication.dense_sum(flat * share, axes,
                                        compression.dense, key)
  for i, m, s in zip(indices, unravel(total),
                     unravel(communication.unscale(sent, share))):
    means[i], sents[i] = m, s


def _matrices_mean(leaves, indices, share, compression: Compression,
                   codec_state, leaf_keys, axes, means: list,
                   sents: list):
  """The structured codec on each matrix; returns the new codec state.

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


def _topk_mean(m, share, compression: Compression, axes):
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


def _sign_prune_mean(m, share, island_shares, compression: Compression,
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


def _lowrank_mean(m, share, leaf_state, compression: Compression, key,
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


def mean_bytes(tree, num_islands: int, compression: Compression,
               rank_indices=None, stripes: int = 1) -> int:
  """Bytes one island sends for `island_mean(tree, ..., compression)`.

  Args:
    tree: a pytree of arrays or jax.ShapeDtypeStruct (one island's shapes).
    num_islands: k.
    compression: the codec.
    rank_indices: adaptive_lowrank: each factored matrix's ladder index for
      this round (from the codec state); None means the top of the ladder.
    stripes: as passed to island_mean (FSDP; dense codecs).
  """
  if compression.is_dense:
    return communication.island_mean_bytes(tree, num_islands,
                                           compression.dense, stripes)
  k = num_islands
  if k <= 1:
    return 0
  total = communication.weight_share_bytes(k)
  shapes = [leaf.shape for leaf in jax.tree.leaves(tree)]
  small = sum(math.prod(s) for s in shapes
              if not compression.is_structured_leaf(s))
  if small:
    total += communication.dense_sum_bytes(small, k, compression.dense)
  matrices = [s for s in shapes if compression.is_structured_leaf(s)]
  if matrices and compression.name == "sign_prune":
    total += communication.gather_bytes(4, k)  # every island's weight
  for j, shape in enumerate(matrices):
    rows, cols = lowrank.matrix_view(shape)
    if compression.name == "topk":
      chunk = math.ceil(rows * cols / k)
      total += communication.chunked_reduce_bytes(
          sparse.payload_bytes(
              chunk, sparse.keep_count(chunk, compression.topk_fraction)), k)
    elif compression.name == "sign_prune":
      keep = sparse.keep_count(rows, 1.0 - compression.prune_rate)
      total += communication.chunked_reduce_bytes(
          math.ceil(cols / k) * sparse.payload_bytes(rows, keep), k)
    else:
      index = (len(compression.ranks) - 1 if rank_indices is None
               else int(rank_indices[j]))
      total += _lowrank_bytes(rows, cols, compression.ranks[index], k,
                              compression)
  return total


def _lowrank_bytes(rows: int, cols: int, rank: int, k: int,
                   compression: Compression) -> int:
  if compression.name == "lowrank":
    return (communication.dense_sum_bytes(rows * rank, k)
            + communication.dense_sum_bytes(cols * rank, k))
  codec = compression.factor_codec
  return (communication.dense_sum_bytes(rows * rank, k, codec)
          + communication.dense_sum_bytes(cols * rank, k, codec)
          + communication.dense_sum_bytes(rank + 1, k))  # the energies


def rank_indices(codec_state) -> list[int] | None:
  """The per-matrix ladder indices in a low-rank codec state (host ints)."""
  if not codec_state:
    return None
  # Only the indices cross to the host, not the bases beside them.
  return [int(index) for index in multihost.fetch(
      [s["rank_index"] for s in codec_state])]
