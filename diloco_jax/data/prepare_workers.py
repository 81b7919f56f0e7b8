"""The prepare's worker processes: one task at a time each, over a pipe.

Not multiprocessing.Pool: its queues' locks are named semaphores, which a
SIGKILLed prepare left in /dev/shm (6 per pool), and its workers outlived
such a prepare, finishing their shards under the rerun's (whose .part
files they then renamed away). Pipes need no semaphores, and each worker
dies with the prepare however it ends (`_die_with_parent`).
"""
from collections.abc import Iterator
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback

from diloco_jax.data import errors

# prctl(2)'s option: the signal a process gets when its parent dies.
_PR_SET_PDEATHSIG = 1


class Workers:
  """Worker processes, each handed one task at a time over a pipe of its
  own (imap_unordered, as multiprocessing.Pool's); as a context, stopped
  on leaving it."""

  def __init__(self, processes: int):
    # spawn, not fork: the caller may hold threads (JAX's, TFDS's) that a
    # forked child would inherit mid-lock.
    context = multiprocessing.get_context("spawn")
    self._workers = []
    try:
      for _ in range(processes):
        mine, theirs = context.Pipe()
        process = context.Process(target=_serve, args=(theirs, os.getpid()),
                                  daemon=True)
        process.start()
        theirs.close()  # so that a worker's death is EOF here
        self._workers.append((process, mine))
    except BaseException as error:
      self._stop(now=True)
      if isinstance(error, OSError):  # not one of --output's
        raise errors.DataError(f"cannot start {processes} worker processes "
                               f"({error.strerror or error}); give fewer "
                               "--processes") from None
      raise

  def __enter__(self):
    return self

  def __exit__(self, exc_type, *unused):
    self._stop(now=exc_type is not None)
    return False

  def imap_unordered(self, function, arguments) -> Iterator:
    """function(argument) of each argument, in the order they finish; a
    worker's exception is raised here."""
    waiting, busy = iter(arguments), {}

    def hand_out(process, connection) -> None:
      for argument in waiting:
        busy[connection] = process, argument
        try:
          connection.send((function, argument))
        except OSError:  # it has ended: said as its reply would be
          pass
        return

    for process, connection in self._workers:
      hand_out(process, connection)
    while busy:
      for connection in multiprocessing.connection.wait(list(busy)):
        process, argument = busy.pop(connection)
        try:
          done, value, remote_traceback = connection.recv()
        except (EOFError, OSError):
          process.join(timeout=5)
          raise errors.DataError(
              f"a worker process ended ({_how_it_ended(process.exitcode)}) "
              f"while it made {getattr(argument[0], 'file', 'a shard')}; the "
              "finished shards are kept; rerun the same command to make the "
              "others") from None
        if not done:
          raise value from _RemoteTraceback(remote_traceback)
        hand_out(process, connection)
        yield value

  def _stop(self, now: bool) -> None:
    """Ends the workers: at once (now), or once their pipes close."""
    for process, connection in self._workers:
      if now:
        process.terminate()
      connection.close()  # EOF: an idle worker returns
    for process, _ in self._workers:
      process.join(timeout=None if now else 30)
      if process.is_alive():
        process.kill()
        process.join()
    self._workers = []


class _RemoteTraceback(Exception):
  """A worker's traceback, as the cause of the exception it raised."""

  def __str__(self):
    return "\n" + self.args[0]


def _how_it_ended(exitcode: int | None) -> str:
  if exitcode is None or exitcode >= 0:
    return f"exit code {exitcode}"
  if -exitcode == signal.SIGKILL:
    return "killed by SIGKILL: out of memory?"
  try:
    return f"killed by {signal.Signals(-exitcode).name}"
  except ValueError:
    return f"killed by signal {-exitcode}"


def _serve(connection, parent: int) -> None:
  """A worker: runs each (function, argument) the prepare sends, sends
  back (True, result, None) or (False, exception, its traceback), until
  the pipe closes."""
  # Ctrl-C reaches every process of the terminal's group: the prepare
  # stops its workers itself, without their tracebacks.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  _die_with_parent(parent)
  while True:
    try:
      function, argument = connection.recv()
    except (EOFError, OSError):
      return
    try:
      reply = True, function(argument), None
    except Exception as error:  # pylint: disable=broad-except
      reply = False, error, traceback.format_exc()
    try:
      try:
        connection.send(reply)
      except (OSError, EOFError):
        raise
      except Exception:  # pylint: disable=broad-except
        # Not picklable: sent in words.
        connection.send((False, RuntimeError(repr(reply[1])), reply[2]))
    except (OSError, EOFError):  # the prepare is stopping us, or gone
      return


def _die_with_parent(parent: int) -> None:
  """Makes this process end when process `parent` ends, however it ends:
  a prepare killed (even by SIGKILL) stops its workers at once, so that
  none is left writing a shard when the command is run again.

  On Linux the kernel sends SIGKILL when the parent dies
  (PR_SET_PDEATHSIG); elsewhere a thread watches os.getppid(). Either way
  a parent that ended before this ran is seen: the worker's parent is no
  longer `parent`.
  """
  armed = False
  if sys.platform.startswith("linux"):
    try:
      libc = ctypes.CDLL(None, use_errno=True)
      zero = ctypes.c_ulong(0)
      armed = libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL),
                         zero, zero, zero) == 0
    except (OSError, AttributeError):
      pass
  if os.getppid() != parent:
    os._exit(1)  # pylint: disable=protected-access
  if not armed:
    def watch():
      while os.getppid() == parent:
        time.sleep(0.1)
      os._exit(1)  # pylint: disable=protected-access
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
