"""Deterministic train/validation split by file.

Splitting by file (not by sequence) keeps validation text unseen during
training, and hashing the relative path makes the assignment independent of
which other files exist, of their order and of the machine.
"""
from collections.abc import Sequence
import zlib

SPLITS = ("train", "validation")


def is_validation_file(relative_path: str, validation_fraction: float) -> bool:
  """Whether the file at `relative_path` (POSIX form) belongs to validation."""
  return zlib.crc32(relative_path.encode()) % 1000 < validation_fraction * 1000


def check_split(split: str) -> None:
  """Raises ValueError unless `split` is one of SPLITS."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def select_split(relative_paths: Sequence[str], split: str,
                 validation_fraction: float) -> list[int]:
  """Indices of `relative_paths` that belong to `split`, in input order."""
  check_split(split)
  want_validation = split == "validation"
  return [
      index for index, path in enumerate(relative_paths)
      if is_validation_file(path, validation_fraction) == want_validation
  ]
