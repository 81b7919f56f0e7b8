r"""Pre-tokenizing a corpus into token shards that runs read by position.

  python -m diloco_jax.data.prepare --path=$HOME/c4 \
      --tokenizer_path=$HOME/c4/spm_32000_100mb.model --output=$HOME/c4_tokens

tokenizes the documents at --path with the run's own tokenizer and EOS
handling (the byte tokenizer unless --tokenizer_path names a SentencePiece
model) into token shards and an index (token_shards), using --processes
worker processes, one shard each at a time (what each shard holds:
prepare_plan). A run then trains from them with
--config.data.corpus=tokens --config.data.path=$HOME/c4_tokens and the same
tokenizer flags, tokenizing nothing.

Sources (--corpus):
- c4: the JSON-lines shards at --path (as config.data.path), split as the
  c4 corpus splits them; each becomes one token shard, so the run's
  batches are those corpus c4 would stream from the same shards, bit for
  bit. With --tfds_name (e.g. c4/en) --path is the TFDS data_dir and each
  virtual shard of its splits (tfds_documents) becomes one token shard.
- text_files: the files at --path, one document each, split by file as
  corpus text_files splits them, consecutive files grouped into shards.

Resuming: each shard is written to NAME.part and renamed when whole, and
the finished shards are listed in progress.json as they finish; index.json
is written last, atomically. A prepare killed at any point and rerun with
the same flags redoes only the shards it had not finished, and a run
refuses the directory until index.json is there. `--verify --output=DIR`
reads a prepared directory's shards and checks them against its index
(shard_files.verify). Its workers end with it,
however it ends (even SIGKILLed alone): none is left writing a shard under
the rerun's. A write that fails (a full disk, --output removed) stops it in
one `error:` line naming the file, the finished shards kept.
"""
from collections.abc import Iterator
import dataclasses
import json
import os
import pathlib
import time

from absl import logging
import numpy as np

from diloco_jax.data import c4_files
from diloco_jax.data import embedded
from diloco_jax.data import errors
from diloco_jax.data import prepare_plan
from diloco_jax.data import prepare_workers
from diloco_jax.data import shard_files
from diloco_jax.data import tfds_documents
from diloco_jax.data import token_shards

# Tokens a worker gathers before writing them out: a few MB of memory.
_WRITE_TOKENS = 2**20


# The workers: each builds the tokenizer (and opens a TFDS split) once.

_worker_cache: dict = {}


def _cached(key, make):
  if key not in _worker_cache:
    _worker_cache[key] = make()
  return _worker_cache[key]


def _documents(reader: tuple) -> Iterator[str | bytes]:
  """The documents of a task's input, as the run's readers give them."""
  kind = reader[0]
  if kind == "jsonl":
    for _, text in c4_files.read_texts(pathlib.Path(reader[1])):
      yield text
  elif kind == "tfds":
    _, name, data_dir, split, shard = reader
    records = _cached(("tfds", name, data_dir, split),
                      lambda: tfds_documents.TfdsRecords(name, data_dir,
                                                         split))
    for _, text in records.read(shard):
      yield text
  else:  # every file counts: one unreadable since the plan is a DataError
    yield from embedded.read_documents(reader[1], skip_unreadable=False)


def tokenize_shard(task: prepare_plan.Task, tokenizer_path: str,
                   dtype_name: str, output: str) -> token_shards.Shard:
  """Writes one token shard: its documents' tokens, each followed by EOS,
  to FILE.part, renamed to FILE once whole and on disk."""
  tokenizer = _cached(("tokenizer", tokenizer_path),
                      lambda: prepare_plan.build_tokenizer(tokenizer_path))
  dtype = token_shards.DTYPES[dtype_name]
  eos = np.array([tokenizer.eos_id], dtype)
  target = pathlib.Path(output) / task.file
  part = target.with_name(target.name + ".part")
  tokens = documents = 0
  digest = shard_files.ShardDigest()  # what a run checks the file against

  def write(pending: list) -> None:
    ids = np.concatenate(pending).astype(dtype, copy=False)
    f.write(ids.tobytes())
    digest.update(ids)

  with open(part, "wb") as f:
    pending, pending_tokens = [], 0
    for text in _documents(task.reader):
      ids = tokenizer.encode(text)
      pending += [ids, eos]
      pending_tokens += ids.size + 1
      documents += 1
      if pending_tokens >= _WRITE_TOKENS:
        write(pending)
        tokens, pending, pending_tokens = tokens + pending_tokens, [], 0
    if pending:
      write(pending)
      tokens += pending_tokens
    f.flush()
    os.fsync(f.fileno())  # the name must never point at a partial file
  os.replace(part, target)
  return token_shards.Shard(task.file, tokens, documents, task.source,
                            digest.sha256, digest.max_id)


