"""Resolving `config.data.path` to the text files of a corpus."""
import glob
import os
import pathlib

_GLOB_CHARACTERS = frozenset("*?[")


def is_glob(path: str) -> bool:
  """Whether `path` contains glob wildcards."""
  return any(character in _GLOB_CHARACTERS for character in path)


def resolve_text_files(path: str) -> tuple[pathlib.Path, list[str]]:
  """Resolves a file, directory or glob to (root, sorted relative paths).

  The relative POSIX paths (relative to `root`) name the files for the split
  by file, so the split does not depend on where the corpus is stored. A
  directory contributes every file under it, recursively. Returns an empty
  list when nothing matches.
  """
  expanded = os.path.expanduser(path)
  candidate = pathlib.Path(expanded)
  if candidate.is_file():
    return candidate.parent, [candidate.name]
  if candidate.is_dir():
    files = [entry for entry in candidate.rglob("*") if entry.is_file()]
    return candidate, sorted(entry.relative_to(candidate).as_posix()
                             for entry in files)
  if not is_glob(expanded):
    return candidate, []
  files = [pathlib.Path(match)
           for match in glob.glob(expanded, recursive=True)
           if os.path.isfile(match)]
  if not files:
    return candidate, []
  root = pathlib.Path(os.path.commonpath([file.parent for file in files]))
  return root, sorted(file.relative_to(root).as_posix() for file in files)


def path_problem(path: str) -> str | None:
  """Why `path` names no text files, or None when it names some.

  Cheap: stops at the first file found and reads nothing.
  """
  expanded = os.path.expanduser(path)
  candidate = pathlib.Path(expanded)
  if candidate.is_file():
    return None
  if candidate.is_dir():
    if any(entry.is_file() for entry in candidate.rglob("*")):
      return None
    return f"directory {path!r} contains no files"
  if is_glob(expanded):
    if any(os.path.isfile(match)
           for match in glob.iglob(expanded, recursive=True)):
      return None
    return f"no files match {path!r}"
  return f"{path!r} does not exist"
