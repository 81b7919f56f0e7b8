r"""A SentencePiece model trained on the first megabytes of C4 shards.

  python -m diloco_jax.data.train_tokenizer --path=~/c4 --vocab_size=32000 \
      --megabytes=100

reads the train shards at --path (a directory or glob, as config.data.path)
in name order, never those of the validation split, and trains a unigram
SentencePiece model with byte fallback (no text is ever out of vocabulary)
on the lines of their documents until --megabytes of text are read. The
model is saved beside the shards as spm_{vocab_size}_{megabytes}mb.model,
or at --output, and reused when it is there already: runs that are compared
must share one tokenizer, and training a 32k vocabulary takes minutes.
Shards that hold less text than --megabytes are read whole, and the name
says what they held (spm_8192_1.8mb.model for 1.8 MB). A vocabulary that
text cannot fill is refused in one line naming the largest it can.
It prints the flag that points a run at it:
--config.data.tokenizer_path=PATH.

SentencePiece's trainer is multi-threaded, so two trainings of the same
text may break ties differently: train once and share the file.
"""
from collections.abc import Iterable, Iterator
import io
import math
import os
import pathlib
import re
import sys
import time

from diloco_jax.data import c4_files
from diloco_jax.data import errors
from diloco_jax.data import text_files
from diloco_jax.data import tokenizer as tokenizer_lib

# The split of train shards from validation ones when no shard is named
# '*validation*' (config.data.validation_fraction's default).
VALIDATION_FRACTION = 0.05
_BYTES_PER_MB = 10**6


def model_path(path: str, vocab_size: int, megabytes: float
               ) -> pathlib.Path:
  """Where `train` caches the model of shards at `path`: beside them,
  named by its vocabulary and the megabytes of text it was trained on."""
  root, _ = text_files.resolve_text_files(path)
  return root / f"spm_{vocab_size}_{megabytes_name(megabytes)}mb.model"


def megabytes_name(megabytes: float) -> str:
  """`megabytes` as a model's name gives it: whole numbers as they are,
  others rounded down to a tenth (1.83 -> 1.8) or, below 1, to two
  significant digits (0.0534 -> 0.053), so a name never claims more
  text than the model saw."""
  if megabytes == int(megabytes):
    return str(int(megabytes))
  digits = max(1, 1 - math.floor(math.log10(megabytes)))
  value = math.floor(megabytes * 10**digits) / 10**digits
  return f"{value:.{digits}f}".rstrip("0").rstrip(".")


def sample_bytes(shards: Iterable[pathlib.Path], megabytes: float) -> int:
  """The UTF-8 bytes of text sample_lines yields: at least `megabytes`
  (the last line may cross it), or all the shards hold when that is less.
  """
  return sum(len(line.encode("utf-8"))
             for line in sample_lines(shards, megabytes))


def sample_lines(shards: Iterable[pathlib.Path], megabytes: float
                 ) -> Iterator[str]:
  """The non-blank lines of the shards' documents, in order, until
  `megabytes` of UTF-8 text have been yielded.

  Lines, not documents: SentencePiece skips any sentence longer than its
  max_sentence_length (4,192 bytes), which many whole C4 documents are.
  """
  budget = megabytes * _BYTES_PER_MB
  for shard in shards:
    for _, text in c4_files.read_texts(shard):
      for line in text.splitlines():
        line = line.strip()
        if not line:
          continue
        yield line
        budget -= len(line.encode("utf-8"))
        if budget <= 0:
          return


