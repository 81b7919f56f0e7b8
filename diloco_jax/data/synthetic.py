"""A synthetic corpus whose entropy rate is known exactly.

Text from an order-1 Markov chain lets tests compare a model's loss with the
best achievable loss: no model can beat the chain's entropy rate.
"""
from collections.abc import Sequence

import numpy as np

Seed = int | Sequence[int]


class MarkovSource:
  """An order-1 Markov chain over `vocab_size` symbols.

  Each row of the transition matrix is drawn from a symmetric
  Dirichlet(concentration): small concentrations give peaked rows (low
  entropy), large ones nearly uniform rows (entropy near log(vocab_size)).
  """

  def __init__(self, vocab_size: int, concentration: float, seed: Seed):
    if vocab_size < 1:
      raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if concentration <= 0:
      raise ValueError(f"concentration must be positive, got {concentration}")
    self.vocab_size = vocab_size
    rng = np.random.default_rng(seed)
    matrix = rng.dirichlet(np.full(vocab_size, float(concentration)),
                           size=vocab_size)
    # Dirichlet draws can underflow to exact zeros for tiny concentrations;
    # renormalizing keeps every row an exact distribution.
    self._transition_matrix = matrix / matrix.sum(axis=1, keepdims=True)
    self._stationary_distribution = _solve_stationary(self._transition_matrix)
    # Row r of the cumulative matrix, shifted by r, lies in [r, r + 1], so the
    # flattened array is sorted and one searchsorted samples every row at once.
    cumulative = np.cumsum(self._transition_matrix, axis=1)
    cumulative[:, -1] = 1.0
    self._shifted_cumulative = (
        cumulative + np.arange(vocab_size)[:, None]).ravel()

  @property
  def transition_matrix(self) -> np.ndarray:
    """[vocab_size, vocab_size] float64; row i is P(next | current = i)."""
    return self._transition_matrix

  @property
  def stationary_distribution(self) -> np.ndarray:
    """[vocab_size] float64 pi with pi @ transition_matrix == pi."""
    return self._stationary_distribution

  def entropy_rate(self) -> float:
    """Entropy rate in nats per token: -sum_i pi_i sum_j P_ij log P_ij."""
    matrix = self._transition_matrix
    # 0 log 0 = 0: zeros contribute nothing.
    log_matrix = np.log(np.where(matrix > 0, matrix, 1.0))
    row_entropies = -(matrix * log_matrix).sum(axis=1)
    return float(self._stationary_distribution @ row_entropies)

  def sample_documents(self, num_documents: int, document_length: int,
                       seed: Seed) -> np.ndarray:
    """Samples [num_documents, document_length] uint16 token ids.

    Documents start in the stationary distribution, so every position has the
    same marginal and the per-token entropy is the entropy rate. The loop runs
    over positions only; all documents advance together.
    """
    if self.vocab_size > np.iinfo(np.uint16).max + 1:
      raise ValueError(f"vocab_size {self.vocab_size} does not fit uint16")
    rng = np.random.default_rng(seed)
    documents = np.empty((num_documents, document_length), dtype=np.uint16)
    if document_length == 0:
      return documents
    uniforms = rng.random((document_length, num_documents))
    stationary_cumulative = np.cumsum(self._stationary_distribution)
    current = np.searchsorted(stationary_cumulative, uniforms[0], side="right")
    current = np.minimum(current, self.vocab_size - 1)
    documents[:, 0] = current
    for position in range(1, document_length):
      flat_index = np.searchsorted(self._shifted_cumulative,
                                   current + uniforms[position], side="right")
      # Entries of rows before `current` all lie below the target, so the
      # flat index minus the row offset is the sampled column.
      current = np.minimum(flat_index - current * self.vocab_size,
                           self.vocab_size - 1)
      documents[:, position] = current
    return documents


def _solve_stationary(transition_matrix: np.ndarray) -> np.ndarray:
  """Solves pi (P - I) = 0 with sum(pi) = 1 exactly (a linear solve).

  One balance equation is redundant, so it is replaced by normalization.
  Dirichlet rows are almost surely all positive, so the chain is irreducible
  and the system has a unique solution.
  """
  vocab_size = transition_matrix.shape[0]
  system = transition_matrix.T - np.eye(vocab_size)
  system[-1, :] = 1.0
  right_hand_side = np.zeros(vocab_size)
  right_hand_side[-1] = 1.0
  stationary = np.linalg.solve(system, right_hand_side)
  # Round-off can leave tiny negatives; they are not probabilities.
  stationary = np.clip(stationary, 0.0, None)
  return stationary / stationary.sum()
