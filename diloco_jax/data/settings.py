"""config.data checked once, as the typed settings the pipeline reads.

`from_config(config.data)` checks every field cheaply (no corpus is read; a
SentencePiece model file is loaded, since it is small and gives the
vocabulary) and returns a frozen `DataSettings`. The pipeline's entry
points (sources.make_batch_source, make_eval_batches, corpus.build_corpus)
take DataSettings as they are; given a plain config.data instead (tests,
notebooks) they build the settings first, so bad input always fails in one
line naming the field, and a run checks it once.
"""

import dataclasses

from absl import logging
import numpy as np

from diloco_jax.data import c4_files
from diloco_jax.data import errors
from diloco_jax.data import text_files
from diloco_jax.data import tfds_documents
from diloco_jax.data import token_shards
from diloco_jax.data import tokenizer as tokenizer_lib

CORPORA = ("embedded", "synthetic", "text_files", "c4", "tokens")
# Not held in memory: read shard by shard (c4 tokenized, tokens by position).
STREAMED_CORPORA = ("c4", "tokens")
# A config written before config.data.read_timeout_s existed waits this.
DEFAULT_READ_TIMEOUT_S = 300.0
# "clustered_balanced": the same clusters with boundaries moved so that each
# holds about 1/k of the tokens (clustering.balance_offsets).
ISLAND_SPLITS = ("iid", "clustered", "clustered_balanced")


@dataclasses.dataclass(frozen=True)
class SyntheticSettings:
  """config.data.synthetic: the Markov-chain corpus (synthetic.py)."""
  vocab_size: int
  concentration: float
  num_documents: int
  document_length: int
  validation_documents: int


@dataclasses.dataclass(frozen=True)
class DataSettings:
  """A checked config.data: the fields the pipeline reads (see
  config/schema.py for their meaning), and the corpus vocabulary.

  Attributes:
    vocab_size: token ids the corpus uses, EOS included (the synthetic
      chain's symbols, or the tokenizer's vocabulary).
  """
  corpus: str
  path: str
  tfds_name: str
  tokenizer: str
  tokenizer_path: str
  island_split: str
  sequence_length: int
  validation_fraction: float
  seed: int
  synthetic: SyntheticSettings
  vocab_size: int
  read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
  hold_out_shards: bool = False

  @property
  def streamed(self) -> bool:
    """Whether the corpus is streamed from shards, not held in memory."""
    return self.corpus in STREAMED_CORPORA


def from_config(data_config) -> DataSettings:
  """The DataSettings of config.data, checked (DataError naming the field).

  Reads no corpus; a SentencePiece model file is loaded to check it.
  """
  tokenizer = _check(data_config)
  synthetic = data_config.synthetic
  return DataSettings(
      corpus=data_config.corpus,
      path=data_config.get("path") or "",
      tfds_name=data_config.get("tfds_name") or "",
      tokenizer=tokenizer_lib.tokenizer_name(data_config),
      tokenizer_path=data_config.get("tokenizer_path") or "",
      island_split=_island_split(data_config),
      sequence_length=data_config.sequence_length,
      validation_fraction=data_config.validation_fraction,
      seed=data_config.seed,
      synthetic=SyntheticSettings(**{
          field.name: synthetic[field.name]
          for field in dataclasses.fields(SyntheticSettings)}),
      vocab_size=(synthetic.vocab_size + 1 if tokenizer is None  # + EOS
                  else tokenizer.vocab_size),
      read_timeout_s=float(data_config.get("read_timeout_s",
                                                DEFAULT_READ_TIMEOUT_S)),
      hold_out_shards=hold_out_shards(data_config))


def hold_out_shards(data_config) -> bool:
  """config.data.hold_out_shards, False when the field is absent (a config
  written before it existed)."""
  return bool(data_config.get("hold_out_shards", False))


def of(data) -> DataSettings:
  """`data` if it is DataSettings already, else from_config(data)."""
  return data if isinstance(data, DataSettings) else from_config(data)


def validate_data_config(data_config) -> None:
  """Raises DataError naming the bad field of config.data; reads no corpus.

  A SentencePiece model file is loaded (it is small) to check it.
  """
  _check(data_config)


def _check(data_config) -> tokenizer_lib.Tokenizer | None:
  """validate_data_config's checks; returns the tokenizer (None for the
  synthetic corpus, which is made of token ids already)."""
  corpus = _field(data_config, "corpus")
  if corpus not in CORPORA:
    raise errors.DataError(f"config.data.corpus={corpus!r} is not one of "
                           f"{', '.join(repr(name) for name in CORPORA)}")
  _check_int(data_config, "sequence_length", minimum=1)
  _check_int(data_config, "seed", minimum=0)
  fraction = _field(data_config, "validation_fraction")
  if not 0 < fraction < 1:
    raise errors.DataError(f"config.data.validation_fraction must be in "
                           f"(0, 1), got {fraction!r}")
  timeout = data_config.get("read_timeout_s", DEFAULT_READ_TIMEOUT_S)
  if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
      or not timeout > 0):
    raise errors.DataError(f"config.data.read_timeout_s must be a number of "
                           f"seconds > 0, got {timeout!r}")
  split = _island_split(data_config)
  if split not in ISLAND_SPLITS:
    raise errors.DataError(
        f"config.data.island_split={split!r} is not one of "
        f"{', '.join(repr(name) for name in ISLAND_SPLITS)}")
  if corpus == "text_files":
    path = data_config.get("path") or ""
    if not path:
      raise errors.DataError(
          "config.data.path is required for corpus 'text_files'")
    problem = text_files.path_problem(path)
    if problem:
      raise errors.DataError(f"config.data.path: {problem}")
  elif corpus == "synthetic":
    _check_synthetic(data_config)
    if tokenizer_lib.tokenizer_name(data_config) != "byte":
      raise errors.DataError(
          "config.data.tokenizer: the synthetic corpus is made of token ids "
          "already; leave the tokenizer at 'byte'")
    return None
  elif corpus == "c4":
    _check_c4(data_config)
  elif corpus == "tokens":
    return _check_tokens(data_config, split)
  return tokenizer_lib.build_tokenizer(data_config)


