"""Resolving `config.data.path` to the text files of a corpus, and
refusing files that are not text."""
import codecs
import glob
import os
import pathlib

from diloco_jax.data import errors

_GLOB_CHARACTERS = frozenset("*?[")
# How much of each file is read to tell text from binary (as git and
# grep do, a block from the start).
_PROBE_BYTES = 8192


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


def not_text_reason(head: bytes) -> str | None:
  """Why a file starting with `head` is not UTF-8 text (None: it is).

  A NUL byte or a sequence that is not UTF-8 (ASCII is UTF-8) marks a
  binary file, or text in another encoding; a character cut at the end
  of `head` is allowed.
  """
  nul = head.find(b"\0")
  if nul >= 0:
    return f"a NUL byte at offset {nul}"
  try:
    codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
  except UnicodeDecodeError as e:
    return f"byte 0x{head[e.start]:02x} at offset {e.start} is not UTF-8"
  return None


def check_text(root: pathlib.Path, relative_paths: list[str],
               path: str) -> None:
  """Raises DataError naming the first of the files that cannot be read,
  or else the first that is not text.

  Reads the first 8 KiB of each. A file that cannot be read (its
  permissions, or removed since it was listed) is refused too: every file
  the path names is a document of the corpus, and one dropped silently
  would change the corpus unseen.

  Args:
    root, relative_paths: the files, as resolve_text_files gives them.
    path: config.data.path, for the message.
  """
  refused, unreadable = [], []
  for relative in relative_paths:
    try:
      with open(root / relative, "rb") as f:
        reason = not_text_reason(f.read(_PROBE_BYTES))
    except OSError as error:
      unreadable.append((relative, error.strerror or str(error)))
      continue
    if reason:
      refused.append((relative, reason))
  if unreadable:
    raise _refusal(
        path, root, unreadable, len(relative_paths), "cannot read {file} "
        "({reason}){more}; corpus 'text_files' reads every file the path "
        "names: make it readable, or name only readable files")
  if refused:
    raise _refusal(
        path, root, refused, len(relative_paths), "{file} is not UTF-8 "
        "text ({reason}){more}; corpus 'text_files' reads plain text files: "
        "give a file, directory or glob of text only (e.g. DIR/**/*.txt)")


def _refusal(path: str, root: pathlib.Path, files: list, total: int,
             template: str) -> errors.DataError:
  """One line naming the first of `files` ((relative path, reason)) and
  counting the others."""
  relative, reason = files[0]
  more = (f" (and {len(files) - 1} more of the {total} files)"
          if len(files) > 1 else "")
  return errors.DataError(f"config.data.path={path!r}: " + template.format(
      file=root / relative, reason=reason, more=more))
