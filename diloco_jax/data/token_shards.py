"""Pre-tokenized corpora on disk: token shards and the index that lists them.

A directory that `python -m diloco_jax.data.prepare` writes holds

  train-00000.bin, ...        token ids, little-endian uint16 (uint32 for a
  validation-00000.bin, ...   vocabulary beyond 65,536 ids), no header
  index.json                  written last, atomically: what a run reads

Each shard holds the tokens of its source's documents in order, each
document followed by EOS: the stream the c4 corpus tokenizes on the fly.
index.json names the format, the dtype, the tokenizer that made the tokens
(kind, vocabulary, EOS id and, for SentencePiece, the model's file name and
the sha256 of its bytes) and, per split, each shard's file, token count,
document count and source. A prepare still running (or killed) keeps its
progress in progress.json instead, so a run never reads its shards.

Every check a run needs (`check`) reads the index and stats the shards,
nothing more, so a missing or truncated shard or another tokenizer is
refused in one line before anything is compiled or written.
"""
import dataclasses
import hashlib
import json
import mmap
import os
import pathlib

import numpy as np

from diloco_jax.data import errors
from diloco_jax.data import tokenizer as tokenizer_lib

FORMAT = "diloco_jax.tokens/1"
INDEX_FILE = "index.json"
PROGRESS_FILE = "progress.json"
SPLITS = ("train", "validation")
# Little-endian whatever the host, so shards move between machines.
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


@dataclasses.dataclass(frozen=True)
class Shard:
  """One shard file: its name in the directory and what it holds."""
  file: str
  tokens: int
  documents: int
  source: str  # the input it was tokenized from, for people and resumes


@dataclasses.dataclass(frozen=True)
class TokenIndex:
  """A prepared corpus: where it is, its ids' type, tokenizer and shards."""
  directory: pathlib.Path
  dtype_name: str
  tokenizer: dict
  source: str
  splits: dict  # split name -> tuple[Shard, ...]

  @property
  def dtype(self) -> np.dtype:
    return DTYPES[self.dtype_name]

  @property
  def vocab_size(self) -> int:
    return int(self.tokenizer["vocab_size"])

  @property
  def eos_id(self) -> int:
    return int(self.tokenizer["eos_id"])

  def tokens(self, split: str) -> int:
    return sum(shard.tokens for shard in self.splits[split])


def dtype_name(vocab_size: int) -> str:
  """The name in DTYPES of the narrowest dtype that holds every id of a
  vocabulary (the tokenizer's own id type)."""
  return tokenizer_lib.token_dtype(vocab_size).name


