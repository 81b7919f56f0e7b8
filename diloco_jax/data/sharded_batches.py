"""Streaming, resumable island batches over sharded corpora too big for memory.

A document collection (C4 JSON shards, a TFDS split cut into virtual shards)
is read shard by shard; documents are tokenized, each followed by EOS, and the
token stream is cut into sequences of sequence_length + 1 tokens, batch_size
per island per step.

Which shards an island reads:
- "iid": island i owns the shards with index % num_islands == i, disjoint
  from every other island's.
- "clustered": every island scans every shard and keeps the documents whose
  nearest centroid is its own (centroids fitted by `fit_clusters` on a
  sample from the first shards). Each island reads the whole corpus, so
  reading costs num_islands times as much as iid; the clusters are disjoint.
- "clustered_balanced": the same, with per-centroid offsets fitted on the
  sample so that each cluster holds about 1/num_islands of its tokens.
Each island visits its shards in a seeded order, new every epoch:
np.random.default_rng([seed, island, epoch]).permutation.

Resuming: an island's state is the position of the first token it has not
yet emitted: (epoch, shard_position, offset of the document inside the
shard, token_offset inside that document's tokens + EOS). Restoring re-reads
that document and drops the tokens before token_offset, which reproduces the
uninterrupted stream exactly and keeps the state a few integers (the packed
tokens left over are recomputed, not stored). Restoring a gzip shard reads it
from its start up to the offset.
"""
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from diloco_jax.data import clustering
from diloco_jax.data import errors
from diloco_jax.data import packing

_STATE_KEYS = ("epoch", "shard_position", "offset", "token_offset")


class DocumentShards(Protocol):
  """Documents in shards; a document is addressed by (shard, offset)."""

  @property
  def num_shards(self) -> int:
    ...

  def read(self, shard: int, start: int = 0) -> Iterator[tuple[int, str]]:
    """Yields (offset, text) for the shard's documents at offsets >= start."""
    ...


class Tokenizer(Protocol):
  eos_id: int

  def encode(self, text: bytes | str) -> np.ndarray:
    ...


class Clusters(NamedTuple):
  """How a stream's documents are split among islands.

  Attributes:
    centroids: [k, buckets] k-means centroids of hashed n-gram features.
    offsets: [k] added to each centroid's distance (balanced clusters), or
      None (plain nearest centroid).
    token_shares: [k] each cluster's share of the sample's tokens, sum 1.
  """
  centroids: np.ndarray
  offsets: np.ndarray | None
  token_shares: np.ndarray


class _IslandStream:
  """One island's endless token stream over its shards, with its position."""

  def __init__(self, documents: DocumentShards, shards: Sequence[int],
               island: int, seed: int, tokenizer: Tokenizer,
               keep: Callable[[str], bool] | None):
    self._documents = documents
    self._shards = np.asarray(shards, dtype=np.int64)
    self._island = island
    self._seed = seed
    self._tokenizer = tokenizer
    self._keep = keep
    self.reading_shard = int(self._shards[0]) if self._shards.size else -1
    self.restore({key: 0 for key in _STATE_KEYS})

  def _documents_from(self, epoch: int, shard_position: int, offset: int):
    """Yields (epoch, shard_position, offset, tokens + EOS) forever."""
    while True:
      found_any = False
      order = shard_order(self._shards, self._seed, self._island,
                          epoch)
      for position in range(shard_position, order.size):
        self.reading_shard = int(order[position])  # for a stall's message
        for doc_offset, text in self._documents.read(self.reading_shard,
                                                     offset):
          if self._keep is not None and not self._keep(text):
            continue
          found_any = True
          tokens = np.append(self._tokenizer.encode(text),
                             np.uint16(self._tokenizer.eos_id))
          yield epoch, position, doc_offset, tokens.astype(np.uint16)
        offset = 0
      if not found_any and shard_position == 0:
        # A whole epoch without a document would loop forever.
        raise errors.DataError(
            f"config.data: island {self._island} found no documents in its "
            f"{self._shards.size} shard(s)")
      epoch, shard_position = epoch + 1, 0

  def take(self, count: int) -> np.ndarray:
    """The next `count` tokens of the stream, [count] uint16."""
    pieces = []
    while count > 0:
      if self._cursor >= self._tokens.size:
        (self._epoch, self._shard_position, self._offset,
         self._tokens) = next(self._stream)
        # The first document after a restore is the one the state points
        # into; its first token_offset tokens were emitted before.
        self._cursor = (self._restored["token_offset"]
                        if self._just_restored else 0)
        self._just_restored = False
        continue
      piece = self._tokens[self._cursor:self._cursor + count]
      self._cursor += piece.size
      count -= piece.size
      pieces.append(piece)
    return np.concatenate(pieces) if pieces else np.empty(0, np.uint16)

  def state(self) -> dict:
    """The position of the next token, as plain ints."""
    if self._just_restored:  # nothing read since: that position holds
      return dict(self._restored)
    return {"epoch": self._epoch, "shard_position": self._shard_position,
            "offset": self._offset, "token_offset": self._cursor}

  def restore(self, state: dict) -> None:
    """Continues from a position `state()` returned."""
    missing = [key for key in _STATE_KEYS if key not in state]
    if missing:
      raise errors.DataError(f"data state lacks {', '.join(missing)}")
    values = {key: int(state[key]) for key in _STATE_KEYS}
    if values["shard_position"] >= max(self._shards.size, 1):
      raise errors.DataError(
          f"data state shard_position {values['shard_position']} is beyond "
          f"island {self._island}'s {self._shards.size} shards")
    self._restored = values
    self._stream = self._documents_from(values["epoch"],
                                        values["shard_position"],
                                        values["offset"])
    self._epoch, self._shard_position = values["epoch"], values[
        "shard_position"]
    self._offset, self._cursor = values["offset"], 0
    self._tokens = np.empty(0, np.uint16)
    self._just_restored = True


