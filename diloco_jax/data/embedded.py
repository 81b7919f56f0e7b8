"""The default corpus: Python sources of the running interpreter's stdlib.

It is present on every machine that runs this code, needs no network, and is
large enough (tens of millions of bytes) to train small models meaningfully.
"""
from collections.abc import Iterable, Iterator
import os
import pathlib
import sysconfig

from diloco_jax.data import errors
from diloco_jax.data import file_split

# Third-party packages differ between machines; leaving them out keeps the
# corpus identical for everyone with the same Python version.
_EXCLUDED_DIRECTORIES = frozenset({"site-packages", "dist-packages"})


def stdlib_root() -> pathlib.Path:
  """The directory of the running interpreter's standard library."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _all_stdlib_sources(root: pathlib.Path) -> list[str]:
  """Relative POSIX paths of every `*.py` under `root`, sorted."""
  relative_paths = []
  # os.walk without following links cannot loop and is faster than rglob.
  for directory, subdirectories, filenames in os.walk(root):
    subdirectories[:] = [
        name for name in subdirectories if name not in _EXCLUDED_DIRECTORIES
    ]
    relative_directory = pathlib.PurePath(directory).relative_to(root)
    for name in filenames:
      if name.endswith(".py"):
        relative_paths.append((relative_directory / name).as_posix())
  return sorted(relative_paths)


def stdlib_source_files(split: str,
                        validation_fraction: float) -> list[pathlib.Path]:
  """Stdlib `*.py` files of `split` ("train" or "validation"), sorted.

  A file is in validation when crc32(relative path) % 1000 is below
  validation_fraction * 1000 (see file_split).
  """
  file_split.check_split(split)
  root = stdlib_root()
  relative_paths = _all_stdlib_sources(root)
  selected = file_split.select_split(relative_paths, split, validation_fraction)
  return [root / relative_paths[index] for index in selected]


def read_documents(paths: Iterable[pathlib.Path],
                   skip_unreadable: bool = True) -> Iterator[bytes]:
  """Yields the contents of each readable, non-empty file, in order.

  Empty files (many `__init__.py`) are skipped because they would only add
  stray EOS tokens. A file that cannot be read is skipped too (the stdlib
  corpus: an interpreter's odd file does not fail a run), or, with
  skip_unreadable=False (a corpus the user names, whose every file counts),
  is a DataError naming it, in one line: one made unreadable, or removed,
  since the files were listed.
  """
  for path in paths:
    try:
      content = pathlib.Path(path).read_bytes()
    except OSError as error:
      if skip_unreadable:
        continue
      raise errors.DataError(
          f"cannot read {path}: {error.strerror or error}") from None
    if content:
      yield content
