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
document count, source, the sha256 of its bytes (what `sha256sum` prints)
and its largest token id. A prepare still running (or killed) keeps its
progress in progress.json instead, so a run never reads its shards.

What is checked when:
- before anything is compiled or written (`check`: the index and a stat of
  each shard): a shard missing or of another size, another tokenizer, and
  ids beyond the vocabulary (each shard's largest id, recorded by prepare,
  against the tokenizer's; validation checks the model holds those);
- when a process first opens a shard (shard_files.ShardFile, in the
  read-ahead thread): its bytes against the recorded sha256 and largest id, so a
  shard overwritten since prepare (even with as many tokens) is refused
  before any of its tokens trains. Reading it costs about 0.5 s per GB on
  a core with SHA extensions (2 GB/s measured; ~0.4 GB/s without them);
- on every read: each read returns the bytes it asked for, or the shard
  was cut while the run read it: one line naming it. Shards are read by
  position (pread), never memory-mapped, so a shard truncated under the
  run cannot fault the process (a map would: SIGBUS).
`python -m diloco_jax.data.prepare --verify --output=DIR` checks every
shard of a directory at once (and adds the checksums to an index that an
older prepare wrote without them).
"""
import dataclasses
import hashlib
import json
import os
import pathlib

import numpy as np

from diloco_jax.data import errors
from diloco_jax.data import tokenizer as tokenizer_lib

FORMAT = "diloco_jax.tokens/2"
# An index an older prepare wrote: shards without sha256 and largest id.
UNCHECKED_FORMAT = "diloco_jax.tokens/1"
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
  sha256: str  # of the file's bytes, hex (as sha256sum prints it)
  max_id: int  # the largest token id it holds (-1: no tokens)


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


def read_index(path: str, field: str = "config.data.path",
               unchecked: bool = False) -> TokenIndex:
  """The index of the prepared corpus in directory `path`; DataError in one
  line, starting with `field`, when there is none or it does not parse.

  An index an older prepare wrote without checksums is refused (with the
  command that adds them) unless `unchecked`: then its shards come with
  sha256 "" and max_id -1, for `verify` to fill in.
  """
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
    old = content.get("format") == UNCHECKED_FORMAT
    if old and not unchecked:
      raise errors.DataError(
          f"{field}: {index_path} was written by an older prepare, without "
          f"the shards' checksums; add them once with python -m "
          f"diloco_jax.data.prepare --verify --output={path} (reads every "
          f"shard, about 0.5 s per GB)")
    if content.get("format") != FORMAT and not old:
      raise ValueError(f"format {content.get('format')!r}, expected "
                       f"{FORMAT!r}")
    unknown = {"sha256": "", "max_id": -1} if old else {}
    index = TokenIndex(
        directory=directory, dtype_name=content["dtype"],
        tokenizer=dict(content["tokenizer"]), source=content["source"],
        splits={split: tuple(Shard(**{**unknown, **shard})
                             for shard in content["splits"][split])
                for split in SPLITS})
    shards = [shard for shards in index.splits.values() for shard in shards]
    counts = [index.tokenizer["vocab_size"], index.tokenizer["eos_id"],
              *(count for shard in shards
                for count in (shard.tokens, shard.documents, shard.max_id + 1))]
    if not all(isinstance(count, int) and count >= 0 for count in counts):
      raise ValueError("a count or id that is no integer >= 0")
    if not old and not all(_is_sha256(shard.sha256) for shard in shards):
      raise ValueError("a shard's sha256 is not 64 hex digits")
    return index
  except errors.DataError:
    raise
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
    raise errors.DataError(f"{field}: {index_path} is not a readable token "
                           f"index ({type(error).__name__}: {error})"
                           ) from error


def _is_sha256(digest) -> bool:
  return (isinstance(digest, str) and len(digest) == 64
          and all(c in "0123456789abcdef" for c in digest))


def check(index: TokenIndex, identity: dict,
          field: str = "config.data.path") -> None:
  """Refuses, in one line, an index whose tokens a run cannot use: an
  unknown dtype or a vocabulary it cannot hold, a shard missing or of
  another size than its token count says, a shard whose largest id is
  beyond the vocabulary, an empty split, or tokens made by another
  tokenizer than `identity` (tokenizer_identity of the run's). Stats the
  shards; reads none (their content is checked as a run opens them:
  shard_files.ShardFile)."""
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
      check_shard(index, shard, field)
    if index.tokens(split) == 0:
      raise errors.DataError(f"{field}: the {split} split of {where} holds "
                             f"no tokens")
  _check_tokenizer(index, identity, field)


def check_shard(index: TokenIndex, shard: Shard, field: str) -> None:
  """Refuses, in one line, a shard missing, of another size than the index
  says, or whose largest id is beyond the vocabulary (a stat)."""
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
  if shard.max_id >= index.vocab_size:
    raise errors.DataError(
        f"{field}: shard {path} holds token id {shard.max_id} ({INDEX_FILE} "
        f"says), beyond the {index.vocab_size} ids of the tokenizer that "
        f"made it: prepared with another tokenizer? prepare it again")


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
