"""What a prepare makes: the token shards of a source, planned and checked
before anything is written.

`make_plan` lists the shards (`Task`s) of a source as the runs' readers
see it: the c4 corpus's JSON-lines shards and their split (one token shard
each), a TFDS split's virtual shards (one each), or text files split by
file and grouped into shards. It checks the arguments, the tokenizer and
the first lines of every input shard, so bad input is one line before the
prepare (prepare.py) creates anything.
"""
import contextlib
import dataclasses
import math
import os
import pathlib
import types

import numpy as np

from diloco_jax.data import c4_files
from diloco_jax.data import errors
from diloco_jax.data import file_split
from diloco_jax.data import text_files
from diloco_jax.data import tfds_documents
from diloco_jax.data import token_shards
from diloco_jax.data import tokenizer as tokenizer_lib

CORPORA = ("c4", "text_files")
# Text files are grouped into at least this many shards (fewer only with
# fewer files), so a run has a shard for each of up to 16 islands, and
# into more where they hold more than TEXT_SHARD_BYTES each.
MIN_TEXT_SHARDS = 16
TEXT_SHARD_BYTES = 64 * 2**20
# The run's readers name config fields; the prepare's flags mean the same.
_FLAGS_OF_FIELDS = {"config.data.tokenizer_path": "--tokenizer_path",
                    "config.data.tfds_name": "--tfds_name",
                    "config.data.path": "--path"}


@dataclasses.dataclass(frozen=True)
class Task:
  """One token shard to make: its name, where its documents come from.

  Attributes:
    split: "train" or "validation".
    file: the shard's file name in the output directory.
    source: what it is made from, in words (saved in the index).
    reader: how a worker reads its documents, picklable: ("jsonl", path),
      ("tfds", name, data_dir, split, shard) or ("text", paths).
    size: input bytes where known (0 otherwise), to start big shards first.
  """
  split: str
  file: str
  source: str
  reader: tuple
  size: int = 0


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything a prepare will write, known before it writes anything."""
  output: pathlib.Path
  tasks: tuple[Task, ...]
  dtype_name: str
  tokenizer: dict
  source: str
  tokenizer_path: str

  def identity(self) -> dict:
    """What must be equal for a rerun to continue this prepare's files."""
    return identity(self.dtype_name, self.tokenizer,
                    [(task.split, task.file, task.source)
                     for task in self.tasks])


def identity(dtype_name: str, tokenizer: dict, shards) -> dict:
  """A prepare's identity, JSON-comparable: its format, dtype, tokenizer
  and (split, file, source) of each shard."""
  return {"format": token_shards.FORMAT, "dtype": dtype_name,
          "tokenizer": tokenizer,
          "shards": [list(shard) for shard in shards]}


@contextlib.contextmanager
def _named_by_flags():
  """Re-raises the readers' DataErrors naming the flags, not the config
  fields of the same meaning that a run's errors name."""
  try:
    yield
  except errors.DataError as error:
    message = str(error)
    for field, flag in _FLAGS_OF_FIELDS.items():
      message = message.replace(field, flag)
    raise errors.DataError(message) from None


def make_plan(corpus: str, path: str, output: str, tokenizer_path: str = "",
              tfds_name: str = "", validation_fraction: float = 0.05,
              hold_out_shards: bool = False) -> Plan:
  """The shards to make of the source, checked (DataError in one line:
  arguments, the tokenizer, the first lines of every input shard); reads
  and writes nothing else."""
  with _named_by_flags():
    return _make_plan(corpus, path, output, tokenizer_path, tfds_name,
                      validation_fraction, hold_out_shards)


def _make_plan(corpus: str, path: str, output: str, tokenizer_path: str,
               tfds_name: str, validation_fraction: float,
               hold_out_shards: bool) -> Plan:
  if corpus not in CORPORA:
    raise errors.DataError(f"--corpus={corpus!r} is not one of "
                           f"{', '.join(repr(name) for name in CORPORA)}")
  if not 0 < validation_fraction < 1:
    raise errors.DataError(f"--validation_fraction={validation_fraction} "
                           "must be in (0, 1)")
  tokenizer = build_tokenizer(tokenizer_path)
  if corpus == "c4" and tfds_name:
    tasks, source = _tfds_tasks(tfds_name, path), f"TFDS {tfds_name}"
  elif corpus == "c4":
    tasks = _c4_tasks(path, validation_fraction, hold_out_shards)
    source = f"c4 ({path})"
  else:
    tasks = _text_tasks(path, validation_fraction)
    source = f"text_files ({path})"
  return Plan(output=pathlib.Path(os.path.expanduser(output)),
              tasks=tuple(tasks),
              dtype_name=token_shards.dtype_name(tokenizer.vocab_size),
              tokenizer=token_shards.tokenizer_identity(tokenizer,
                                                        tokenizer_path),
              source=source, tokenizer_path=tokenizer_path)


