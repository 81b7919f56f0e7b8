"""The workdir: checked before anything is compiled, and held by one run.

`claim(workdir)` is the first thing a run does with its workdir. It refuses
an empty path, a path it cannot create or write (the workdir, or its
checkpoints/ or tensorboard/ where they exist), a workdir holding run
outputs that cannot be resumed, and a symlink where the run keeps one of
its own files or directories (files.py); then it takes an advisory lock
that lasts for the run's life. The lock is an `fcntl.flock` on
`workdir/run.lock`: the kernel drops it when the process ends in any way,
SIGKILL included, so a dead run never leaves a stale lock behind, and a
second run into the same workdir stops at once with the holder's pid
instead of interleaving its metrics and checkpoints with the first.

A run that fails before writing any output leaves no trace: releasing the
claim of a workdir it created removes the lock, config.json, the files it
opened but wrote nothing in (a disk full at start) and the empty
directories.

The workdir is a local (or mounted) path: the lock, the metrics and the
checkpoints are written through the operating system's files, so a URL
(`gs://...`, `s3://...`) is refused (`refuse_url`) rather than becoming a
local directory named `gs:`. A bucket is used mounted (gcsfuse, s3fs),
with one run writing into a workdir at a time (BUILD.md).
"""

import contextlib
import errno
import fcntl
import os
import re
import shutil
import stat
import time

from diloco_jax.storage import files

LOCK_FILE = "run.lock"
RUN_FILES = ("metrics.jsonl", "summary.json")
# Every name the run creates or replaces in its workdir (orbax writes under
# checkpoints/, tensorboardX under tensorboard/).
OWN_NAMES = (LOCK_FILE, *RUN_FILES, "config.json", "checkpoints",
             "checkpoints.unreadable", "tensorboard", "pretrain",
             "coordinator")  # (an elastic run's checkpoints)


class WorkdirError(ValueError):
  """A workdir this run cannot use; the message names it and says why."""


# scheme:// as in RFC 3986 (gs://, s3://, hdfs://, file://).
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def refuse_url(workdir) -> None:
  """Raises WorkdirError if `workdir` is a URL; creates nothing."""
  if isinstance(workdir, str) and _URL.match(workdir.strip()):
    raise WorkdirError(
        f"--workdir={workdir} is a URL, but the run writes its workdir "
        "through local files; mount the bucket (e.g. gcsfuse or s3fs) and "
        "give the mounted path")


