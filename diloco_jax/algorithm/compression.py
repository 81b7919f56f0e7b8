"""Codecs over pytrees: how a whole pseudo-gradient crosses the island link.

`Compression` names a codec and its settings. Dense codecs (fp32, bf16,
fp16, int8, int4, fp4; codecs/dense.py) encode the whole flattened tree and
reduce it with a compressed reduce-scatter + all-gather
(communication.island_mean). Structured codecs (sign_prune, topk, lowrank,
adaptive_lowrank; matrix_codecs.py) work on each matrix; vectors and
tensors too small to gain go through the `fallback` dense codec in one
collective. On FSDP islands (`stripes` > 1) the structured codecs work on
each device's pieces: top-k, sign pruning and SparseLoCo select per piece,
low rank factors the whole matrix from its pieces (sharded_lowrank.py).

Every codec returns what each island's contribution became after encoding
(for error feedback) and runs inside the one jitted outer step; byte counts
mirror the collectives exactly (`mean_bytes`).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from diloco_jax.algorithm import matrix_codecs
from diloco_jax.algorithm import sharded_lowrank
from diloco_jax.algorithm import sparse_chunks_mean
from diloco_jax.codecs import dense as codecs
from diloco_jax.codecs import lowrank
from diloco_jax.parallel import communication
from diloco_jax.parallel.mesh import ISLANDS
from diloco_jax.parallel import multihost
from diloco_jax.parallel import placement

STRUCTURED_CODECS = ("sign_prune", "topk", "lowrank", "adaptive_lowrank")
CODECS = codecs.DENSE_CODECS + STRUCTURED_CODECS
# SparseLoCo's chunked top-k (sparse_chunks_mean.py): chosen with its outer
# mode (config.diloco.outer_optimizer.name='sparseloco'), not as a codec.
SPARSELOCO = "sparseloco"


@dataclasses.dataclass(frozen=True)
class Compression:
  """A codec over pytrees and its settings (a run's is built by
  config/run_config.compression).

  Attributes:
    name: one of CODECS.
    dense: for a dense codec, the codec of the whole tree; for a structured
      one, the fallback codec of its vectors and small tensors.
    prune_rate: sign_prune: the fraction of each neuron's values dropped.
    topk_fraction: topk: the fraction of each matrix's values kept.
    ranks: low-rank codecs: the candidate ranks, ascending (one for lowrank).
    energy_fraction: adaptive_lowrank: the energy each matrix's rank keeps.
    factor_codec: low-rank codecs: how the factors cross the link.
    chunk_size: sparseloco: the values of one top-k chunk.
    density: sparseloco: the fraction of each chunk kept.
    value_bits: sparseloco: the bits of each kept value.
    feedback_decay: error feedback's decay of the residual before it is
      added to the next pseudo-gradient (SparseLoCo's beta, making the
      residual the outer momentum); 1 is plain error feedback.
  """
  name: str
  dense: codecs.DenseCodec
  prune_rate: float = 0.5
  topk_fraction: float = 0.01
  ranks: tuple[int, ...] = (4,)
  energy_fraction: float = 0.9
  factor_codec: codecs.DenseCodec = codecs.DenseCodec("fp32")
  chunk_size: int = 4096
  density: float = 0.02
  value_bits: int = 2
  feedback_decay: float = 1.0

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
    if self.is_dense or self.name == SPARSELOCO or len(shape) < 2:
      return False
    rows, cols = lowrank.matrix_view(shape)
    if self.is_lowrank:
      # Worth factoring only if the largest rank's factors save at least a
      # quarter of the matrix.
      max_rank = self.ranks[-1]
      return (max_rank <= min(rows, cols)
              and 4 * max_rank * (rows + cols) <= 3 * rows * cols)
    return True


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
    stripes: the island's devices its arrays are split over (FSDP): a
      dense codec compresses each device's shards in blocks of their own;
      top-k, sign pruning and SparseLoCo select within each device's pieces
      (placement.stripe_pieces), as a replicated island's codec would
      select in pieces of that size; low rank factors whole matrices from
      their pieces (sharded_lowrank.py).

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
    if compression.is_lowrank:
      return sharded_lowrank.island_mean(tree, weight, compression,
                                         codec_state, key, axes, stripes)
    return _per_piece_mean(tree, weight, compression, key, axes, stripes)
  if compression.name == SPARSELOCO:
    return sparse_chunks_mean.island_mean(tree, weight, compression, key,
                                          axes)
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
  new_state = matrix_codecs.matrices_mean(
      leaves, matrices, share, compression, codec_state, leaf_keys, axes,
      means, sents)
  cast = lambda values: jax.tree.unflatten(
      treedef, [v.astype(x.dtype) for v, x in zip(values, leaves)])
  return cast(means), cast(sents), new_state


def _per_piece_mean(tree, weight, compression: Compression, key, axes,
                    stripes: int):
  """A selecting codec (top-k, sign pruning, SparseLoCo) on each device's
  pieces of the tree, each device coding its own (placement.map_stripes)."""
  leaves, treedef = jax.tree.flatten(tree)
  pieces, joins = zip(*(placement.stripe_pieces(x, stripes) for x in leaves))
  keys = None if key is None else jax.random.split(key, stripes)

  def on_device(local, weight):
    def one_piece(piece_leaves, piece_key):
      mean, sent, _ = island_mean(list(piece_leaves), weight, compression,
                                  None, piece_key, axes)
      return mean, sent
    device_pieces, device_keys = local
    return jax.vmap(one_piece, in_axes=(0, None if device_keys is None
                                        else 0))(device_pieces, device_keys)

  means, sents = placement.map_stripes(on_device, (list(pieces), keys),
                                       (weight,))
  join = lambda values: jax.tree.unflatten(
      treedef, [j(v).astype(x.dtype) for j, v, x in zip(joins, values,
                                                        leaves)])
  return join(means), join(sents), None


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


def mean_bytes(tree, num_islands: int, compression: Compression,
               rank_indices=None, stripes: int = 1) -> int:
  """Bytes one island sends for `island_mean(tree, ..., compression)`.

  Args:
    tree: a pytree of arrays or jax.ShapeDtypeStruct (one island's shapes).
    num_islands: k.
    compression: the codec.
    rank_indices: adaptive_lowrank: each factored matrix's ladder index for
      this round (from the codec state); None means the top of the ladder.
    stripes: as passed to island_mean (FSDP: every device sends its
      part).
  """
  if compression.is_dense:
    return communication.island_mean_bytes(tree, num_islands,
                                           compression.dense, stripes)
  if stripes > 1:
    if compression.is_lowrank:
      return sharded_lowrank.mean_bytes(tree, num_islands, compression,
                                        rank_indices, stripes)
    pieces = [jax.ShapeDtypeStruct(placement.piece_shape(leaf.shape,
                                                         stripes),
                                   jnp.float32)
              for leaf in jax.tree.leaves(tree)]
    return stripes * mean_bytes(pieces, num_islands, compression)
  if compression.name == SPARSELOCO:
    return sparse_chunks_mean.mean_bytes(tree, num_islands, compression)
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
    total += matrix_codecs.matrix_bytes(
        shape, k, compression,
        None if rank_indices is None else int(rank_indices[j]))
  return total


def rank_indices(codec_state) -> list[int] | None:
  """The per-matrix ladder indices in a low-rank codec state (host ints);
  of a pipelined island's state (one per stage), stage by stage."""
  if not codec_state:
    return None
  # Only the indices cross to the host, not the bases beside them.
  indices = np.asarray(multihost.fetch(
      [s["rank_index"] for s in codec_state]))  # [matrices] or [.., stages]
  return [int(index) for index in indices.T.reshape(-1)]
