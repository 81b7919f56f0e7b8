"""The workdir: checked before anything is compiled, and held by one run.

`claim(workdir)` is the first thing a run does with its workdir. It refuses
an empty path, a path it cannot create or write, and a workdir holding run
outputs that cannot be resumed; then it takes an advisory lock that lasts
for the run's life. The lock is an `fcntl.flock` on `workdir/run.lock`: the
kernel drops it when the process ends in any way, SIGKILL included, so a
dead run never leaves a stale lock behind, and a second run into the same
workdir stops at once with the holder's pid instead of interleaving its
metrics and checkpoints with the first.
"""

import errno
import fcntl
import os

LOCK_FILE = "run.lock"
RUN_FILES = ("metrics.jsonl", "summary.json")


class WorkdirError(ValueError):
  """A workdir this run cannot use; the message names it and says why."""


class WorkdirLock:
  """An exclusive advisory lock on a workdir, held until release()."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    try:
      # O_RDWR without O_TRUNC: a refused run must not erase the holder's pid.
      self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise WorkdirError(f"--workdir={workdir}: cannot write {self.path}: "
                         f"{e.strerror}") from None
    try:
      fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip()
      os.close(self._fd)
      if e.errno not in (errno.EAGAIN, errno.EACCES):
        raise WorkdirError(f"--workdir={workdir}: cannot lock {self.path}: "
                           f"{e.strerror}") from None
      raise WorkdirError(
          f"--workdir={workdir} is in use by another run (pid "
          f"{holder or 'unknown'}); wait for it to end or choose another "
          "workdir") from None
    os.ftruncate(self._fd, 0)
    os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

  def release(self) -> None:
    """Drops the lock (the file stays: removing it would race a new run)."""
    if self._fd is not None:
      os.ftruncate(self._fd, 0)
      os.close(self._fd)  # closing the last descriptor releases the flock
      self._fd = None

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.release()


def _check_path(workdir) -> str:
  if not isinstance(workdir, str) or not workdir.strip():
    raise WorkdirError(f"--workdir={workdir!r}: give a directory for the "
                       "run's outputs")
  workdir = os.path.abspath(workdir)
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise WorkdirError(f"--workdir={workdir} is a file, not a directory")
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise WorkdirError(f"--workdir={workdir}: cannot create it: "
                       f"{e.strerror}") from None
  if not os.access(workdir, os.W_OK | os.X_OK):
    raise WorkdirError(f"--workdir={workdir} is not writable")
  return workdir


def _check_outputs(workdir: str) -> None:
  """Refuses a workdir holding run outputs that cannot be resumed."""
  if os.path.isdir(os.path.join(workdir, "checkpoints")):
    return
  for name in RUN_FILES:
    if os.path.exists(os.path.join(workdir, name)):
      raise WorkdirError(
          f"--workdir={workdir} holds {name} but no checkpoints to resume "
          "from; choose a new workdir or delete that one")


def claim(workdir: str, lock: bool = True) -> tuple[str, WorkdirLock | None]:
  """Checks `workdir`, creates it, and locks it for this run.

  Args:
    workdir: the run's output directory (created if missing).
    lock: take the lock (False on the processes of a multi-host run other
      than process 0, which write nothing there).

  Returns:
    (the absolute workdir, its lock or None); release the lock when the run
    ends (it is also released when the process dies).

  Raises:
    WorkdirError: the path is empty, not a directory, not writable, holds
      outputs without checkpoints, or another run holds the lock.
  """
  workdir = _check_path(workdir)
  held = WorkdirLock(workdir) if lock else None
  try:
    _check_outputs(workdir)
  except WorkdirError:
    if held is not None:
      held.release()
    raise
  return workdir, held
