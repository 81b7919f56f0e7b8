r"""C4's English shards as the public allenai/c4 dataset serves them.

  python -m diloco_jax.data.c4_download --dir=~/c4 --train_shards=8

fetches en/c4-train.00000-of-01024.json.gz onwards and
en/c4-validation.00000-of-00008.json.gz from the Hugging Face Hub over
HTTPS (no account or package needed): the JSON-lines files c4_files reads
with --config.data.path=~/c4. Its dataset card gives 1,024 train shards
of about 356,000 documents each (about 320 MB gzipped) and 8 validation
shards of about 45,600.

A file that is there already is kept. Each download goes to a hidden
temporary name and is renamed when complete, so a cut-off download is
never read as a shard; rerunning the command fetches what is missing.
"""
from collections.abc import Callable
import http.client
import os
import pathlib
import shutil
import sys
import urllib.error
import urllib.request

from diloco_jax.data import errors

BASE_URL = "https://huggingface.co/datasets/allenai/c4/resolve/main/en/"
TRAIN_SHARDS = 1024
VALIDATION_SHARDS = 8
_TIMEOUT_S = 60  # per read: a stalled connection fails instead of hanging


def shard_name(split: str, index: int) -> str:
  """C4's file name of shard `index` of "train" or "validation"."""
  count = TRAIN_SHARDS if split == "train" else VALIDATION_SHARDS
  return f"c4-{split}.{index:05d}-of-{count:05d}.json.gz"


def shard_names(train_shards: int, validation_shards: int) -> list[str]:
  """The first `train_shards` train and `validation_shards` validation
  file names (DataError if the counts are out of range)."""
  for flag, count, most in (("train_shards", train_shards, TRAIN_SHARDS),
                            ("validation_shards", validation_shards,
                             VALIDATION_SHARDS)):
    if not 1 <= count <= most:
      raise errors.DataError(f"--{flag}={count} must be in [1, {most}]")
  return ([shard_name("train", index) for index in range(train_shards)]
          + [shard_name("validation", index)
             for index in range(validation_shards)])


def fetch(directory: str, train_shards: int = 1, validation_shards: int = 1,
          base_url: str = BASE_URL,
          report: Callable[[str], None] = lambda line: None
          ) -> list[pathlib.Path]:
  """Fetches the first shards into `directory`, keeping those there.

  Args:
    directory: where the shards go (created if missing).
    train_shards, validation_shards: how many of each, from index 0.
    base_url: the URL the file names are appended to.
    report: called with a line per shard fetched.

  Returns:
    The shards' paths, train then validation.

  Raises:
    DataError: in one line, naming the URL or path and the reason.
  """
  names = shard_names(train_shards, validation_shards)
  root = pathlib.Path(os.path.expanduser(directory))
  try:
    root.mkdir(parents=True, exist_ok=True)
  except OSError as error:
    raise errors.DataError(f"--dir: cannot create {root}: "
                           f"{error.strerror or error}") from error
  paths = [root / name for name in names]
  missing = [path for path in paths if not path.exists()]
  for number, path in enumerate(missing, 1):
    report(f"fetching {path.name} ({number} of {len(missing)})")
    download(base_url + path.name, path)
  return paths


def download(url: str, target: pathlib.Path) -> None:
  """Copies `url` to `target` through a temporary file, checking the
  length the server announced (a connection closed early is otherwise
  a silent short file)."""
  partial = target.with_name(f".{target.name}.part")
  try:
    with (urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response,
          open(partial, "wb") as out):
      shutil.copyfileobj(response, out, 1 << 20)
      announced = response.headers.get("Content-Length")
    received = partial.stat().st_size
    if announced is not None and received != int(announced):
      raise errors.DataError(f"cannot fetch {url}: the connection closed "
                             f"after {received} of {announced} bytes; rerun "
                             "to fetch it again")
    os.replace(partial, target)
  except (OSError, http.client.HTTPException) as error:  # URLError is one
    reason = (error if isinstance(error, urllib.error.HTTPError)
              else getattr(error, "reason", None)
              or getattr(error, "strerror", None) or repr(error))
    raise errors.DataError(f"cannot fetch {url}: {reason}") from error
  finally:
    partial.unlink(missing_ok=True)


def main() -> None:
  """The command line: fetches the shards, prints the flag for a run."""
  # pylint: disable=g-import-not-at-top
  from absl import app
  from absl import flags
  directory = flags.DEFINE_string("dir", None, "Where the shards go.",
                                  required=True)
  train_shards = flags.DEFINE_integer(
      "train_shards", 1, f"Train shards, from the first (of {TRAIN_SHARDS}).")
  validation_shards = flags.DEFINE_integer(
      "validation_shards", 1,
      f"Validation shards, from the first (of {VALIDATION_SHARDS}).")

  def run(argv):
    del argv  # flags only
    try:
      paths = fetch(directory.value, train_shards.value,
                    validation_shards.value, report=print)
    except errors.DataError as error:
      sys.exit(f"error: {error}")
    print(f"{len(paths)} shards in {paths[0].parent}: "
          f"--config.data.path={paths[0].parent}")

  app.run(run)


if __name__ == "__main__":
  main()
