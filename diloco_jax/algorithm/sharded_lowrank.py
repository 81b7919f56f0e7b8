"""Low rank and adaptive low rank on FSDP islands: the power iteration on
matrices split over the island's devices, never gathered.

matrices_mean's step (codecs/lowrank.py) on a matrix M held in pieces:
split by rows (each device rows of M; a matrix the island keeps whole is
cut into row blocks, zero-padded), P = M Q is computed piece by piece,
and C = M^T P^ sums the pieces' products over the island's devices; split
by columns, the other way round (P sums over the devices, C is computed
piece by piece). Those sums run among the island's own devices. Each
cross-island sum of a factor (P, C, and the adaptive codec's energies) is
cut into one part per device, each device sending its part, so the island
sends the factors once, as a replicated island does. The result is the
whole-matrix codec's to float rounding (the orthonormal basis of P is
formed from its rows in the pieces' order, a row permutation, which
changes signs of its columns at most, and they cancel in P^ C^T);
factors quantized by adaptive low rank's codec are cut into blocks at
other places, one quantization step apart.
"""

import jax
import jax.numpy as jnp

from diloco_jax.codecs import lowrank
from diloco_jax.parallel import communication
from diloco_jax.parallel.mesh import DATA
from diloco_jax.parallel import placement


def island_mean(tree, weight, compression, codec_state, key, axes,
                stripes: int):
  """compression.island_mean for a low-rank codec on an island whose
  arrays are split over `stripes` devices; the same arguments and
  results."""
  leaves, treedef = jax.tree.flatten(tree)
  share = communication.weight_share(weight, axes)
  structured = [compression.is_structured_leaf(x.shape) for x in leaves]
  means, sents = list(leaves), list(leaves)
  small = [i for i, s in enumerate(structured) if not s]
  small_key = None if key is None else jax.random.fold_in(key, len(leaves))
  if small:
    # Through the fallback codec in placement.stripe's rows, each device
    # sending its row (a leaf kept whole is cut among them).
    matrix, unstripe = placement.stripe([leaves[i] for i in small], stripes)
    total, sent = communication.striped_sum(matrix * share, axes,
                                            compression.dense, small_key)
    for i, m, s in zip(small, unstripe(total),
                       unstripe(communication.unscale(sent, share))):
      means[i], sents[i] = m, s
  new_state = list(codec_state)
  for j, i in enumerate(i for i, s in enumerate(structured) if s):
    leaf_key = None if key is None else jax.random.fold_in(key, i)
    kind, pieces, join = _matrix_pieces(leaves[i].astype(jnp.float32),
                                        stripes)
    mean, sent, new_state[j] = _sharded_lowrank(
        kind, pieces, share, codec_state[j], compression, leaf_key, axes,
        stripes)
    means[i], sents[i] = join(mean), join(sent)
  cast = lambda values: jax.tree.unflatten(
      treedef, [v.astype(x.dtype) for v, x in zip(values, leaves)])
  return cast(means), cast(sents), tuple(new_state)


def mean_bytes(tree, num_islands: int, compression, rank_indices=None,
               stripes: int = 1) -> int:
  """Bytes one island sends for island_mean (all its devices together)."""
  shapes = [tuple(leaf.shape) for leaf in jax.tree.leaves(tree)]
  if num_islands <= 1:
    return 0
  k = num_islands
  total = stripes * communication.weight_share_bytes(k)  # on each device
  small = [s for s in shapes if not compression.is_structured_leaf(s)]
  if small:
    total += stripes * communication.dense_sum_bytes(
        placement.stripe_width(small, stripes), k, compression.dense)
  matrices = [s for s in shapes if compression.is_structured_leaf(s)]
  for j, shape in enumerate(matrices):
    rows, cols = lowrank.matrix_view(shape)
    index = (len(compression.ranks) - 1 if rank_indices is None
             else int(rank_indices[j]))
    rank = compression.ranks[index]
    adaptive = compression.name == "adaptive_lowrank"
    codec = compression.factor_codec if adaptive else None
    for values, factor_codec in ((rows * rank, codec), (cols * rank, codec),
                                 (rank + 1 if adaptive else 0, None)):
      if values:
        total += _split_sum_bytes(values, k, factor_codec, stripes)
  return total