def _island_split(data_config) -> str:
  """config.data.island_split, "iid" when the field is absent."""
  return data_config.get("island_split", "iid") or "iid"


def _check_c4(data_config) -> None:
  tfds_name = data_config.get("tfds_name", "") or ""
  path = data_config.get("path") or ""
  if tfds_name:
    # path is the TFDS data_dir; empty means TFDS's default directory.
    if not tfds_documents.tfds_available():
      raise errors.missing_package(f"config.data.tfds_name={tfds_name!r}",
                                   "tensorflow-datasets")
    return
  if not path:
    raise errors.DataError(
        "config.data.path is required for corpus 'c4' (a directory or glob "
        "of C4 JSON-lines shards, or a TFDS data_dir with "
        "config.data.tfds_name)")
  problem = c4_files.shards_problem(path)
  if problem:
    raise errors.DataError(f"config.data.path: {problem}")
  if not isinstance(data_config.get("hold_out_shards", False), bool):
    raise errors.DataError(
        f"config.data.hold_out_shards must be true or false, got "
        f"{data_config.get('hold_out_shards')!r}")
  hold_out = hold_out_shards(data_config)
  train, validation = c4_files.split_shards(
      path, data_config.validation_fraction, hold_out=hold_out)
  if not train:
    raise errors.DataError(f"config.data.path: every shard at {path!r} is "
                           f"named '*validation*'; no train shards are left")
  if hold_out and not any(c4_files.VALIDATION_MARKER in shard.name
                          for shard in validation):
    logging.info(
        "config.data.path: no shard is named '*%s*': %d of the %d shards "
        "held out for evaluation (config.data.hold_out_shards): %s",
        c4_files.VALIDATION_MARKER, len(validation),
        len(train) + len(validation),
        ", ".join(shard.name for shard in validation))


def _check_tokens(data_config, split: str) -> tokenizer_lib.Tokenizer:
  """The prepared corpus at config.data.path, checked against the run's
  tokenizer (token_shards.check: reads the index, stats the shards)."""
  path = data_config.get("path") or ""
  if not path:
    raise errors.DataError(
        "config.data.path is required for corpus 'tokens' (a directory "
        "python -m diloco_jax.data.prepare wrote)")
  if split != "iid":
    raise errors.DataError(
        f"config.data.island_split={split!r} clusters documents by their "
        f"text, which corpus 'tokens' does not keep; use 'iid' (or corpus "
        f"'c4' on the shards it was prepared from)")
  index = token_shards.read_index(path)
  # Shards of a vocabulary beyond uint16 hold uint32 ids.
  tokenizer = tokenizer_lib.build_tokenizer(
      data_config, max_vocab_size=tokenizer_lib.MAX_WIDE_VOCAB_SIZE)
  model_path = ((data_config.get("tokenizer_path") or "")
                if tokenizer_lib.tokenizer_name(data_config) == "sentencepiece"
                else "")
  token_shards.check(index,
                     token_shards.tokenizer_identity(tokenizer, model_path))
  return tokenizer


def _check_synthetic(data_config) -> None:
  synthetic_config = _field(data_config, "synthetic")
  # The EOS id is vocab_size, and every id must fit uint16.
  _check_int(synthetic_config, "vocab_size", minimum=1,
             maximum=np.iinfo(np.uint16).max, prefix="config.data.synthetic")
  concentration = _field(synthetic_config, "concentration",
                         prefix="config.data.synthetic")
  if not concentration > 0:
    raise errors.DataError(f"config.data.synthetic.concentration must be "
                           f"positive, got {concentration!r}")
  for name in ("num_documents", "document_length", "validation_documents"):
    _check_int(synthetic_config, name, minimum=1,
               prefix="config.data.synthetic")
  chunk_length = data_config.sequence_length + 1
  tokens_per_document = synthetic_config.document_length + 1
  for name in ("num_documents", "validation_documents"):
    tokens = synthetic_config[name] * tokens_per_document
    if tokens < chunk_length:
      raise errors.DataError(
          f"config.data.synthetic.{name}: {synthetic_config[name]} documents "
          f"hold {tokens} tokens, fewer than one sequence of "
          f"sequence_length + 1 = {chunk_length}")


def _field(config, name: str, prefix: str = "config.data"):
  if name not in config:
    raise errors.DataError(f"{prefix}.{name} is missing")
  return config[name]


def _check_int(config, name: str, minimum: int, maximum: int | None = None,
               prefix: str = "config.data") -> None:
  value = _field(config, name, prefix)
  # bool is an int subclass, but True is never a meaningful size.
  if (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
      or value < minimum or (maximum is not None and value > maximum)):
    bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    raise errors.DataError(f"{prefix}.{name} must be an integer {bounds}, "
                           f"got {value!r}")
