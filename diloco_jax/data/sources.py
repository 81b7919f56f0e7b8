"""The batch-source protocol the training loop uses, and its factories.

Every corpus, in memory or streamed, gives the loop the same object:

  source = make_batch_source(config.data, num_islands, batch_size, seed)
  batch = source.next_batch()        # [islands, batch, L+1] int32
  saved = source.state()             # JSON-serializable dict
  source.restore(saved)              # continue exactly from there
  weights = source.island_token_weights()   # [islands] float, sums to 1
  source.info                        # SourceInfo: name, vocab, EOS, ...
  close(source)                      # stops its read-ahead thread, if any

and `make_eval_batches(config.data, batch_size, num_batches)` gives the fixed
held-out set. In-memory corpora (embedded, synthetic, text_files) keep their
batches a pure function of the step, so their state is just {"step": s}; the
streamed C4 corpus keeps each island's read position (see
`sharded_batches`), and a pre-tokenized corpus ("tokens") each island's
position in its shards (see `token_batches`).

The streamed corpus is tokenized as it is read, and a prepared one
checks each shard's checksum as it first opens it, in a thread that keeps
a few batches ready (`read_ahead.ReadAhead`; a read that stalls for
config.data.read_timeout_s is one error naming its files, and
`interrupt_waits` lets a stop end the wait); in-memory batches take
microseconds and are built when asked for.

`seed` orders the batches and seeds the k-means of clustered islands;
config.data.seed builds the corpus (the synthetic chain).
"""
import dataclasses
from typing import Protocol

import numpy as np

from diloco_jax.data import c4_files
from diloco_jax.data import corpus as corpus_lib
from diloco_jax.data import errors
from diloco_jax.data import in_memory_batches
from diloco_jax.data import read_ahead
from diloco_jax.data import settings as settings_lib
from diloco_jax.data import sharded_batches
from diloco_jax.data import tfds_documents
from diloco_jax.data import token_batches
from diloco_jax.data import token_shards
from diloco_jax.data import tokenizer as tokenizer_lib

# Documents sampled from the first train shards to fit streaming centroids:
# enough for k-means over a handful of kinds, quick to read at startup.
CENTROID_SAMPLE_DOCUMENTS = 4096


@dataclasses.dataclass(frozen=True)
class SourceInfo:
  """What the loop reports about its data."""
  name: str
  vocab_size: int
  eos_id: int
  island_split: str
  entropy_rate: float | None = None  # nats per token, synthetic only


class BatchSource(Protocol):
  """A resumable stream of batches for all islands."""

  info: SourceInfo

  def next_batch(self) -> np.ndarray:
    """The next batch of every island: [islands, batch, L+1] int32."""
    ...

  def state(self) -> dict:
    """A JSON-serializable position; `restore` of it continues from here."""
    ...

  def restore(self, state: dict) -> None:
    """Continues as the source that returned `state` would have."""
    ...

  def island_token_weights(self) -> np.ndarray:
    """[islands] float64, summing to 1: each island's share of the tokens."""
    ...


class InMemoryBatchSource:
  """Step-indexed batches (IslandBatches or ClusteredIslandBatches)."""

  def __init__(self, batches, token_weights: np.ndarray, info: SourceInfo):
    self._batches = batches
    self._token_weights = np.asarray(token_weights, dtype=np.float64)
    self._step = 0
    self.info = info

  def next_batch(self) -> np.ndarray:
    batch = self._batches.batch(self._step)
    self._step += 1
    return batch

  def state(self) -> dict:
    return {"step": self._step}

  def restore(self, state: dict) -> None:
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
      raise errors.DataError(f"data state must be {{'step': int >= 0}}, got "
                             f"{state!r}")
    self._step = step

  def island_token_weights(self) -> np.ndarray:
    """Each island's share of the train tokens it samples from.

    iid: every island samples the whole corpus, 1 / islands each.
    clustered (balanced or not): island i's cluster tokens / all train
    tokens, so that the token-weighted outer average weighs each cluster as
    much as the corpus holds of it.
    """
    return self._token_weights.copy()


def make_batch_source(data_config, num_islands: int, batch_size: int,
                      seed: int, islands: range | None = None
                      ) -> BatchSource:
  """The batch source of `data_config` (DataSettings, or config.data,
  checked first: DataError).

  With `islands` (a consecutive range: a process's own islands in a
  multi-process run) batches hold only those islands' rows, the same rows
  the source of all islands gives them; token weights still cover all.
  A streamed corpus reads its first batch here too, so an unreadable first
  shard fails before the training step is compiled.
  """
  data_config = settings_lib.of(data_config)
  split = data_config.island_split
  if data_config.corpus == "tokens":
    return _token_source(data_config, num_islands, batch_size, seed, islands)
  if data_config.streamed:
    return _streaming_source(data_config, num_islands, batch_size, seed,
                             split, islands)
  corpus = _cached_corpus(data_config)
  if split == "iid":
    batches = in_memory_batches.IslandBatches(
        corpus.train, num_islands, batch_size, seed=seed, islands=islands)
    weights = np.full(num_islands, 1.0 / num_islands)
  else:
    island_sequences = corpus_lib.build_island_sequences(
        data_config, num_islands, seed)
    batches = in_memory_batches.ClusteredIslandBatches(
        island_sequences, batch_size, seed=seed, islands=islands)
    tokens = np.array([sequences.size for sequences in island_sequences],
                      dtype=np.float64)
    weights = tokens / tokens.sum()
  info = SourceInfo(name=corpus.name, vocab_size=corpus.vocab_size,
                    eos_id=corpus.eos_id, island_split=split,
                    entropy_rate=corpus.entropy_rate)
  return InMemoryBatchSource(batches, weights, info)


