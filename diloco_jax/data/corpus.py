"""Building a packed, split corpus from the data settings.

`build_corpus` returns the train and validation sequences of an in-memory
corpus; `build_island_sequences` splits the train documents into clusters,
one per island, for non-iid training. Both take DataSettings (settings.py),
or a config.data they check first. The "c4" corpus is streamed instead
(see `sources`).
"""
import dataclasses
import sys

import numpy as np

from diloco_jax.data import clustering
from diloco_jax.data import embedded
from diloco_jax.data import errors
from diloco_jax.data import file_split
from diloco_jax.data import packing
from diloco_jax.data import settings as settings_lib
from diloco_jax.data import synthetic
from diloco_jax.data import text_files
from diloco_jax.data import tokenizer as tokenizer_lib


# Distinct seed streams for the synthetic chain's matrix and its validation
# documents; train documents use the plain seed. Tags are non-zero because
# numpy's SeedSequence treats [seed, 0] like [seed].
_MATRIX_STREAM = 1
_VALIDATION_STREAM = 2


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Packed sequences, [num_sequences, sequence_length + 1] uint16 each.

  entropy_rate (nats per token) is known for the synthetic corpus only. It is
  the chain's rate; the EOS separators add roughly one less predictable token
  per document, which long documents make negligible.
  """
  train: np.ndarray
  validation: np.ndarray
  vocab_size: int
  eos_id: int
  name: str
  entropy_rate: float | None = None


@dataclasses.dataclass(frozen=True)
class _Documents:
  """A corpus before packing.

  Documents are bytes (text, tokenized by config.data.tokenizer) or uint16
  token arrays (synthetic, tokenized already). validation None means "hold
  out the last sequences of train" (a corpus of one file).
  """
  train: list
  validation: list | None
  name: str
  vocab_size: int | None = None  # set when the documents are token ids
  eos_id: int | None = None
  entropy_rate: float | None = None


def build_corpus(data_config) -> Corpus:
  """Builds the in-memory corpus that `data_config` names (DataSettings, or
  config.data, checked first: DataError).

  Corpora: "embedded" (the Python stdlib sources), "synthetic" (a Markov
  chain with a known entropy rate) and "text_files" (files under
  config.data.path); text is tokenized by config.data.tokenizer.
  """
  data_config = settings_lib.of(data_config)
  _refuse_streamed(data_config)
  documents = _read_documents(data_config)
  encode, vocab_size, eos_id = _encoder(data_config, documents)
  sequence_length = data_config.sequence_length
  train = packing.pack_documents(map(encode, documents.train), eos_id,
                                 sequence_length)
  if documents.validation is None:
    # One file cannot be split by file: its last sequences become validation.
    num_validation = max(1, round(data_config.validation_fraction *
                                  train.shape[0]))
    train, validation = train[:-num_validation], train[-num_validation:]
  else:
    validation = packing.pack_documents(map(encode, documents.validation),
                                        eos_id, sequence_length)
  corpus = Corpus(train=train, validation=validation, vocab_size=vocab_size,
                  eos_id=eos_id, name=documents.name,
                  entropy_rate=documents.entropy_rate)
  for split in ("train", "validation"):
    if getattr(corpus, split).shape[0] == 0:
      raise errors.DataError(
          f"config.data: the {split} split of corpus {corpus.name!r} holds "
          f"fewer than sequence_length + 1 = {sequence_length + 1} tokens")
  return corpus


def build_island_sequences(data_config, num_islands: int, seed: int
                           ) -> list[np.ndarray]:
  """The train split clustered into `num_islands` disjoint parts, packed.

  Train documents are clustered on hashed byte (or, for synthetic, token)
  n-gram features with k-means (k = num_islands, seeded by `seed`), for
  island_split 'clustered_balanced' with the clusters' boundaries moved so
  that each holds about 1/num_islands of the tokens; island i's documents
  are packed, in corpus order, into its own sequences. Returns one
  [num_sequences_i, L+1] uint16 array per island.
  """
  data_config = settings_lib.of(data_config)
  _refuse_streamed(data_config)
  documents = _read_documents(data_config)
  split = data_config.island_split
  if documents.validation is None:
    raise errors.DataError(
        f"config.data.island_split={split!r} needs a corpus of several "
        "documents; config.data.path names a single file")
  if len(documents.train) < num_islands:
    raise errors.DataError(
        f"config.data.island_split={split!r}: {len(documents.train)} train "
        f"documents cannot form {num_islands} clusters")
  encode, _, eos_id = _encoder(data_config, documents)
  encoded = [encode(document) for document in documents.train]
  tokens = None
  if split == "clustered_balanced":
    tokens = np.array([ids.size + 1 for ids in encoded], np.float64)  # + EOS
  labels = clustering.cluster_documents(documents.train, num_islands, seed,
                                        weights=tokens)
  return [
      packing.pack_documents(
          (ids for ids, label in zip(encoded, labels) if label == island),
          eos_id, data_config.sequence_length)
      for island in range(num_islands)]


def corpus_vocab_size(data_config) -> int:
  """The token vocabulary `data_config` implies, known without reading data
  (DataSettings.vocab_size; a config.data is checked first: DataError)."""
  return settings_lib.of(data_config).vocab_size


def _refuse_streamed(data_config: settings_lib.DataSettings) -> None:
  if data_config.streamed:
    raise errors.DataError(
        f"config.data.corpus={data_config.corpus!r} is streamed, not held in "
        f"memory; use sources.make_batch_source")


def _encoder(data_config, documents: _Documents):
  """(encode, vocab_size, eos_id) for the documents' kind."""
  if documents.vocab_size is not None:  # token ids already
    return (lambda document: document), documents.vocab_size, documents.eos_id
  tokenizer = tokenizer_lib.build_tokenizer(data_config)
  return tokenizer.encode, tokenizer.vocab_size, tokenizer.eos_id