def build_tokenizer(tokenizer_path: str) -> tokenizer_lib.Tokenizer:
  """The run's tokenizer (bytes, or the SentencePiece model at the path);
  a vocabulary beyond uint16 is allowed: its shards hold uint32 ids."""
  settings = types.SimpleNamespace(
      tokenizer="sentencepiece" if tokenizer_path else "byte",
      tokenizer_path=tokenizer_path)
  return tokenizer_lib.build_tokenizer(
      settings, max_vocab_size=tokenizer_lib.MAX_WIDE_VOCAB_SIZE)


def _c4_tasks(path: str, validation_fraction: float,
              hold_out_shards: bool) -> list[Task]:
  problem = c4_files.shards_problem(path)
  if problem:
    raise errors.DataError(f"--path: {problem}")
  splits = dict(zip(token_shards.SPLITS,
                    c4_files.split_shards(
                        path, validation_fraction, hold_out=hold_out_shards,
                        field="--path",
                        hold_out_flag="--hold_out_shards")))
  if not splits["train"]:
    raise errors.DataError(f"--path: every shard at {path!r} is named "
                           "'*validation*'; no train shards are left")
  # A shard of another format fails now, not after hours of tokenizing.
  c4_files.check_first_lines(splits["train"] + splits["validation"])
  root, _ = text_files.resolve_text_files(path)
  return [Task(split, f"{split}-{number:05d}.bin",
               shard.relative_to(root).as_posix(), ("jsonl", str(shard)),
               shard.stat().st_size)
          for split, shards in splits.items()
          for number, shard in enumerate(shards)]


def _tfds_tasks(name: str, data_dir: str) -> list[Task]:
  if not tfds_documents.tfds_available():
    raise errors.missing_package(f"--tfds_name={name!r}",
                                 "tensorflow-datasets")
  tasks = []
  for split in token_shards.SPLITS:
    records = tfds_documents.TfdsRecords(name, data_dir, split)
    tasks += [Task(split, f"{split}-{shard:05d}.bin",
                   f"{name} {split} virtual shard {shard} of "
                   f"{records.num_shards}",
                   ("tfds", name, data_dir, split, shard))
              for shard in range(records.num_shards)]
  return tasks


def _text_tasks(path: str, validation_fraction: float) -> list[Task]:
  problem = text_files.path_problem(path)
  if problem:
    raise errors.DataError(f"--path: {problem}")
  root, relative_paths = text_files.resolve_text_files(path)
  text_files.check_text(root, relative_paths, path)
  if len(relative_paths) < 2:
    raise errors.DataError(
        f"--path={path!r} names one file; the split is by file, so give at "
        "least two (corpus text_files holds out a single file's last "
        "sequences instead: train on it directly)")
  validation = set(file_split.select_split(relative_paths, "validation",
                                           validation_fraction))
  if len(validation) in (0, len(relative_paths)):
    # The hash put every file on one side; keep both splits non-empty.
    validation = {len(relative_paths) - 1}
  tasks = []
  for split in token_shards.SPLITS:
    names = [name for number, name in enumerate(relative_paths)
             if (number in validation) == (split == "validation")]
    for number, group in enumerate(_groups(root, names)):
      tasks.append(Task(
          split, f"{split}-{number:05d}.bin",
          f"{len(group)} file(s), {group[0]} .. {group[-1]}",
          ("text", tuple(str(root / name) for name in group)),
          sum((root / name).stat().st_size for name in group)))
  return tasks


def _groups(root: pathlib.Path, names: list[str]) -> list[list[str]]:
  """Consecutive files in groups of about equal bytes: MIN_TEXT_SHARDS
  groups, or more of at most about TEXT_SHARD_BYTES each."""
  sizes = np.array([(root / name).stat().st_size for name in names],
                   dtype=np.float64)
  count = min(len(names), max(MIN_TEXT_SHARDS,
                              math.ceil(sizes.sum() / TEXT_SHARD_BYTES)))
  # A file's group: where the bytes before it fall among `count` equal
  # parts; a group left empty by a big file is dropped.
  starts = np.cumsum(sizes) - sizes
  group_of = np.minimum((starts / max(sizes.sum(), 1) * count).astype(int),
                        count - 1)
  groups = [[] for _ in range(count)]
  for name, group in zip(names, group_of):
    groups[group].append(name)
  return [group for group in groups if group]
