"""Building a packed, split corpus from `config.data`.

`build_corpus` is the one entry point the training loop needs; it returns
train and validation sequences ready for `streams`. `validate_data_config`
checks a config cheaply so that bad input fails at startup, in one line that
names the field.
"""
import dataclasses
import sys

import numpy as np

from diloco_jax.data import embedded
from diloco_jax.data import file_split
from diloco_jax.data import packing
from diloco_jax.data import synthetic
from diloco_jax.data import text_files
from diloco_jax.data import tokenizer as tokenizer_lib

CORPORA = ("embedded", "synthetic", "text_files", "c4")

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


def build_corpus(data_config) -> Corpus:
  """Builds the corpus that `data_config` (config.data) names.

  Corpora: "embedded" (the Python stdlib sources, byte tokens), "synthetic"
  (a Markov chain with a known entropy rate) and "text_files" (files under
  config.data.path, byte tokens).
  """
  validate_data_config(data_config)
  builders = {
      "embedded": _build_embedded,
      "synthetic": _build_synthetic,
      "text_files": _build_text_files,
  }
  corpus = builders[data_config.corpus](data_config)
  for split in ("train", "validation"):
    if getattr(corpus, split).shape[0] == 0:
      raise ValueError(
          f"config.data: the {split} split of corpus {corpus.name!r} holds "
          f"fewer than sequence_length + 1 = {data_config.sequence_length + 1} "
          f"tokens")
  return corpus


def corpus_vocab_size(data_config) -> int:
  """The token vocabulary `data_config` implies, known without reading data."""
  if data_config.corpus == "synthetic":
    return data_config.synthetic.vocab_size + 1  # + EOS
  return tokenizer_lib.ByteTokenizer.vocab_size


def validate_data_config(data_config) -> None:
  """Raises ValueError naming the bad field; reads no corpus."""
  corpus = _field(data_config, "corpus")
  if corpus not in CORPORA:
    raise ValueError(f"config.data.corpus={corpus!r} is not one of "
                     f"{', '.join(repr(name) for name in CORPORA)}")
  _check_int(data_config, "sequence_length", minimum=1)
  _check_int(data_config, "seed", minimum=0)
  fraction = _field(data_config, "validation_fraction")
  if not 0 < fraction < 1:
    raise ValueError(f"config.data.validation_fraction must be in (0, 1), "
                     f"got {fraction!r}")
  if corpus == "text_files":
    path = data_config.get("path") or ""
    if not path:
      raise ValueError("config.data.path is required for corpus 'text_files'")
    problem = text_files.path_problem(path)
    if problem:
      raise ValueError(f"config.data.path: {problem}")
  elif corpus == "synthetic":
    _validate_synthetic(data_config)
  elif corpus == "c4":
    if not data_config.get("path"):
      raise ValueError(
          "config.data.path is required for corpus 'c4' (a directory of C4 "
          "JSONL shards or a TFDS data_dir)")
    raise ValueError(
        "config.data.corpus='c4' needs the C4 loader, which is not built yet")


def _validate_synthetic(data_config) -> None:
  synthetic_config = _field(data_config, "synthetic")
  # The EOS id is vocab_size, and every id must fit uint16.
  _check_int(synthetic_config, "vocab_size", minimum=1,
             maximum=np.iinfo(np.uint16).max, prefix="config.data.synthetic")
  concentration = _field(synthetic_config, "concentration",
                         prefix="config.data.synthetic")
  if not concentration > 0:
    raise ValueError(f"config.data.synthetic.concentration must be positive, "
                     f"got {concentration!r}")
  for name in ("num_documents", "document_length", "validation_documents"):
    _check_int(synthetic_config, name, minimum=1,
               prefix="config.data.synthetic")
  chunk_length = data_config.sequence_length + 1
  tokens_per_document = synthetic_config.document_length + 1
  for name in ("num_documents", "validation_documents"):
    tokens = synthetic_config[name] * tokens_per_document
    if tokens < chunk_length:
      raise ValueError(
          f"config.data.synthetic.{name}: {synthetic_config[name]} documents "
          f"hold {tokens} tokens, fewer than one sequence of "
          f"sequence_length + 1 = {chunk_length}")


def _field(config, name: str, prefix: str = "config.data"):
  if name not in config:
    raise ValueError(f"{prefix}.{name} is missing")
  return config[name]


def _check_int(config, name: str, minimum: int, maximum: int | None = None,
               prefix: str = "config.data") -> None:
  value = _field(config, name, prefix)
  # bool is an int subclass, but True is never a meaningful size.
  if (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
      or value < minimum or (maximum is not None and value > maximum)):
    bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    raise ValueError(f"{prefix}.{name} must be an integer {bounds}, "
                     f"got {value!r}")


