"""The run's own files: written without following symlinks, replaced
atomically, and a failed write reported in one line.

Everything a run writes in its workdir goes through here (orbax writes the
checkpoints, under a directory the run checked). A file is created or
replaced through a uniquely named temporary file beside it (`tempfile`,
which creates with O_EXCL and so never opens an existing name) and an
atomic rename, which replaces a symlink rather than writing through it;
a file appended to or locked is opened with O_NOFOLLOW. A symlink where the
run expects its own file is refused (UnsafeFileError), so nothing outside
the workdir is ever written or truncated.

An OSError of any write (a read-only file system, a full disk, a quota, a
permission) becomes a StorageError: one line naming the path and the
operating system's reason.
"""

import contextlib
import errno
import os
import re
import tempfile


class UnsafeFileError(ValueError):
  """A path where the run writes its own file is a symlink (or not a
  regular file or directory); the message names it."""


class StorageError(RuntimeError):
  """A write that failed; the message names the path and the OS's reason."""


def refuse_symlink(path: str) -> None:
  """UnsafeFileError if `path` is a symlink (the run would write through
  it)."""
  if os.path.islink(path):
    raise UnsafeFileError(
        f"{path} is a symlink; a run writes only its own files in its "
        "workdir: remove the link or choose another workdir")


def os_reason(error: BaseException) -> str | None:
  """The operating system's reason for a failed write, in a few words
  (None: `error` is not an OS error).

  Looks through the exception and its causes for an OSError, then for the
  errno that tensorstore (orbax's writer) reports in its messages.
  """
  seen, visited = error, set()
  while seen is not None and id(seen) not in visited:
    visited.add(id(seen))
    if isinstance(seen, OSError) and seen.strerror:
      return seen.strerror
    code = re.search(r"os_error_code='?(\d+)", str(seen))
    if code:
      return os.strerror(int(code.group(1)))
    seen = seen.__cause__ or seen.__context__
  return None


def first_line(error: BaseException) -> str:
  """The first line of `error`'s message (its type when it has none)."""
  lines = str(error).strip().splitlines()
  return lines[0][:200] if lines else type(error).__name__


def storage_error(what: str, path: str, error: BaseException) -> StorageError:
  """A StorageError saying `what` failed at `path`, and why."""
  return StorageError(f"cannot write {what} {path}: "
                      f"{os_reason(error) or first_line(error)}")


def write_atomically(path: str, text: str) -> None:
  """Replaces `path` with `text`: a reader (or a crash) sees the old file
  or the new one, never part of one.

  Raises:
    UnsafeFileError: `path` is a symlink.
    StorageError: the write failed (the old file, if any, is untouched).
  """
  refuse_symlink(path)
  directory, name = os.path.split(path)
  tmp = None
  try:
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp",
                               dir=directory)
    with os.fdopen(fd, "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide outputs from others
    os.replace(tmp, path)
    tmp = None
  except OSError as e:
    raise storage_error("file", path, e) from None
  finally:
    if tmp is not None:
      with contextlib.suppress(OSError):
        os.remove(tmp)


def open_append(path: str):
  """`path` opened to append text, created if missing, never through a
  symlink.

  Raises:
    UnsafeFileError: `path` is a symlink.
    StorageError: it cannot be opened for writing.
  """
  try:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                 0o644)
  except OSError as e:
    if e.errno == errno.ELOOP:
      refuse_symlink(path)
    raise storage_error("file", path, e) from None
  return os.fdopen(fd, "a")


def open_no_follow(path: str) -> int:
  """A read-write descriptor of `path` (created if missing, not truncated),
  never through a symlink.

  Raises:
    UnsafeFileError: `path` is a symlink.
    OSError: it cannot be opened.
  """
  try:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
  except OSError as e:
    if e.errno == errno.ELOOP:
      refuse_symlink(path)
    raise
