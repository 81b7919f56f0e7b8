"""Clustering documents on cheap features, for non-iid islands.

Features are hashed n-gram counts: each document's byte (or token) bigrams and
trigrams are hashed into `num_buckets` buckets and the count vector is
L2-normalized, so long and short documents of one kind land close together.
k-means (k-means++ seeding from a seed, a few Lloyd iterations) then groups
them. Everything is numpy and deterministic given the seed.
"""
from collections.abc import Sequence

import numpy as np

NUM_BUCKETS = 4096  # 2**12: enough to tell kinds of text apart, cheap to hold
# Only a document's prefix is featurized: its kind shows early, and long
# documents then cost no more than short ones.
MAX_FEATURE_SYMBOLS = 32768
NGRAM_ORDERS = (2, 3)
KMEANS_ITERATIONS = 10
# Balanced clusters: stop once every cluster is within 5% of 1/k of the
# weight (whole documents cannot split it exactly), or after this many sweeps.
BALANCE_SWEEPS = 50
BALANCE_TOLERANCE = 0.05

# Odd 64-bit constants: a multiplicative (Fibonacci) hash spreads n-gram keys
# over the buckets; the base combines the symbols of one n-gram into a key.
_HASH_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
_KEY_BASE = np.uint64(1_000_003)


def hashed_ngram_features(documents: Sequence[bytes | np.ndarray],
                          num_buckets: int = NUM_BUCKETS) -> np.ndarray:
  """[num_documents, num_buckets] float32, each row L2-normalized.

  A document is bytes (text: byte n-grams, independent of the tokenizer) or
  an integer array (token n-grams, e.g. the synthetic corpus). Rows of
  documents shorter than every n-gram order are zero.
  """
  if num_buckets < 2 or num_buckets & (num_buckets - 1):
    raise ValueError(f"num_buckets must be a power of two, got {num_buckets}")
  shift = np.uint64(64 - (num_buckets.bit_length() - 1))
  features = np.zeros((len(documents), num_buckets), dtype=np.float32)
  for row, document in enumerate(documents):
    if isinstance(document, (bytes, bytearray)):
      document = np.frombuffer(document, dtype=np.uint8)
    symbols = np.asarray(document).ravel()[:MAX_FEATURE_SYMBOLS].astype(
        np.uint64)
    for order in NGRAM_ORDERS:
      if symbols.size < order:
        continue
      # The order itself seeds the key so bigrams and trigrams hash apart.
      keys = np.full(symbols.size - order + 1, order, dtype=np.uint64)
      for offset in range(order):
        keys = keys * _KEY_BASE + symbols[offset:symbols.size - order + 1 +
                                          offset]
      buckets = (keys * _HASH_MULTIPLIER) >> shift
      features[row] += np.bincount(buckets.astype(np.int64),
                                   minlength=num_buckets)
    norm = np.linalg.norm(features[row])
    if norm > 0:
      features[row] /= norm
  return features


def _squared_distances(features: np.ndarray,
                       centroids: np.ndarray) -> np.ndarray:
  """[num_points, k] squared Euclidean distances, clipped at zero."""
  distances = ((features * features).sum(1)[:, None]
               - 2 * features @ centroids.T
               + (centroids * centroids).sum(1)[None, :])
  return np.maximum(distances, 0.0)


def assign(features: np.ndarray, centroids: np.ndarray,
           offsets: np.ndarray | None = None) -> np.ndarray:
  """The index of each row's nearest centroid, [num_points] int64.

  `offsets` [k] (from `balance_offsets`) are added to the squared distances
  to every centroid, making a cluster cheaper or dearer to join. Ties go to
  the lowest index, so assignment is deterministic.
  """
  return _nearest(_squared_distances(features, centroids), offsets)


def _nearest(distances: np.ndarray, offsets: np.ndarray | None
             ) -> np.ndarray:
  """argmin over clusters of distances [n, k] (+ offsets [k])."""
  if offsets is not None:
    distances = distances + offsets[None, :]
  return np.argmin(distances, axis=1)