def _tokenize(arguments: tuple) -> token_shards.Shard:
  """tokenize_shard, its OSErrors in one line (WriteError; DataError for
  one reading elsewhere than --output)."""
  task, output = arguments[0], pathlib.Path(arguments[3])
  try:
    return tokenize_shard(*arguments)
  except OSError as error:
    if error.filename and not _within(error.filename, output):
      raise errors.DataError(f"cannot read {error.filename}: "
                             f"{error.strerror or error}") from None
    raise _write_error(output, error, output / f"{task.file}.part") from None


class WriteError(errors.DataError):
  """--output could not be written (a full disk, the directory removed):
  one line naming the path. The finished shards are kept, and the same
  command continues them."""


def _write_error(output: pathlib.Path, error: OSError,
                path: pathlib.Path | None = None) -> WriteError:
  """WriteError for `error`, met writing in `output`: naming the file
  (error.filename, else `path`, else the directory)."""
  where = error.filename or path
  where = f"in {output}" if where is None else str(where)
  reason = error.strerror or str(error)
  if not output.is_dir():
    return WriteError(f"cannot write {where}: {reason} (--output="
                      f"{str(output)!r} was removed); rerun the same command "
                      "to prepare it again")
  return WriteError(f"cannot write {where}: {reason}; the finished shards "
                    f"are kept in {output}; rerun the same command to make "
                    "the others")


def _within(path, directory: pathlib.Path) -> bool:
  return os.path.abspath(path).startswith(
      os.path.join(os.path.abspath(directory), ""))


# The prepare: checks, resume, the pool, the index.


def _existing(plan: prepare_plan.Plan) -> tuple[bool, dict]:
  """(whether plan.output holds a finished index; the shards a previous
  prepare into it finished, as {file: Shard fields}); DataError if it
  prepared something else, or the directory holds other files."""
  output = plan.output
  if not output.exists():
    return False, {}
  if not output.is_dir():
    raise errors.DataError(f"--output={str(output)!r} is a file, not a "
                           "directory")
  if (output / token_shards.INDEX_FILE).exists():
    index = token_shards.read_index(str(output), field="--output")
    shards = [(split, shard) for split in token_shards.SPLITS
              for shard in index.splits[split]]
    _refuse_other(plan, prepare_plan.identity(
        index.dtype_name, index.tokenizer,
        [(split, shard.file, shard.source) for split, shard in shards]))
    return True, {shard.file: dataclasses.asdict(shard)
                  for _, shard in shards}
  progress_path = output / token_shards.PROGRESS_FILE
  if progress_path.exists():
    try:
      progress = json.loads(progress_path.read_text())
      previous, done = progress["plan"], dict(progress["done"])
    except (OSError, ValueError, KeyError, TypeError) as error:
      raise errors.DataError(f"--output: {progress_path} is unreadable "
                             f"({error}); delete it to start over"
                             ) from error
    _refuse_other(plan, previous)
    return False, done
  if any(output.iterdir()):
    raise errors.DataError(
        f"--output={str(output)!r} holds other files and no prepare; give "
        "a new or empty directory")
  return False, {}


def _refuse_other(plan: prepare_plan.Plan, identity: dict) -> None:
  if identity != plan.identity():
    raise errors.DataError(
        f"--output={str(plan.output)!r} holds tokens prepared from other "
        "input or with another tokenizer; give another --output (or delete "
        "it to prepare again)")


def _finished(plan: prepare_plan.Plan, done: dict) -> dict:
  """The shards `done` lists whose files are there, whole."""
  itemsize = token_shards.DTYPES[plan.dtype_name].itemsize
  finished = {}
  for task in plan.tasks:
    record = done.get(task.file)
    path = plan.output / task.file
    if record and path.is_file() and (
        path.stat().st_size == record["tokens"] * itemsize):
      finished[task.file] = token_shards.Shard(**record)
  return finished


def _check_writable(output: pathlib.Path) -> None:
  existing = output
  while not existing.exists() and existing != existing.parent:
    existing = existing.parent
  if not existing.is_dir():
    raise errors.DataError(f"--output={str(output)!r}: {str(existing)!r} is "
                           "a file, not a directory")
  if not os.access(existing, os.W_OK):
    raise errors.DataError(f"--output={str(output)!r}: cannot write in "
                           f"{str(existing)!r}")