class StreamingIslandBatches:
  """Batches [islands, batch_size, sequence_length + 1] from a stream.

  Implements the batch-source protocol of `sources`: next_batch, state,
  restore, island_token_weights. With `islands` (a process's own, in a
  multi-process run) only those islands' streams are read; their batches
  and positions are those a single process would have for them.
  """

  def __init__(self, documents: DocumentShards, num_islands: int,
               batch_size: int, sequence_length: int, tokenizer: Tokenizer,
               seed: int, clusters: Clusters | None = None,
               islands: range | None = None):
    if num_islands < 1 or batch_size < 1:
      raise ValueError(f"num_islands ({num_islands}) and batch_size "
                       f"({batch_size}) must be positive")
    self._num_islands = num_islands
    self._batch_size = batch_size
    self._chunk_length = sequence_length + 1
    if clusters is None:
      owned = iid_shards(documents.num_shards, num_islands)
      keeps = [None] * num_islands
    else:
      owned = [range(documents.num_shards)] * num_islands
      keeps = [_cluster_filter(clusters, island)
               for island in range(num_islands)]
    self._documents = documents
    self._held = range(num_islands) if islands is None else islands
    self._islands = [
        _IslandStream(documents, owned[island], island, seed, tokenizer,
                      keeps[island]) for island in self._held]
    # iid shards are statistically alike and every island reads the same
    # number of tokens per step: equal weights.
    self._token_weights = (np.full(num_islands, 1.0 / num_islands)
                           if clusters is None else
                           np.asarray(clusters.token_shares, np.float64))

  def next_batch(self) -> np.ndarray:
    """The next batch of every island held, int32."""
    per_island = self._batch_size * self._chunk_length
    return np.stack([
        island.take(per_island).reshape(self._batch_size, self._chunk_length)
        for island in self._islands]).astype(np.int32)

  def state(self) -> dict:
    """JSON-serializable: {"islands": [position of each island held]}."""
    return {"islands": [island.state() for island in self._islands]}

  def reading(self) -> str:
    """The shard each island held reads now, for messages."""
    paths = getattr(self._documents, "paths", None)
    return "; ".join(
        f"island {number}: "
        + (str(paths[island.reading_shard]) if paths is not None
           else f"shard {island.reading_shard}")
        for number, island in zip(self._held, self._islands))

  def restore(self, state: dict) -> None:
    """Continues exactly where the source that returned `state` was.

    `state` lists every island's position (as a checkpoint holds them: a
    multi-process run merges its processes' states before saving), or those
    of the islands held (as `state()` gives them); the islands held take
    theirs.
    """
    islands = held_positions(state, self._num_islands, self._held)
    for island, island_state in zip(self._islands, islands):
      island.restore(island_state)

  def island_token_weights(self) -> np.ndarray:
    """[num_islands] float64 summing to 1: each island's share of tokens.

    iid: 1 / num_islands. clustered: each cluster's share of the tokens of
    the sample the centroids were fitted on (an estimate of its share of the
    corpus).
    """
    return self._token_weights.copy()


