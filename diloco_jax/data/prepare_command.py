"""`python -m diloco_jax.data.prepare`'s command line (prepare.py says what
it does): its flags, `--verify`, and every failure as one `error:` line."""
import os
import sys
import time

from diloco_jax.data import errors
from diloco_jax.data import prepare
from diloco_jax.data import prepare_plan
from diloco_jax.data import shard_files
from diloco_jax.data import token_shards


def _verify_command(output: str) -> None:
  """--verify: every shard of `output` read and checked, in one line."""
  started = time.perf_counter()
  try:
    index = token_shards.read_index(output, field="--output", unchecked=True)
    old = not all(shard.sha256 for shards in index.splits.values()
                  for shard in shards)
    index = shard_files.verify(index)
  except errors.DataError as error:
    sys.exit(f"error: {error}")
  gigabytes = sum(shard.tokens for shards in index.splits.values()
                  for shard in shards) * index.dtype.itemsize / 1e9
  print(f"{'recorded the checksums of' if old else 'verified'} "
        f"{sum(len(shards) for shards in index.splits.values())} shards "
        f"({gigabytes:.2f} GB) in {index.directory} in "
        f"{time.perf_counter() - started:.1f} s")


def main() -> None:
  """The command line: checks everything, prepares, prints the run flags."""
  # pylint: disable=g-import-not-at-top
  from absl import app
  from absl import flags
  corpus = flags.DEFINE_string(
      "corpus", "c4", "What --path holds (as config.data.corpus): "
      f"{' or '.join(prepare_plan.CORPORA)}.")
  path = flags.DEFINE_string(
      "path", None, "C4 JSON-lines shards (a directory or glob), the TFDS "
      "data_dir with --tfds_name, or text files (as config.data.path); "
      "required unless --verify.")
  output = flags.DEFINE_string(
      "output", None, "The directory of token shards to write (new or "
      "empty, or this prepare's own to resume it).", required=True)
  tokenizer_path = flags.DEFINE_string(
      "tokenizer_path", "", "A SentencePiece .model (as config.data."
      "tokenizer_path); empty: the byte tokenizer.")
  tfds_name = flags.DEFINE_string(
      "tfds_name", "", "A TFDS dataset, e.g. c4/en (as config.data."
      "tfds_name).")
  validation_fraction = flags.DEFINE_float(
      "validation_fraction", 0.05, "Files held out for validation when none "
      "is named '*validation*' (as config.data.validation_fraction).")
  hold_out_shards = flags.DEFINE_bool(
      "hold_out_shards", False, "C4 shards none of which is named "
      "'*validation*': hold out --validation_fraction of them for "
      "validation (as config.data.hold_out_shards); without it they are "
      "refused.")
  processes = flags.DEFINE_integer(
      "processes", len(os.sched_getaffinity(0)),
      "Worker processes, one shard each at a time (default: every CPU).")
  verify = flags.DEFINE_bool(
      "verify", False, "Read every shard of the prepared --output and check "
      "it against its index (sha256, largest id, size); an index an older "
      "prepare wrote without checksums gets them. Writes no shard.")

  def run(argv):
    del argv  # flags only
    if verify.value:
      _verify_command(output.value)
      return
    if not path.value:
      sys.exit("error: --path is required (the input to prepare), unless "
               "--verify checks a prepared --output")
    try:
      try:
        plan = prepare_plan.make_plan(
            corpus.value, path.value, output.value, tokenizer_path.value,
            tfds_name.value, validation_fraction.value,
            hold_out_shards.value)
      except OSError as error:  # an input removed while the plan read it
        raise errors.DataError(f"cannot read {error.filename}: "
                               f"{error.strerror or error}") from None
      index = prepare.prepare(plan, processes.value)
    except errors.DataError as error:
      sys.exit(f"error: {error}")
    except KeyboardInterrupt:
      sys.exit(f"stopped: the finished shards are kept in {output.value}; "
               "rerun the same command to make the others")
    print(f"{index.tokens('train'):,} train and "
          f"{index.tokens('validation'):,} validation tokens "
          f"({index.dtype_name}) in {index.directory}")
    flags_line = (f"--config.data.corpus=tokens "
                  f"--config.data.path={index.directory}")
    if tokenizer_path.value:
      flags_line += (" --config.data.tokenizer=sentencepiece "
                     f"--config.data.tokenizer_path={tokenizer_path.value}")
    print(flags_line)

  def parse(argv):
    try:
      return app.parse_flags_with_usage(argv)
    except SystemExit as stop:
      # absl exits 1 after printing the help it was asked for: no error.
      if stop.code == 1 and any(arg.startswith("-") and
                                arg.lstrip("-") in _HELP_FLAGS
                                for arg in argv[1:]):
        sys.exit(0)
      raise

  app.run(run, flags_parser=parse)


_HELP_FLAGS = ("help", "?", "helpshort", "helpfull", "helpxml")