def _read_documents(data_config) -> _Documents:
  readers = {
      "embedded": _embedded_documents,
      "synthetic": _synthetic_documents,
      "text_files": _text_files_documents,
  }
  return readers[data_config.corpus](data_config)


def _embedded_documents(data_config) -> _Documents:
  fraction = data_config.validation_fraction
  version = f"{sys.version_info.major}.{sys.version_info.minor}"
  return _Documents(
      train=list(embedded.read_documents(
          embedded.stdlib_source_files("train", fraction))),
      validation=list(embedded.read_documents(
          embedded.stdlib_source_files("validation", fraction))),
      name=f"embedded (Python {version} stdlib sources)")


def _synthetic_documents(data_config) -> _Documents:
  synthetic_config = data_config.synthetic
  seed = data_config.seed
  source = synthetic.MarkovSource(synthetic_config.vocab_size,
                                  synthetic_config.concentration,
                                  seed=[seed, _MATRIX_STREAM])
  train = source.sample_documents(synthetic_config.num_documents,
                                  synthetic_config.document_length, seed=seed)
  validation = source.sample_documents(
      synthetic_config.validation_documents, synthetic_config.document_length,
      seed=[seed, _VALIDATION_STREAM])
  return _Documents(
      train=list(train), validation=list(validation),
      name=(f"synthetic (order-1 Markov, {synthetic_config.vocab_size} "
            f"symbols, concentration {synthetic_config.concentration})"),
      vocab_size=synthetic_config.vocab_size + 1,
      eos_id=synthetic_config.vocab_size,
      entropy_rate=source.entropy_rate())


def _text_files_documents(data_config) -> _Documents:
  root, relative_paths = text_files.resolve_text_files(data_config.path)
  text_files.check_text(root, relative_paths, data_config.path)
  name = f"text_files ({data_config.path})"
  if len(relative_paths) == 1:
    return _Documents(
        train=list(embedded.read_documents([root / relative_paths[0]],
                                           skip_unreadable=False)),
        validation=None, name=name)
  validation_indices = file_split.select_split(
      relative_paths, "validation", data_config.validation_fraction)
  if len(validation_indices) in (0, len(relative_paths)):
    # The hash put every file on one side; keep both splits non-empty.
    validation_indices = [len(relative_paths) - 1]
  is_validation = np.zeros(len(relative_paths), dtype=bool)
  is_validation[validation_indices] = True
  return _Documents(
      train=list(embedded.read_documents(
          [root / path for path, held_out in zip(relative_paths, is_validation)
           if not held_out], skip_unreadable=False)),
      validation=list(embedded.read_documents(
          [root / path for path, held_out in zip(relative_paths, is_validation)
           if held_out], skip_unreadable=False)),
      name=name)
