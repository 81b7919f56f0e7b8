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

A file the run appends to for its whole life (metrics.jsonl, TensorBoard's
events) is an `AppendedFile`: before each write it checks that its path
still names the file it holds open. One removed (or replaced) meanwhile is
written again from the open copy, with one warning line, so no record is
lost; where it cannot be (its directory is gone), that is a failed write.

An OSError of any write (a read-only file system, a full disk, a quota, a
permission) becomes a StorageError: one line naming the path and the
operating system's reason.
"""

import contextlib
import errno
import os
import re
import tempfile
import time

from absl import logging


class UnsafeFileError(ValueError):
  """A path where the run writes its own file is a symlink (or not a
  regular file or directory); the message names it."""


class StorageError(RuntimeError):
  """A write that failed; the message names the path and the OS's reason.

  Attributes:
    removed: whether it failed because what it wrote was removed under
      the run (its file or directory, or the workdir: ENOENT).
  """

  def __init__(self, message: str, removed: bool | None = None):
    super().__init__(message)
    self.removed = (message.endswith(os.strerror(errno.ENOENT))
                    if removed is None else removed)


def refuse_symlink(path: str) -> None:
  """UnsafeFileError if `path` is a symlink (the run would write through
  it)."""
  if os.path.islink(path):
    raise UnsafeFileError(
        f"{path} is a symlink; a run writes only its own files in its "
        "workdir: remove the link or choose another workdir")


# How tensorstore and orbax (0.12) say that what a save was writing is
# gone: a NOT_FOUND status, and orbax's ValueErrors when a save's
# directory was removed before its array metadata were read back (its
# helper threads may have made the directory again, empty, meanwhile).
_REMOVED_UNDER_A_SAVE = ("NOT_FOUND: ", "No ArrayMetadata found for ",
                         "Checkpoint directory does not exist: ")


def os_reason(error: BaseException) -> str | None:
  """The operating system's reason for a failed write, in a few words
  (None: `error` is not an OS error).

  Looks through the exception and its causes for an OSError, then for the
  errno that tensorstore (orbax's writer) reports in its messages. A
  tensorstore NOT_FOUND status carries no errno: it says a file or
  directory being written is gone (removed under the run), which is
  ENOENT; so do the ValueErrors orbax raises when a save's directory or
  the array metadata it wrote there is gone (_REMOVED_UNDER_A_SAVE).
  """
  seen, visited = error, set()
  while seen is not None and id(seen) not in visited:
    visited.add(id(seen))
    if isinstance(seen, OSError) and seen.strerror:
      return seen.strerror
    code = re.search(r"os_error_code='?(\d+)", str(seen))
    if code:
      return os.strerror(int(code.group(1)))
    if str(seen).startswith(_REMOVED_UNDER_A_SAVE):
      return os.strerror(errno.ENOENT)
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


def write_atomically(path: str, text: str | bytes,
                     what: str = "file") -> None:
  """Replaces `path` with `text` (str or bytes): a reader (or a crash)
  sees the old file or the new one, never part of one.

  Raises:
    UnsafeFileError: `path` is a symlink.
    StorageError: the write failed (the old file, if any, is untouched);
      its message calls the file `what`.
  """
  refuse_symlink(path)
  directory, name = os.path.split(path)
  tmp = None
  try:
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp",
                               dir=directory)
    with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide outputs from others
    os.replace(tmp, path)
    tmp = None
  except OSError as e:
    raise storage_error(what, path, e) from None
  finally:
    if tmp is not None:
      with contextlib.suppress(OSError):
        os.remove(tmp)


class AppendedFile:
  """A file the run appends to while it runs, never through a symlink,
  and kept whole if it is removed or replaced meanwhile.

  Each `append` reaches the operating system at once (no buffer to lose or
  to fail later). Before each, the path is checked to still name the file
  held open: a file removed (`rm metrics.jsonl`) or replaced under the run
  is written again at its path from the open copy, which holds every
  record, and the run says so in one line. A file that cannot be written
  (its directory is gone, the disk is full) raises StorageError, and what
  the failed write had written of its data is taken back: the file ends
  in whole records, never a torn one.

  Its workdir being removed (the sentinel gone) is a failed write, not a
  removal to repair: every append checks first (a copy written again just
  before, `rm -r` having removed the file before the sentinel, is removed
  when the run releases its workdir: workdir.Claim.release).
  """

  def __init__(self, path: str, what: str, exclusive: bool = False,
               remake_directory: bool = False, sentinel: str | None = None):
    """Opens `path` to append, creating it if missing.

    Args:
      path: the file.
      what: what it holds, for messages (e.g. "metrics").
      exclusive: refuse a file that exists already (FileExistsError).
      remake_directory: a removed parent directory is made again (one
        level only: a removed workdir is never made again).
      sentinel: a file (the workdir's run.lock) whose absence means the
        file was removed with its whole workdir: it is then not written
        again (StorageError), so a run never brings back, file by file,
        a workdir being removed.

    Raises:
      UnsafeFileError: `path` is a symlink.
      StorageError: it cannot be opened for writing.
    """
    self.path, self._what = path, what
    self._remake_directory, self._sentinel = remake_directory, sentinel
    self._fd = self._open(exclusive)

  def _open(self, exclusive: bool) -> int:
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
    try:
      return os.open(self.path, flags | (os.O_EXCL if exclusive else 0),
                     0o644)
    except FileExistsError:
      raise  # only with O_EXCL: the caller picks another name
    except OSError as e:
      if e.errno == errno.ELOOP:
        refuse_symlink(self.path)
      raise storage_error(self._what, self.path, e) from None

  def append(self, data: bytes) -> None:
    """Writes `data` at the end of the file.

    Raises:
      StorageError: it cannot be written, or written again after it was
        removed.
      UnsafeFileError: a symlink replaced it.
    """
    if self.workdir_removed():
      raise StorageError(
          f"cannot write {self._what} {self.path}: {self._sentinel} was "
          "removed (the workdir is being removed)", removed=True)
    if not self._holds_path():
      self._restore()
    try:
      end = os.fstat(self._fd).st_size  # where `data` starts
    except OSError as e:
      raise storage_error(self._what, self.path, e) from None
    try:
      while data:
        data = data[os.write(self._fd, data):]
    except OSError as e:
      # A write cut short (a full disk) is taken back whole: a reader, or
      # a resumed run appending, never meets half a record.
      with contextlib.suppress(OSError):
        os.ftruncate(self._fd, end)
      raise storage_error(self._what, self.path, e) from None

  def workdir_removed(self) -> bool:
    """Whether the sentinel is gone: the workdir is being removed."""
    return bool(self._sentinel) and not os.path.lexists(self._sentinel)

  def _holds_path(self) -> bool:
    """Whether the path still names the file held open: it exists, and
    the file held has a name (a link count, 0 once removed or replaced by
    a rename). Inode numbers are not compared: some FUSE mounts of
    buckets do not keep them stable."""
    try:
      os.stat(self.path, follow_symlinks=False)
    except FileNotFoundError:
      return False
    except OSError as e:
      raise storage_error(self._what, self.path, e) from None
    return os.fstat(self._fd).st_nlink > 0

  def _restore(self) -> None:
    """Writes the open copy at the path again and appends there from now
    on (not before a removal of the whole workdir under way has had
    _SETTLE_S to reach the sentinel)."""
    if self._sentinel and not self.workdir_removed():
      time.sleep(_SETTLE_S)  # a rare event: this once
    if self.workdir_removed():
      raise StorageError(
          f"cannot write {self._what} {self.path}: it was removed, and "
          f"{self._sentinel} with it (the workdir is being removed)",
          removed=True)
    size = os.fstat(self._fd).st_size
    data = os.pread(self._fd, size, 0) if size else b""
    while len(data) < size:  # pread may return less than asked
      more = os.pread(self._fd, size - len(data), len(data))
      if not more:
        break
      data += more
    if self._remake_directory:
      with contextlib.suppress(FileExistsError, FileNotFoundError):
        os.mkdir(os.path.dirname(self.path))
    write_atomically(self.path, data, what=self._what)
    os.close(self._fd)
    self._fd = self._open(exclusive=False)
    logging.warning("%s was removed or replaced while the run wrote it; "
                    "wrote it again from the run's open copy (%d bytes): "
                    "nothing is lost", self.path, len(data))

  def close(self) -> None:
    if self._fd is not None:
      fd, self._fd = self._fd, None
      os.close(fd)


# How long a file found removed waits before it is written again: `rm -r`
# of a workdir removes it in directory order, its sentinel within a few
# milliseconds after as a rule (for the rest: workdir.Claim.release).
_SETTLE_S = 0.05


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
