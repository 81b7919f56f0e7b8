"""C4-format shards on disk: JSON lines with a "text" field, maybe gzipped.

C4's own release (e.g. c4-train.00000-of-01024.json.gz and
c4-validation.00000-of-00008.json.gz) holds one JSON object per line,
{"text": ..., "timestamp": ..., "url": ...}. A shard is one file; a document
is one line, addressed by its line number so that reading can resume there.

For data on Google Cloud Storage, copy the shards to local disk
(`gsutil -m cp`) or mount the bucket with gcsfuse: shards are read with plain
file I/O, and gzip files are read from their start.
"""
from collections.abc import Iterator, Sequence
import contextlib
import gzip
import json
import os
import pathlib
import stat
import zlib

from diloco_jax.data import errors
from diloco_jax.data import file_split
from diloco_jax.data import text_files

SHARD_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
# C4 names its held-out files "c4-validation.*": such names pick the split.
VALIDATION_MARKER = "validation"
VALIDATION_EXAMPLE = "c4-validation.00000-of-00008.json.gz"
_NAMES_SHOWN = 3  # shard names a refusal lists
# Lines of every shard parsed before a run compiles (check_first_lines): a
# shard of another format fails at its first line. 100 lines of C4's size
# (~2.2 kB each) took 7 ms a shard on a loaded 2-core machine, so all 1,032
# shards of C4's English split are checked in seconds.
CHECKED_LINES = 100


def is_shard(relative_path: str) -> bool:
  """Whether a file name looks like a JSON-lines shard (maybe gzipped)."""
  return relative_path.endswith(SHARD_SUFFIXES)


def list_shards(path: str) -> list[pathlib.Path]:
  """The JSON-lines shards under a directory or glob, sorted by path."""
  root, relative_paths = text_files.resolve_text_files(path)
  return [root / name for name in relative_paths if is_shard(name)]


def shards_problem(path: str) -> str | None:
  """Why `path` names no shards, or None; reads no shard."""
  problem = text_files.path_problem(path)
  if problem:
    return problem
  if not list_shards(path):
    return (f"no C4 shards ({', '.join(SHARD_SUFFIXES)}) found at {path!r}")
  return None


def split_shards(path: str, validation_fraction: float,
                 hold_out: bool = False, field: str = "config.data.path",
                 hold_out_flag: str = "--config.data.hold_out_shards=true"
                 ) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
  """(train, validation) shards, each sorted by path.

  Files whose names contain "validation" are the validation split when any
  exist (C4's naming). Otherwise, with `hold_out`, files are held out by the
  crc32 rule of file_split, keeping both splits non-empty (a single file
  cannot be split by file and is refused); without it the shards are
  refused (DataError naming `field`, the files found, and `hold_out_flag`):
  holding out train shards unasked would leave the islands fewer shards than
  were given.
  """
  root, relative_paths = text_files.resolve_text_files(path)
  relative_paths = [name for name in relative_paths if is_shard(name)]
  by_name = [VALIDATION_MARKER in pathlib.PurePosixPath(name).name
             for name in relative_paths]
  if any(by_name):
    is_validation = by_name
  elif not hold_out:
    raise errors.DataError(no_validation_shard(path, relative_paths, field,
                                               hold_out_flag))
  elif len(relative_paths) < 2:
    raise errors.DataError(
        f"{field}: {len(relative_paths)} C4 shard(s) at {path!r} and "
        f"none named '*{VALIDATION_MARKER}*'; the split is by file, so give "
        f"at least two shards or a validation shard")
  else:
    is_validation = [False] * len(relative_paths)
    for index in file_split.select_split(relative_paths, "validation",
                                         validation_fraction):
      is_validation[index] = True
    if all(is_validation) or not any(is_validation):
      # The hash put every file on one side; keep both splits non-empty.
      is_validation = [False] * len(relative_paths)
      is_validation[-1] = True
  train = [root / name for name, held_out in zip(relative_paths, is_validation)
           if not held_out]
  validation = [root / name
                for name, held_out in zip(relative_paths, is_validation)
                if held_out]
  return train, validation