def train(path: str, vocab_size: int = 32_000, megabytes: int = 100,
          output: str | None = None, threads: int | None = None
          ) -> tuple[pathlib.Path, bool]:
  """Trains (or finds) the SentencePiece model of the shards at `path`.

  Args:
    path: a directory or glob of C4 JSON-lines shards (config.data.path).
    vocab_size: pieces in the model, its EOS included (config.model.
      vocab_size must be at least this).
    megabytes: text read from the train shards, in MB (10^6 bytes).
    output: the .model file to write (default: model_path, beside the
      shards).
    threads: the trainer's threads (default: every CPU).

  Returns:
    (the model's path, whether it was trained now: False when it existed).

  Raises:
    DataError: in one line, for bad arguments, shards that cannot be read,
      a vocabulary the text cannot fill, or an output that cannot be
      written.
  """
  _check_arguments(path, vocab_size, megabytes)
  target = (pathlib.Path(os.path.expanduser(output)) if output
            else model_path(path, vocab_size, megabytes))
  if target.exists():
    return target, False
  # Without a validation shard, train shards are held out as a run with
  # config.data.hold_out_shards holds them out (its default fraction), so
  # the tokenizer never reads the text such a run evaluates on.
  shards, _ = c4_files.split_shards(path, VALIDATION_FRACTION, hold_out=True,
                                    field="--path")
  c4_files.check_first_lines(shards)
  held = sample_bytes(shards, megabytes) / _BYTES_PER_MB
  if not held:
    raise errors.DataError(f"--path: the train shards at {path!r} hold no "
                           "text")
  short = held < megabytes
  if short and not output:
    # The name says what the model holds, not what was asked for.
    target = model_path(path, vocab_size, held)
    if target.exists():
      return target, False
  if not os.access(target.parent, os.W_OK):
    raise errors.DataError(
        f"cannot write {target}: its directory is missing or not writable; "
        "pass --output= a writable path")
  sentencepiece = tokenizer_lib.import_sentencepiece()
  text = (f"all {megabytes_name(held)} MB of text of the train shards at "
          f"{path!r} (less than --megabytes={megabytes})" if short
          else f"{megabytes} MB of text of the train shards at {path!r}")
  model = io.BytesIO()
  try:
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=sample_lines(shards, megabytes),
        model_writer=model, vocab_size=vocab_size, model_type="unigram",
        byte_fallback=True, character_coverage=0.9995,
        num_threads=threads or os.cpu_count() or 1, minloglevel=2)
  except RuntimeError as error:  # what its trainer raises for bad input
    reason = _first_line(error)
    most = re.search(r"Vocabulary size too high .*value <= (\d+)", reason)
    if most:
      raise errors.DataError(
          f"--vocab_size={vocab_size} is more pieces than {text} can "
          f"fill: at most {most.group(1)}; pass --vocab_size={most.group(1)} "
          "or less (a config's model.vocab_size must be at least it), or "
          "give it more text (" + ("more shards" if short
                                   else "a larger --megabytes") + ")"
      ) from error
    raise errors.DataError(
        f"cannot train a {vocab_size}-piece SentencePiece model on {text}: "
        f"{reason}") from error
  _write_atomically(target, model.getvalue())
  return target, True


def _check_arguments(path: str, vocab_size: int, megabytes: int) -> None:
  problem = c4_files.shards_problem(path)
  if problem:
    raise errors.DataError(f"--path: {problem}")
  # Byte fallback takes 256 pieces, and unk, BOS and EOS three more; ids
  # must fit the pipeline's uint16 tokens.
  if not 260 <= vocab_size <= 65_536:
    raise errors.DataError(f"--vocab_size={vocab_size} must be in [260, "
                           "65536] (256 byte pieces, unk, BOS, EOS, and at "
                           "least one more)")
  if megabytes < 1:
    raise errors.DataError(f"--megabytes={megabytes} must be >= 1")


def _write_atomically(target: pathlib.Path, data: bytes) -> None:
  """Writes `data` to a temporary name, then renames it to `target`, so a
  reader (or a second trainer) never sees a partial model."""
  temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
  try:
    temporary.write_bytes(data)
    os.replace(temporary, target)
  except OSError as error:
    temporary.unlink(missing_ok=True)
    raise errors.DataError(
        f"cannot write {target}: {error.strerror or error}; pass --output= "
        "a writable path") from error


def _first_line(error: Exception) -> str:
  """The trainer's message without its source location ("Internal:
  src/trainer_interface.cc(664) [check] Vocabulary size too high ...")."""
  text = str(error).strip()
  line = text.splitlines()[0] if text else type(error).__name__
  return line.rsplit("] ", 1)[-1]


def main() -> None:
  """The command line: trains or finds the model, prints the flag."""
  # pylint: disable=g-import-not-at-top
  from absl import app
  from absl import flags
  path = flags.DEFINE_string(
      "path", None, "Directory or glob of C4 JSON-lines shards "
      "(config.data.path).", required=True)
  vocab_size = flags.DEFINE_integer(
      "vocab_size", 32_000, "Pieces in the model (the DiLoCo paper: 32,000).")
  megabytes = flags.DEFINE_integer(
      "megabytes", 100, "MB of text from the first train shards to train on.")
  output = flags.DEFINE_string(
      "output", None, "The .model file (default: beside the shards, named "
      "by vocab_size and megabytes).")
  threads = flags.DEFINE_integer(
      "threads", None, "Trainer threads (default: every CPU).")

  def run(argv):
    del argv  # flags only
    started = time.perf_counter()
    try:
      target, trained = train(path.value, vocab_size.value, megabytes.value,
                              output.value, threads.value)
    except errors.DataError as error:
      sys.exit(f"error: {error}")
    if trained:
      print(f"trained {target.name} on the train shards at "
            f"{path.value} in {time.perf_counter() - started:.1f} s")
    else:
      print(f"{target} exists: reused (delete it to train again)")
    print(f"--config.data.tokenizer_path={target}")

  app.run(run)


if __name__ == "__main__":
  main()