class WorkdirLock:
  """An exclusive advisory lock on a workdir, held until release()."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    while True:
      self._fd = self._lock(workdir)
      # A run that removed the file (release(remove=True)) after this one
      # opened it leaves this one holding a lock on a name no other run
      # sees: lock again, on the file there is now.
      if _same_file(self._fd, self.path):
        break
      os.close(self._fd)
    try:
      os.ftruncate(self._fd, 0)
      os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as e:  # a full disk
      # Its file goes too: a run that failed to start leaves nothing.
      self.release(remove=True)
      raise WorkdirError(f"--workdir={workdir}: cannot write {self.path}: "
                         f"{e.strerror}") from None

  def _lock(self, workdir: str) -> int:
    try:
      # Without O_TRUNC: a refused run must not erase the holder's pid.
      fd = files.open_no_follow(self.path)
    except OSError as e:
      raise WorkdirError(f"--workdir={workdir}: cannot write {self.path}: "
                         f"{e.strerror}") from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
      os.close(fd)
      if e.errno not in (errno.EAGAIN, errno.EACCES):
        raise WorkdirError(f"--workdir={workdir}: cannot lock {self.path}: "
                           f"{e.strerror}") from None
      raise WorkdirError(
          f"--workdir={workdir} is in use by another run (pid "
          f"{holder or 'unknown'}); wait for it to end or choose another "
          "workdir") from None
    return fd

  def release(self, remove: bool = False) -> None:
    """Drops the lock; `remove` also deletes the file (while still held,
    so a run that opened it meanwhile sees it gone and locks anew)."""
    if self._fd is not None:
      fd, self._fd = self._fd, None
      try:
        if remove:
          with contextlib.suppress(OSError):
            os.remove(self.path)
        else:
          with contextlib.suppress(OSError):  # the holder's pid goes
            os.ftruncate(fd, 0)
      finally:
        os.close(fd)  # closing the last descriptor releases the flock

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.release()


def _same_file(fd: int, path: str) -> bool:
  try:
    on_disk = os.stat(path, follow_symlinks=False)
  except FileNotFoundError:
    return False
  held = os.fstat(fd)
  return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


class Claim:
  """A workdir held by this run.

  Attributes:
    workdir: the absolute path.
    lock: its WorkdirLock (None on processes that take none).
    created: whether this claim created the directory.
  """

  def __init__(self, workdir: str, lock: WorkdirLock | None, created: bool):
    self.workdir, self.lock, self.created = workdir, lock, created

  def release(self, after_a_removal: bool = False) -> None:
    """Drops the lock (once; later calls do nothing); a directory this
    claim created that holds no output (_no_output_files) is removed with
    it.

    A workdir being removed under the run (`rm -r`: its lock and
    config.json gone) is not the run's to keep: what the run's own names
    still hold there is removed, and the directory if that empties it.
    That is what the run wrote since the removal listed them (a file
    written again before the removal reached the lock, the rest of a
    checkpoint that orbax's threads were writing); `rm -r` would have
    removed them but for that, and failed on a directory not empty.
    After a write that failed for something removed (`after_a_removal`),
    a removal of the workdir still under way gets up to _REMOVAL_WAIT_S
    to reach its lock and config.json. Never raises OSError: the workdir
    may go at any moment.
    """
    lock, self.lock = self.lock, None
    if lock is None:
      return
    deadline = time.monotonic() + (_REMOVAL_WAIT_S if after_a_removal
                                   else 0)
    while not _being_removed(self.workdir) and time.monotonic() < deadline:
      time.sleep(0.02)
    removed = _being_removed(self.workdir)
    try:
      unused = (_no_output_files(self.workdir)
                if self.created and not removed else None)
    except OSError:  # removed under the run: nothing to remove
      unused = None
    lock.release(remove=unused is not None)
    if removed:
      unused = [os.path.join(self.workdir, name) for name in OWN_NAMES
                if name != LOCK_FILE]  # (another run's, if there is one)
    for path in unused or ():
      if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
      else:
        with contextlib.suppress(OSError):
          os.remove(path)
    if unused is not None:
      _remove_empty_directories(self.workdir)


# How long a run that failed to write waits for a removal of its workdir
# under way to reach the workdir's lock and config.json (`rm -r` removes
# in directory order).
_REMOVAL_WAIT_S = 1.0


def _being_removed(workdir: str) -> bool:
  """Whether the workdir's lock and config.json are gone: `rm -r` (they
  are the run's; no run goes on without them)."""
  return not any(os.path.lexists(os.path.join(workdir, name))
                 for name in (LOCK_FILE, "config.json"))


def _no_output_files(workdir: str) -> list[str] | None:
  """The files of `workdir` if it holds no output, else None.

  No output: besides the lock, config.json (the run's settings, written
  first) and empty files (metrics.jsonl or an event file opened but not
  written: a disk full at start), in the workdir or in its directories,
  which hold nothing else (checkpoints/ as orbax makes it).
  """
  found = []
  for name in os.listdir(workdir):
    path = os.path.join(workdir, name)
    if name == LOCK_FILE:
      continue
    if os.path.isdir(path) and not os.path.islink(path):
      for inner in os.listdir(path):
        if not _is_empty_file(os.path.join(path, inner)):
          return None
        found.append(os.path.join(path, inner))
    elif name == "config.json" or _is_empty_file(path):
      found.append(path)
    else:
      return None
  return found


def _is_empty_file(path: str) -> bool:
  found = os.stat(path, follow_symlinks=False)
  return stat.S_ISREG(found.st_mode) and found.st_size == 0


def _remove_empty_directories(workdir: str) -> None:
  """Removes `workdir`'s empty directories, then itself if it is empty."""
  with contextlib.suppress(OSError):
    for name in os.listdir(workdir):
      with contextlib.suppress(OSError):
        os.rmdir(os.path.join(workdir, name))  # empty ones only
  with contextlib.suppress(OSError):
    os.rmdir(workdir)


def _check_path(workdir, checkpoints: str = "checkpoints"
                ) -> tuple[str, bool]:
  """(the absolute workdir, whether it was created now)."""
  if not isinstance(workdir, str) or not workdir.strip():
    raise WorkdirError(f"--workdir={workdir!r}: give a directory for the "
                       "run's outputs")
  refuse_url(workdir)
  workdir = os.path.abspath(workdir)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(f"--workdir={workdir} is a file, not a directory")
  created = not os.path.exists(workdir)
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise WorkdirError(f"--workdir={workdir}: cannot create it: "
                       f"{e.strerror}") from None
  # access(2) also answers for read-only file systems.
  for path in (workdir, *(os.path.join(workdir, name)
                          for name in (checkpoints, "tensorboard"))):
    if os.path.isdir(path) and not os.access(path, os.W_OK | os.X_OK):
      raise WorkdirError(f"--workdir={workdir}: {path} is not writable ("
                         + os.strerror(_write_errno(path)) + ")")
  return workdir, created


def _write_errno(path: str) -> int:
  """Why `path` cannot be written: EROFS on a read-only mount, else
  EACCES."""
  return (errno.EROFS if os.statvfs(path).f_flag & os.ST_RDONLY
          else errno.EACCES)


def _check_own_names(workdir: str) -> None:
  """Refuses a symlink where the run keeps its own files (it would write
  through it, outside the workdir)."""
  for name in OWN_NAMES:
    try:
      files.refuse_symlink(os.path.join(workdir, name))
    except files.UnsafeFileError as e:
      raise WorkdirError(f"--workdir={workdir}: {e}") from None


def _check_outputs(workdir: str, checkpoints: str = "checkpoints") -> None:
  """Refuses a workdir holding run outputs that cannot be resumed."""
  if os.path.isdir(os.path.join(workdir, checkpoints)):
    return
  for name in RUN_FILES:
    if os.path.exists(os.path.join(workdir, name)):
      raise WorkdirError(
          f"--workdir={workdir} holds {name} but no checkpoints to resume "
          "from; choose a new workdir or delete that one")


def claim(workdir: str, lock: bool = True,
          checkpoints: str = "checkpoints") -> Claim:
  """Checks `workdir`, creates it, and locks it for this run.

  Args:
    workdir: the run's output directory (created if missing).
    lock: take the lock (False on the processes of a multi-host run other
      than process 0, which write nothing there).
    checkpoints: the directory of the workdir that holds the run's
      checkpoints ("coordinator" for an elastic run's coordinator).

  Returns:
    The Claim; release it when the run ends (the lock is also released
    when the process dies).

  Raises:
    WorkdirError: the path is empty, a URL, not a directory, not writable,
      holds outputs without checkpoints or a symlink where the run keeps its
      own file, or another run holds the lock.
  """
  workdir, created = _check_path(workdir, checkpoints)
  try:
    _check_own_names(workdir)
    held = Claim(workdir, WorkdirLock(workdir) if lock else None, created)
  except WorkdirError:
    _remove_if_created_empty(workdir, created)
    raise
  try:
    _check_outputs(workdir, checkpoints)
  except WorkdirError:
    held.release()
    raise
  return held


def _remove_if_created_empty(workdir: str, created: bool) -> None:
  if created:
    with contextlib.suppress(OSError):
      os.rmdir(workdir)