def _progress_line(done: int, total: int, tokens: int, elapsed: float,
                   remaining_shards: int, shards_now: int) -> str:
  width = 20
  bar = "#" * (width * done // total) + "." * (width - width * done // total)
  rate = tokens / elapsed if elapsed > 0 else 0.0
  left = (elapsed / shards_now * remaining_shards if shards_now else 0.0)
  return (f"prepare [{bar}] {done}/{total} shards, {tokens / 1e6:,.1f}M "
          f"tokens in {elapsed:.0f} s ({rate / 1e6:.2f}M tokens/s), about "
          f"{left:.0f} s left")


def prepare(plan: prepare_plan.Plan, processes: int = 1
            ) -> token_shards.TokenIndex:
  """Makes the plan's shards that are not made yet, then its index.

  A prepare into a directory it finished returns its index, and makes
  again any shard lost or cut since.

  Args:
    plan: prepare_plan.make_plan's.
    processes: worker processes (1: tokenize in this process).

  Returns:
    The index, as a run reads it.

  Raises:
    DataError: in one line, before anything is written, when plan.output
      holds anything but this plan's own prepare, or cannot be written;
      later, an input shard that turns out unreadable, or (WriteError) a
      write that fails: a full disk, plan.output removed (finished shards
      are kept for the rerun).
  """
  if processes < 1:
    raise errors.DataError(f"--processes={processes} must be >= 1")
  indexed, done = _existing(plan)
  finished = _finished(plan, done)
  if indexed and len(finished) == len(plan.tasks):
    logging.info("%s is prepared already", plan.output)
    return token_shards.read_index(str(plan.output), field="--output")
  _check_writable(plan.output)
  try:
    plan.output.mkdir(parents=True, exist_ok=True)
  except OSError as error:
    raise errors.DataError(f"--output={str(plan.output)!r}: cannot make it "
                           f"({error.strerror or error})") from None
  try:
    return _make(plan, processes, finished)
  except OSError as error:  # a full disk, --output removed: one line
    raise _write_error(plan.output, error) from None


def _make(plan: prepare_plan.Plan, processes: int, finished: dict
          ) -> token_shards.TokenIndex:
  """prepare's writes: progress.json, the shards not `finished`, the
  index."""
  progress_path = plan.output / token_shards.PROGRESS_FILE

  def save_progress():
    _write_json(plan.output, progress_path, {
        "plan": plan.identity(),
        "done": {file: dataclasses.asdict(shard)
                 for file, shard in finished.items()}})

  save_progress()
  # A shard lost since the index was written is made again: the index goes
  # first, so that no run reads the directory until it is whole again.
  (plan.output / token_shards.INDEX_FILE).unlink(missing_ok=True)
  pending = sorted((task for task in plan.tasks if task.file not in finished),
                   key=lambda task: -task.size)
  if finished:
    logging.info("resuming: %d of %d shards are done", len(finished),
                 len(plan.tasks))
  arguments = [(task, plan.tokenizer_path, plan.dtype_name,
                str(plan.output)) for task in pending]
  started, tokens_now = time.perf_counter(), 0
  with _pool(min(processes, max(len(pending), 1))) as pool:
    results = (pool.imap_unordered(_tokenize, arguments) if pool
               else map(_tokenize, arguments))
    for number, shard in enumerate(results, start=1):
      finished[shard.file] = shard
      save_progress()
      tokens_now += shard.tokens
      logging.info("%s", _progress_line(
          len(finished), len(plan.tasks), tokens_now,
          time.perf_counter() - started, len(pending) - number, number))
  index = token_shards.TokenIndex(
      directory=plan.output, dtype_name=plan.dtype_name,
      tokenizer=plan.tokenizer, source=plan.source,
      splits={split: tuple(finished[task.file] for task in plan.tasks
                           if task.split == split)
              for split in token_shards.SPLITS})
  _write_json(plan.output, plan.output / token_shards.INDEX_FILE,
              token_shards.to_json(index))
  progress_path.unlink()
  return index


def _write_json(output: pathlib.Path, path: pathlib.Path,
                content: dict) -> None:
  """write_json_atomically, a failed write (no file name of its own: a
  full disk) named by `path`."""
  try:
    token_shards.write_json_atomically(path, content)
  except OSError as error:
    raise _write_error(output, error, path) from None


class _NoPool:
  """In place of a pool of one: tokenizing in this process, whose
  tokenizer (and TFDS split) are let go at the end."""

  def __enter__(self):
    return None

  def __exit__(self, *exc_info):
    _worker_cache.clear()
    return False


def _pool(processes: int):
  if processes == 1:
    return _NoPool()
  return prepare_workers.Workers(processes)


if __name__ == "__main__":
  # pylint: disable-next=g-import-not-at-top
  from diloco_jax.data import prepare_command
  prepare_command.main()