def balance_offsets(features: np.ndarray, centroids: np.ndarray,
                    weights: np.ndarray,
                    sweeps: int = BALANCE_SWEEPS) -> np.ndarray:
  """Per-centroid offsets [k] that give each cluster about 1/k of `weights`.

  k-means on text often puts most of a corpus in one cluster (one kind of
  text dominates); islands built on such clusters differ more in size than
  in kind. Assigning each point to its nearest centroid after adding an
  offset per centroid keeps the clusters' shapes (points still go where
  they are closest, up to the offsets) while moving their boundaries until
  each holds 1/k of the weight (e.g. tokens). Because the rule is per
  point, a stream can apply it document by document.

  The offsets come from coordinate sweeps: cluster c's offset is set, with
  the others fixed, to the value at which its members' weight comes closest
  to 1/k (a point joins c iff its distance to c plus c's offset beats its
  best other choice, so this is a threshold on one sorted list). Returns the
  offsets of the best-balanced sweep, float64.
  """
  distances = _squared_distances(features, centroids).astype(np.float64)
  weights = np.asarray(weights, dtype=np.float64)
  k = distances.shape[1]
  target = weights.sum() / k
  offsets = np.zeros(k)
  if k == 1:  # one cluster holds everything already
    return offsets
  best, best_error = offsets.copy(), np.inf
  for _ in range(sweeps):
    for cluster in range(k):
      others = np.delete(distances + offsets[None, :], cluster, axis=1)
      # Point i joins `cluster` iff offset < thresholds[i].
      thresholds = others.min(axis=1) - distances[:, cluster]
      order = np.argsort(-thresholds, kind="stable")
      members_weight = np.cumsum(weights[order])
      count = 1 + int(np.argmin(np.abs(members_weight - target)))
      below = (thresholds[order[count]] if count < len(order)
               else thresholds[order[-1]] - 1.0)
      offsets[cluster] = 0.5 * (thresholds[order[count - 1]] + below)
    shares = np.bincount(_nearest(distances, offsets), weights=weights,
                         minlength=k)
    error = np.abs(shares - target).max()
    if error < best_error:
      best, best_error = offsets.copy(), error
    if error <= BALANCE_TOLERANCE * target:
      break
  return best


def kmeans(features: np.ndarray, k: int, seed: int,
           iterations: int = KMEANS_ITERATIONS) -> np.ndarray:
  """k-means centroids [k, dim] float32, k-means++ seeded from `seed`.

  A cluster that loses all its points is re-seeded with the point farthest
  from its centroid, so every centroid keeps at least one point whenever
  there are at least k distinct points.
  """
  num_points = features.shape[0]
  if num_points < k:
    raise ValueError(f"k-means needs at least k={k} documents, got "
                     f"{num_points}")
  features = features.astype(np.float32, copy=False)
  rng = np.random.default_rng(seed)
  chosen = [int(rng.integers(num_points))]
  nearest = _squared_distances(features, features[chosen]).min(axis=1)
  for _ in range(1, k):
    total = nearest.sum()
    if total > 0:
      # k-means++: the next seed is a point drawn in proportion to its
      # squared distance from the seeds chosen so far.
      index = int(rng.choice(num_points, p=nearest / total))
    else:  # every point coincides with a seed: any unchosen one will do
      index = int(rng.choice(np.setdiff1d(np.arange(num_points), chosen)))
    chosen.append(index)
    nearest = np.minimum(
        nearest, _squared_distances(features, features[[index]])[:, 0])
  centroids = features[chosen].copy()
  labels = None
  for _ in range(iterations):
    distances = _squared_distances(features, centroids)
    new_labels = np.argmin(distances, axis=1)
    if labels is not None and np.array_equal(new_labels, labels):
      break
    labels = new_labels
    for cluster in range(k):
      members = labels == cluster
      if members.any():
        centroids[cluster] = features[members].mean(axis=0)
      else:
        farthest = int(np.argmax(distances[np.arange(num_points), labels]))
        centroids[cluster] = features[farthest]
        labels[farthest] = cluster
  return centroids


def cluster_documents(documents: Sequence[bytes | np.ndarray], k: int,
                      seed: int, weights: np.ndarray | None = None
                      ) -> np.ndarray:
  """Cluster label in [0, k) of each document, [num_documents] int64.

  With `weights` (e.g. each document's token count), the clusters are
  balanced to about 1/k of the total weight each (`balance_offsets`).
  """
  features = hashed_ngram_features(documents)
  centroids = kmeans(features, k, seed)
  offsets = (None if weights is None
             else balance_offsets(features, centroids, weights))
  return assign(features, centroids, offsets)