def _split_sum_bytes(size: int, k: int, codec, stripes: int) -> int:
  return stripes * communication.dense_sum_bytes(-(-size // stripes), k,
                                                 codec)


def _matrix_pieces(leaf, stripes: int):
  """A matrix leaf as ('rows', [stripes, rows/s, cols]) or ('cols',
  [stripes, rows, cols/s]) pieces of its matrix view, and how to put a
  result of that form back into the leaf's shape."""
  shape = leaf.shape
  rows, cols = lowrank.matrix_view(shape)
  axis = placement.stripe_axis(shape, stripes)
  if axis == len(shape) - 1:
    pieces, join = placement.stripe_pieces(leaf, stripes)
    return "cols", pieces.reshape(stripes, rows, cols // stripes), (
        lambda p: join(p.reshape(pieces.shape)))
  if axis is not None:
    pieces, join = placement.stripe_pieces(leaf, stripes)
    return "rows", pieces.reshape(stripes, -1, cols), (
        lambda p: join(p.reshape(pieces.shape)))
  # Kept whole on every device: each takes a block of rows (zero rows pad
  # the last; they add nothing to either product).
  block = -(-rows // stripes)
  matrix = jnp.pad(leaf.reshape(rows, cols),
                   ((0, block * stripes - rows), (0, 0)))
  pieces = jax.lax.with_sharding_constraint(
      matrix.reshape(stripes, block, cols), jax.sharding.PartitionSpec(DATA))
  return "rows", pieces, lambda p: p.reshape(-1, cols)[:rows].reshape(shape)


def _sharded_lowrank(kind, pieces, share, leaf_state, compression, key, axes,
                     stripes: int):
  """One power-iteration step of matrices_mean's low-rank codec on a matrix
  held as `pieces` (see _matrix_pieces), each device on its own; returns
  (mean, sent) as pieces and the leaf's next codec state."""
  ranks = compression.ranks
  adaptive = compression.name == "adaptive_lowrank"
  factor_codec = compression.factor_codec if adaptive else None
  keys = (None, None) if key is None else tuple(jax.random.split(key))

  def on_device(pieces, share, basis, rank_index, keys):
    # Each device's cross-island sums get their own rounding noise.
    keys = [None if k is None else jax.random.fold_in(
        k, placement.local_stripes(jnp.arange(stripes))[0]) for k in keys]

    def parts_sum(parts, part_key):
      """Cross-island sum of this device's [local, ...] parts of a factor,
      each part flattened component-major as matrices_mean sends factors."""
      flat = jnp.swapaxes(parts, -1, -2).reshape(parts.shape[0], -1)
      total, sent = communication.striped_sum(flat, axes, factor_codec,
                                              part_key)
      unflat = lambda v: jnp.swapaxes(v.reshape(
          parts.shape[:-2] + parts.shape[:-3:-1]), -1, -2)
      return unflat(total), unflat(sent)

    def whole_sum(factor, part_key, codec=factor_codec):
      """Cross-island sum of a factor every device holds whole, each device
      sending its part."""
      flat = factor.T.reshape(-1) if factor.ndim == 2 else factor
      width = -(-flat.size // stripes)
      parts = placement.local_stripes(jnp.pad(
          flat, (0, width * stripes - flat.size)).reshape(stripes, width))
      total, sent = communication.striped_sum(parts, axes, codec, part_key)
      unflat = lambda v: placement.stripes_gather(v).reshape(-1)[:flat.size]
      if factor.ndim == 2:
        return (unflat(total).reshape(factor.shape[::-1]).T,
                unflat(sent).reshape(factor.shape[::-1]).T)
      return unflat(total), unflat(sent)

    def at_rank(index):
      r = ranks[index]

      def run(pieces, share, basis):
        q = basis[:, :r]
        if kind == "rows":  # pieces [local, rows/s, cols]
          p, _ = parts_sum(share * jnp.einsum("src,ck->srk", pieces, q),
                           keys[0])
          p_hat = placement.local_stripes(lowrank.orthonormalize(
              placement.stripes_gather(p).reshape(-1, r)).reshape(
                  stripes, -1, r))
          coefficients = placement.stripes_sum(
              jnp.einsum("src,srk->sck", pieces, p_hat))
          c, c_sent = whole_sum(coefficients * share, keys[1])
          c_whole = c
          expand = lambda coef: jnp.einsum("srk,ck->src", p_hat, coef)
          squares = jnp.sum(coefficients ** 2, axis=0)
        else:  # pieces [local, rows, cols/s]
          q_pieces = placement.local_stripes(q.reshape(stripes, -1, r))
          p, _ = whole_sum(share * placement.stripes_sum(
              jnp.einsum("src,sck->srk", pieces, q_pieces)), keys[0])
          p_hat = lowrank.orthonormalize(p)
          coefficients = jnp.einsum("src,rk->sck", pieces, p_hat)
          c, c_sent = parts_sum(coefficients * share, keys[1])
          c_whole = placement.stripes_gather(c).reshape(-1, r)
          expand = lambda coef: jnp.einsum("rk,sck->src", p_hat, coef)
          squares = placement.stripes_sum(jnp.sum(coefficients ** 2,
                                                  axis=1))
        next_index = jnp.array(index, jnp.int32)
        if adaptive:
          total = placement.stripes_sum(jnp.sum(pieces ** 2, axis=(1, 2)))
          energy, _ = whole_sum(share * jnp.concatenate([squares,
                                                         total[None]]),
                                None, codec=None)
          next_index = lowrank.choose_rank_index(
              energy[:r], energy[r], ranks, index,
              compression.energy_fraction)
        c_sent = communication.unscale(c_sent, share)
        return (expand(c), expand(c_sent), lowrank.next_basis(c_whole, basis),
                next_index)

      return run

    args = (pieces, share, basis)
    if len(ranks) == 1:
      mean, sent, basis, index = at_rank(0)(*args)
    else:
      mean, sent, basis, index = jax.lax.switch(
          rank_index, [at_rank(i) for i in range(len(ranks))], *args)
    # The state is the same on every device: each returns a copy per stripe.
    per_stripe = lambda x: jnp.broadcast_to(x, (pieces.shape[0],) + x.shape)
    return mean, sent, per_stripe(basis), per_stripe(index)

  mean, sent, basis, rank_index = placement.map_stripes(
      on_device, pieces, (share, leaf_state["basis"],
                          leaf_state["rank_index"], keys))
  return mean, sent, {"basis": basis[0], "rank_index": rank_index[0]}