def no_validation_shard(path: str, relative_paths: Sequence[str], field: str,
                        hold_out_flag: str) -> str:
  """The one line refusing shards of which none is named '*validation*'."""
  shown = ", ".join(relative_paths[:_NAMES_SHOWN]) + (
      ", ..." if len(relative_paths) > _NAMES_SHOWN else "")
  return (f"{field}: none of the {len(relative_paths)} C4 shard(s) at "
          f"{path!r} ({shown}) is named '*{VALIDATION_MARKER}*', so there is "
          f"no eval split: add a validation shard there (C4's is "
          f"{VALIDATION_EXAMPLE}, which python -m diloco_jax.data.c4_download "
          f"fetches), or pass {hold_out_flag} to evaluate on train shards "
          f"held out by a hash of their names")


def _open_text(path: pathlib.Path):
  # errors="replace": one bad byte sequence should not stop a run; the
  # document keeps U+FFFD in its place.
  if path.name.endswith(".gz"):
    return gzip.open(path, "rt", encoding="utf-8", errors="replace")
  return open(path, "rt", encoding="utf-8", errors="replace")


def _read_problem(error: Exception) -> str:
  """What a failed read of a shard means, in a few words."""
  if isinstance(error, EOFError):
    return ("truncated gzip file: the compressed data ends before its "
            "end-of-stream marker")
  if isinstance(error, gzip.BadGzipFile):  # before OSError, its base class
    return f"not a valid gzip file: {error}"
  if isinstance(error, zlib.error):
    return f"corrupt gzip data: {error}"
  return f"cannot read the file: {error.strerror or error}"


def _numbered_lines(path: pathlib.Path) -> Iterator[tuple[int, str]]:
  """Yields (line number from 0, line) of a shard.

  gzip and I/O failures (a truncated or corrupt .gz, a file that is no gzip
  at all) surface as DataError naming the file and the line being read, not
  as a bare EOFError that names neither.
  """
  line_number = -1
  try:
    if not stat.S_ISREG(os.stat(path).st_mode):
      # A FIFO or device would block the reader, perhaps for ever.
      raise errors.DataError(f"{path}: not a regular file")
    with _open_text(path) as lines:
      for line_number, line in enumerate(lines):
        yield line_number, line
  except (EOFError, OSError, zlib.error) as error:
    # The line after the last one read, counted from 1 as editors do.
    raise errors.DataError(f"{path}: {_read_problem(error)} "
                           f"(line {line_number + 2})") from error


def _document_text(path: pathlib.Path, line_number: int, line: str) -> str:
  """The "text" field of one JSON line; DataError naming path:line (counted
  from 1) if none."""
  try:
    text = json.loads(line)["text"]
  except (json.JSONDecodeError, KeyError, TypeError) as error:
    raise errors.DataError(f"{path}:{line_number}: not a JSON object with "
                           f"a 'text' field ({error})") from error
  if not isinstance(text, str):
    raise errors.DataError(f"{path}:{line_number}: the 'text' field is not "
                           f"a string ({type(text).__name__})")
  return text


def read_texts(path: pathlib.Path, start_line: int = 0
               ) -> Iterator[tuple[int, str]]:
  """Yields (line number, text) for each document at or after `start_line`.

  Line numbers count from 0. Blank lines and empty texts are skipped (they
  would only add stray EOS tokens) but still counted, so line numbers are
  positions in the file. A shard that cannot be read or parsed raises
  DataError naming the file and line.
  """
  for line_number, line in _numbered_lines(path):
    if line_number < start_line or not line.strip():
      continue
    text = _document_text(path, line_number + 1, line)
    if text:
      yield line_number, text


def check_first_lines(paths: Sequence[pathlib.Path],
                      lines: int = CHECKED_LINES) -> None:
  """Parses the first `lines` lines of every shard; DataError naming
  path:line (counted from 1) at the first that is unreadable or holds no
  "text" string.

  Shards are read lazily, shard by shard, as the islands reach them: a
  shard of the wrong format (or damaged at its start) that only a later
  island or epoch reaches would otherwise stop the run hours in. A line
  damaged further in is found when it is read.
  """
  for path in paths:
    with contextlib.closing(_numbered_lines(path)) as numbered:
      for line_number, line in numbered:
        if line_number >= lines:
          break
        if line.strip():
          _document_text(path, line_number + 1, line)


class ShardFiles:
  """C4 JSON-lines shards as the document collection of a stream.

  Shard i is the i-th file; a document's offset is its line number.
  """

  def __init__(self, paths: list[pathlib.Path]):
    self.paths = list(paths)

  @property
  def num_shards(self) -> int:
    return len(self.paths)

  def read(self, shard: int, start: int = 0) -> Iterator[tuple[int, str]]:
    """(offset, text) of shard `shard`'s documents from offset `start`."""
    return read_texts(self.paths[shard], start)