def tokenizer_identity(tokenizer, model_path: str = "") -> dict:
  """What identifies the tokenizer that made (or reads) the tokens.

  SentencePiece models are identified by the sha256 of their file's bytes,
  so a copy elsewhere matches and a retrained model of the same name does
  not.
  """
  identity = {"kind": "byte" if not model_path else "sentencepiece",
              "vocab_size": int(tokenizer.vocab_size),
              "eos_id": int(tokenizer.eos_id)}
  if model_path:
    path = pathlib.Path(os.path.expanduser(model_path))
    identity["model_file"] = path.name
    identity["model_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
  return identity


def to_json(index: TokenIndex) -> dict:
  """The index as index.json holds it (directory left out: it is where the
  file is)."""
  return {"format": FORMAT, "dtype": index.dtype_name,
          "tokenizer": index.tokenizer, "source": index.source,
          "splits": {split: [dataclasses.asdict(shard) for shard in shards]
                     for split, shards in index.splits.items()}}


def write_json_atomically(path: pathlib.Path, content: dict) -> None:
  """Writes `content` to a temporary name, then renames it to `path`: a
  reader sees the old file or the new one, never half of one."""
  temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  try:
    temporary.write_text(json.dumps(content, indent=1) + "\n")
    os.replace(temporary, path)
  except OSError:
    temporary.unlink(missing_ok=True)
    raise


def read_index(path: str, field: str = "config.data.path") -> TokenIndex:
  """The index of the prepared corpus in directory `path`; DataError in one
  line, starting with `field`, when there is none or it does not parse."""
  directory = pathlib.Path(os.path.expanduser(path))
  index_path = directory / INDEX_FILE
  if not index_path.is_file():
    if (directory / PROGRESS_FILE).is_file():
      raise errors.DataError(
          f"{field}={path!r}: its prepare has not finished (no {INDEX_FILE} "
          f"yet); rerun the same python -m diloco_jax.data.prepare command "
          f"to complete it")
    raise errors.DataError(
        f"{field}={path!r} holds no {INDEX_FILE}: not a prepared corpus "
        f"(make one with python -m diloco_jax.data.prepare --output=DIR)")
  try:
    content = json.loads(index_path.read_text())
    if content.get("format") != FORMAT:
      raise ValueError(f"format {content.get('format')!r}, expected "
                       f"{FORMAT!r}")
    index = TokenIndex(
        directory=directory, dtype_name=content["dtype"],
        tokenizer=dict(content["tokenizer"]), source=content["source"],
        splits={split: tuple(Shard(**shard)
                             for shard in content["splits"][split])
                for split in SPLITS})
    counts = [index.tokenizer["vocab_size"], index.tokenizer["eos_id"],
              *(count for shards in index.splits.values() for shard in shards
                for count in (shard.tokens, shard.documents))]
    if not all(isinstance(count, int) and count >= 0 for count in counts):
      raise ValueError("a count or id that is no integer >= 0")
    return index
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
    raise errors.DataError(f"{field}: {index_path} is not a readable token "
                           f"index ({type(error).__name__}: {error})"
                           ) from error


def check(index: TokenIndex, identity: dict,
          field: str = "config.data.path") -> None:
  """Refuses, in one line, an index whose tokens a run cannot use: an
  unknown dtype or a vocabulary it cannot hold, a shard missing or of
  another size than its token count says, an empty split, or tokens made
  by another tokenizer than `identity` (tokenizer_identity of the run's).
  Stats the shards; reads none."""
  where = index.directory / INDEX_FILE
  if index.dtype_name not in DTYPES:
    raise errors.DataError(
        f"{field}: {where} says dtype {index.dtype_name!r}, not one of "
        f"{', '.join(repr(name) for name in DTYPES)}")
  ids = int(np.iinfo(index.dtype).max) + 1
  if index.vocab_size > ids:
    raise errors.DataError(
        f"{field}: {where} says a vocabulary of {index.vocab_size} ids, which "
        f"does not fit its dtype {index.dtype_name} ({ids} ids)")
  for split in SPLITS:
    for shard in index.splits[split]:
      _check_shard(index, shard, field)
    if index.tokens(split) == 0:
      raise errors.DataError(f"{field}: the {split} split of {where} holds "
                             f"no tokens")
  _check_tokenizer(index, identity, field)


def _check_shard(index: TokenIndex, shard: Shard, field: str) -> None:
  path = index.directory / shard.file
  try:
    size = path.stat().st_size
  except OSError:
    raise errors.DataError(
        f"{field}: shard {path} listed in {INDEX_FILE} is missing") from None
  expected = shard.tokens * index.dtype.itemsize
  if size != expected:
    raise errors.DataError(
        f"{field}: shard {path} holds {size} bytes, not the {shard.tokens} "
        f"tokens x {index.dtype.itemsize} bytes = {expected} that "
        f"{INDEX_FILE} says (truncated or overwritten?)")


def _describe(identity: dict) -> str:
  if identity["kind"] == "byte":
    return f"the byte tokenizer ({identity['vocab_size']} ids)"
  return (f"SentencePiece model {identity['model_file']} (sha256 "
          f"{identity['model_sha256'][:12]}, {identity['vocab_size']} ids)")


def _check_tokenizer(index: TokenIndex, identity: dict, field: str) -> None:
  # The model's file name is for people: a copy under another name is the
  # same tokenizer, its bytes' hash says so.
  if ({k: v for k, v in index.tokenizer.items() if k != "model_file"}
      == {k: v for k, v in identity.items() if k != "model_file"}):
    return
  hint = ("config.data.tokenizer='byte'" if index.tokenizer["kind"] == "byte"
          else "config.data.tokenizer='sentencepiece' and "
          "config.data.tokenizer_path= the model they were made with")
  raise errors.DataError(
      f"{field}: the shards at {str(index.directory)!r} were made by "
      f"{_describe(index.tokenizer)}, but config.data names "
      f"{_describe(identity)}; set {hint}")


def open_shard(index: TokenIndex, shard: Shard) -> np.ndarray:
  """The shard's tokens, a read-only array over a memory map of its file
  (nothing is read until indexed; the map closes with the last array that
  uses it); an empty array for an empty shard, which cannot be mapped."""
  if shard.tokens == 0:
    return np.empty(0, index.dtype)
  with open(index.directory / shard.file, "rb") as f:
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  # A plain array, not np.memmap: slicing one costs a few times less, which
  # is most of a small batch's time.
  return np.frombuffer(mapped, dtype=index.dtype, count=shard.tokens)