def make_eval_batches(data_config, batch_size: int,
                      num_batches: int) -> np.ndarray:
  """The fixed held-out batches, [num_batches, batch_size, L+1] int32.

  In-memory corpora: the first sequences of the validation split. C4: the
  first sequences packed from the validation shards (or TFDS split
  "validation"), read in order and only as far as needed; tokens: the first
  tokens of the prepared validation shards, the same sequences.
  """
  data_config = settings_lib.of(data_config)
  if data_config.corpus == "tokens":
    return token_batches.eval_sequences(
        token_shards.read_index(data_config.path),
        data_config.sequence_length, batch_size * num_batches
    ).reshape(num_batches, batch_size, -1)
  if not data_config.streamed:
    corpus = _cached_corpus(data_config)
    return in_memory_batches.eval_batches(corpus.validation, batch_size,
                                          num_batches)
  documents = _c4_documents(data_config, "validation", min_shards=1)
  sequences = sharded_batches.eval_sequences(
      documents, tokenizer_lib.build_tokenizer(data_config),
      data_config.sequence_length, batch_size * num_batches)
  return sequences.reshape(num_batches, batch_size, -1).astype(np.int32)


_corpus_cache: dict = {}


def _cached_corpus(data_config: settings_lib.DataSettings
                   ) -> corpus_lib.Corpus:
  """build_corpus, remembered for the last settings only.

  make_batch_source and make_eval_batches both need the corpus of one
  config; building it once halves the startup time of in-memory corpora.
  """
  if data_config not in _corpus_cache:
    _corpus_cache.clear()
    _corpus_cache[data_config] = corpus_lib.build_corpus(data_config)
  return _corpus_cache[data_config]


def _c4_documents(data_config, split: str, min_shards: int):
  """The train or validation documents of the c4 corpus.

  The first lines of every JSON-lines shard of the split are parsed here,
  so a malformed shard fails before anything compiles, whichever island
  or epoch would reach it.
  """
  tfds_name = data_config.tfds_name
  if tfds_name:
    return tfds_documents.TfdsRecords(tfds_name, data_config.path, split,
                                      min_shards=min_shards)
  train, validation = c4_files.split_shards(
      data_config.path, data_config.validation_fraction,
      hold_out=data_config.hold_out_shards)
  paths = train if split == "train" else validation
  c4_files.check_first_lines(paths)
  return c4_files.ShardFiles(paths)


def _c4_name(data_config) -> str:
  tfds_name = data_config.tfds_name
  if tfds_name:
    return f"c4 (TFDS {tfds_name}, data_dir {data_config.path or 'default'})"
  return f"c4 ({data_config.path})"


def _streaming_source(data_config, num_islands: int, batch_size: int,
                      seed: int, split: str, islands: range | None
                      ) -> BatchSource:
  tokenizer = tokenizer_lib.build_tokenizer(data_config)
  documents = _c4_documents(data_config, "train", min_shards=num_islands)
  clusters = None
  if split != "iid":
    clusters = sharded_batches.fit_clusters(
        documents, num_islands, seed, tokenizer, CENTROID_SAMPLE_DOCUMENTS,
        balanced=split == "clustered_balanced")
  source = sharded_batches.StreamingIslandBatches(
      documents, num_islands, batch_size, data_config.sequence_length,
      tokenizer, seed, clusters=clusters, islands=islands)
  source.info = SourceInfo(name=_c4_name(data_config),
                           vocab_size=tokenizer.vocab_size,
                           eos_id=tokenizer.eos_id, island_split=split)
  _read_first_batch(source)
  # Tokenizing on the fly costs host time per batch: a thread reads ahead.
  return read_ahead.ReadAhead(source, wait_limit_s=data_config.read_timeout_s)


def _token_source(data_config, num_islands: int, batch_size: int, seed: int,
                  islands: range | None) -> BatchSource:
  """The batches of a prepared corpus (checked with the settings: its
  shards are there, whole, and of the run's tokenizer)."""
  index = token_shards.read_index(data_config.path)
  source = token_batches.TokenIslandBatches(
      index, num_islands, batch_size, data_config.sequence_length, seed,
      islands=islands)
  source.info = SourceInfo(name=f"tokens ({data_config.path}: {index.source})",
                           vocab_size=index.vocab_size, eos_id=index.eos_id,
                           island_split=data_config.island_split)
  # Each island's first shard is checked whole here, before the workdir.
  _read_first_batch(source)
  # The checksums of the shards opened later are read in the thread.
  return read_ahead.ReadAhead(source, wait_limit_s=data_config.read_timeout_s)


def interrupt_waits(source: BatchSource, predicate) -> None:
  """Makes a next_batch of `source` that waits for a read end at once
  (read_ahead.WaitInterrupted) when `predicate()` turns true; in-memory
  sources never wait."""
  if isinstance(source, read_ahead.ReadAhead):
    source.interrupt_when(predicate)


def close(source: BatchSource) -> None:
  """Stops what `source` reads in the background (a streamed corpus's
  read-ahead thread); the source is not used after."""
  if isinstance(source, read_ahead.ReadAhead):
    source.close()


def _read_first_batch(source: BatchSource) -> None:
  """Reads one batch and rewinds to the start.

  Shards are read lazily, and the training loop takes its first batch only
  after the checkpoint is restored and compilation has started: a shard
  that is not gzip, not JSON lines or has no "text" field should fail now,
  before any compile, in one line naming the file. Costs one batch of
  reading; the rewind re-reads it from the same position.
  """
  start = source.state()
  source.next_batch()
  source.restore(start)