def iid_shards(num_shards: int, num_islands: int) -> list[range]:
  """The shards each island owns under island_split 'iid': island i those
  with index % num_islands == i; DataError when an island would get none."""
  if num_shards < num_islands:
    raise errors.DataError(
        f"config.data.path: {num_shards} train shard(s) for {num_islands} "
        f"islands; island_split 'iid' gives each island its own shards, so "
        f"at least {num_islands} are needed")
  return [range(island, num_shards, num_islands)
          for island in range(num_islands)]


def shard_order(shards: np.ndarray, seed: int, island: int, epoch: int
                ) -> np.ndarray:
  """The order in which an island visits its shards in an epoch: seeded by
  (seed, island, epoch), so a restart recomputes it from its position."""
  rng = np.random.default_rng([seed, island, epoch])
  return shards[rng.permutation(shards.size)]


def held_positions(state: dict, num_islands: int, held: range) -> list:
  """The positions of the islands `held` in a saved {"islands": [...]}.

  `state` lists every island's position (as a checkpoint holds them: a
  multi-process run merges its processes' states before saving) or only
  those held (as a source's `state()` gives them); DataError otherwise.
  """
  islands = state.get("islands") if isinstance(state, dict) else None
  if isinstance(islands, list) and len(islands) == num_islands:
    islands = islands[held.start:held.stop]
  if not isinstance(islands, list) or len(islands) != len(held):
    raise errors.DataError(
        f"data state holds {len(islands) if isinstance(islands, list) else 0}"
        f" island positions, expected {num_islands} (was the number of "
        f"islands changed?)")
  return islands


def _cluster_filter(clusters: Clusters, island: int
                    ) -> Callable[[str], bool]:
  def keep(text: str) -> bool:
    features = clustering.hashed_ngram_features(
        [text.encode("utf-8")], num_buckets=clusters.centroids.shape[1])
    return int(clustering.assign(features, clusters.centroids,
                                 clusters.offsets)[0]) == island
  return keep


def fit_clusters(documents: DocumentShards, num_islands: int, seed: int,
                 tokenizer: Tokenizer, sample_documents: int,
                 balanced: bool = False) -> Clusters:
  """k-means clusters of the first documents, balanced by tokens if asked.

  The sample is the first `sample_documents` documents of the shards in
  index order (shard 0 first): fixed, so every restart fits the same
  clusters.
  """
  texts = []
  for shard in range(documents.num_shards):
    for _, text in documents.read(shard):
      texts.append(text)
      if len(texts) == sample_documents:
        break
    if len(texts) == sample_documents:
      break
  if len(texts) < num_islands:
    raise errors.DataError(
        f"config.data.island_split: the train shards hold {len(texts)} "
        f"documents, fewer than {num_islands} islands")
  encoded = [text.encode("utf-8") for text in texts]
  tokens = np.array([tokenizer.encode(text).size + 1 for text in texts],
                    dtype=np.float64)  # + EOS
  features = clustering.hashed_ngram_features(encoded)
  centroids = clustering.kmeans(features, num_islands, seed)
  offsets = (clustering.balance_offsets(features, centroids, tokens)
             if balanced else None)
  labels = clustering.assign(features, centroids, offsets)
  token_counts = np.bincount(labels, weights=tokens, minlength=num_islands)
  empty = np.flatnonzero(token_counts == 0)
  if empty.size:
    raise errors.DataError(
        f"config.data.island_split: clusters {empty.tolist()} got no "
        f"document of the {len(texts)}-document sample; the corpus has "
        f"fewer than {num_islands} distinct kinds")
  return Clusters(centroids, offsets, token_counts / token_counts.sum())


def eval_sequences(documents: DocumentShards, tokenizer: Tokenizer,
                   sequence_length: int, num_sequences: int) -> np.ndarray:
  """The first `num_sequences` packed sequences of the shards, in order.

  Reads shard 0, 1, ... only as far as needed; [num_sequences, L+1] uint16.
  """
  needed_tokens = num_sequences * (sequence_length + 1)
  pieces, total = [], 0
  for shard in range(documents.num_shards):
    for _, text in documents.read(shard):
      tokens = tokenizer.encode(text)
      pieces.append(tokens)
      total += tokens.size + 1
      if total >= needed_tokens:
        break
    if total >= needed_tokens:
      break
  packed = packing.pack_documents(pieces, tokenizer.eos_id, sequence_length)
  if packed.shape[0] < num_sequences:
    raise errors.DataError(
        f"config.eval: eval needs {num_sequences} sequences of "
        f"{sequence_length + 1} tokens, but the validation split holds only "
        f"{packed.shape[0]}")
  return packed[:num_sequences]
