"""Deterministic, resumable batch streams for islands, and fixed eval batches.

A batch is a pure function of the step number, so resuming a run needs only
the step: no iterator state is checkpointed. A process of a multi-process run
builds only the batches of its own islands (`islands`), the same rows a
single process would build for them.
"""
import numpy as np

from diloco_jax.data import errors


class IslandBatches:
  """IID batches for `num_islands` islands, disjoint within each epoch.

  Epoch e draws a permutation of all N sequence indices from
  np.random.default_rng([seed, e]). Island i owns positions i, i + k,
  i + 2k, ... of it (k = num_islands), truncated to N // k positions so that
  every island owns the same number, and reads them in order, batch_size per
  step. An epoch therefore lasts steps_per_epoch = (N // k) // batch_size
  steps; step s belongs to epoch s // steps_per_epoch. Sequences left over by
  the truncations wait for a later epoch's permutation.
  """

  def __init__(self, sequences: np.ndarray, num_islands: int, batch_size: int,
               seed: int, islands: range | None = None):
    if sequences.ndim != 2:
      raise ValueError(
          f"sequences must be [num_sequences, length], got {sequences.shape}")
    if num_islands < 1 or batch_size < 1:
      raise ValueError(f"num_islands ({num_islands}) and batch_size "
                       f"({batch_size}) must be positive")
    sequences_per_island = sequences.shape[0] // num_islands
    if sequences_per_island < batch_size:
      raise errors.DataError(
          f"not enough data: {sequences.shape[0]} sequences give each of "
          f"{num_islands} islands {sequences_per_island} sequences, fewer than "
          f"one batch of {batch_size}; need at least "
          f"{num_islands * batch_size} sequences")
    self._sequences = sequences
    self._num_islands = num_islands
    self._islands = _island_range(islands, num_islands)
    self._batch_size = batch_size
    self._seed = seed
    self._steps_per_epoch = sequences_per_island // batch_size
    self._cached_epoch = None
    self._cached_order = None

  @property
  def steps_per_epoch(self) -> int:
    """Steps after which every island has read its share of one epoch."""
    return self._steps_per_epoch

  def batch(self, step: int) -> np.ndarray:
    """The batches of this source's islands at `step`: [islands, batch_size,
    L+1] (all islands unless `islands` named some)."""
    if step < 0:
      raise ValueError(f"step must be non-negative, got {step}")
    epoch, step_in_epoch = divmod(step, self._steps_per_epoch)
    order = self._epoch_order(epoch)
    rows = order[step_in_epoch * self._batch_size:
                 (step_in_epoch + 1) * self._batch_size,
                 self._islands.start:self._islands.stop]
    # rows[j, i] is island i's j-th sequence of this step; islands lead.
    return self._sequences[rows.T].astype(np.int32)

  def _epoch_order(self, epoch: int) -> np.ndarray:
    """[sequences per island, num_islands]: column i is island i's share."""
    # Consecutive steps share an epoch; one permutation serves all of them.
    if epoch != self._cached_epoch:
      num_sequences = self._sequences.shape[0]
      permutation = np.random.default_rng([self._seed, epoch]).permutation(
          num_sequences)
      per_island = num_sequences // self._num_islands
      self._cached_order = permutation[:per_island * self._num_islands].reshape(
          per_island, self._num_islands)
      self._cached_epoch = epoch
    return self._cached_order


def eval_batches(sequences: np.ndarray, batch_size: int,
                 num_batches: int) -> np.ndarray:
  """The first num_batches * batch_size sequences, in order, as int32.

  Returns [num_batches, batch_size, L+1]: a fixed held-out set, identical at
  every evaluation so that losses are comparable across steps and runs.
  """
  needed = num_batches * batch_size
  if sequences.shape[0] < needed:
    raise errors.DataError(
        f"eval needs {num_batches} batches x {batch_size} = {needed} "
        f"sequences, but only {sequences.shape[0]} are present")
  return sequences[:needed].reshape(num_batches, batch_size,
                                    -1).astype(np.int32)


class ClusteredIslandBatches:
  """Batches for islands that each own their own sequences (non-iid).

  Island i reads only `island_sequences[i]` (its cluster of the corpus): in
  epoch e (its own epochs; islands' sequence counts differ) it reads the
  permutation np.random.default_rng([seed, i, e]) of them, batch_size per
  step. Like IslandBatches, a batch is a pure function of the step.
  """

  def __init__(self, island_sequences: list[np.ndarray], batch_size: int,
               seed: int, islands: range | None = None):
    if batch_size < 1:
      raise ValueError(f"batch_size must be positive, got {batch_size}")
    for island, sequences in enumerate(island_sequences):
      if sequences.shape[0] < batch_size:
        raise errors.DataError(
            f"not enough data: island {island}'s cluster holds "
            f"{sequences.shape[0]} sequences, fewer than one batch of "
            f"{batch_size}")
    self._island_sequences = island_sequences
    self._islands = _island_range(islands, len(island_sequences))
    self._batch_size = batch_size
    self._seed = seed
    self._orders = {}  # island -> (epoch, permutation) of the last use

  def steps_per_epoch(self, island: int) -> int:
    """Steps after which `island` has read each of its sequences once."""
    return self._island_sequences[island].shape[0] // self._batch_size

  def batch(self, step: int) -> np.ndarray:
    """The batches of this source's islands at `step`: [islands, batch_size,
    L+1] (all islands unless `islands` named some)."""
    if step < 0:
      raise ValueError(f"step must be non-negative, got {step}")
    return np.stack([self._island_batch(island, step)
                     for island in self._islands])

  def _island_batch(self, island: int, step: int) -> np.ndarray:
    epoch, step_in_epoch = divmod(step, self.steps_per_epoch(island))
    cached = self._orders.get(island)
    if cached is None or cached[0] != epoch:
      permutation = np.random.default_rng([self._seed, island, epoch]
                                          ).permutation(
                                              self._island_sequences[island]
                                              .shape[0])
      cached = self._orders[island] = (epoch, permutation)
    rows = cached[1][step_in_epoch * self._batch_size:
                     (step_in_epoch + 1) * self._batch_size]
    return self._island_sequences[island][rows].astype(np.int32)


def _island_range(islands: range | None, num_islands: int) -> range:
  """`islands` (default: all), checked to lie within [0, num_islands)."""
  if islands is None:
    return range(num_islands)
  if islands.step != 1 or not 0 <= islands.start < islands.stop <= num_islands:
    raise ValueError(f"islands must be a consecutive range within "
                     f"[0, {num_islands}), got {islands}")
  return islands
