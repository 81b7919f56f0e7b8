"""A run's processes watching each other, and how a process ends.

A process of a run that dies leaves the others waiting in a collective or
an exchange until JAX's coordination service notices the missed heartbeats
and aborts them with a crash dump. The watch notices first and ends the
process with one line naming the process that died and why. (A dead
coordinator, process 0, is seen by JAX's client at once, and it aborts:
the handler it takes cannot be set from Python in jax 0.10.)

`exit_now` ends a process with its message as the last line, whatever its
libraries' threads are doing; `leave` tells the other processes first;
`finish` ends a process whose run finished, together with the others.
"""

import os
import sys
import threading
import time

import jax
from absl import logging

_ALIVE = "diloco_jax/alive/"
_FAILED = "diloco_jax/failed/"
_peer_watch = None  # this process's watch, once jax.distributed started


class PeerWatch(threading.Thread):
  """Watches the run's other processes; ends this one when one is gone.

  Every process posts a heartbeat (a counter) to the coordinator's
  key-value store; a process that ends on an error posts its message
  first (announce_exit). A peer whose counter stands still for a third of
  the heartbeat timeout (before JAX's own verdict), a peer that failed, or
  a coordinator that stops answering ends this process with one line.
  """

  def __init__(self, client, me: int, count: int, heartbeat_timeout_s: float):
    super().__init__(name="peer_watch", daemon=True)
    self.client, self.me, self._count = client, me, count
    self.silence_s = max(heartbeat_timeout_s / 3, 3.0)
    self.interval_s = self.silence_s / 10
    self._grace_s = 2.0  # for this process to end on the same error itself
    self._stopped = threading.Event()

  def stop(self) -> None:
    """Stops watching (this process is ending on its own)."""
    self._stopped.set()

  def run(self) -> None:
    beat, beats = 0, {}
    now = time.monotonic()
    heard = {peer: now for peer in range(self._count)}  # last change
    failed_at, unreachable_since = {}, None
    while not self._stopped.wait(self.interval_s):
      now = time.monotonic()
      try:
        self.client.key_value_set(f"{_ALIVE}{self.me}", str(beat),
                                  allow_overwrite=True)
        beat += 1
        posted = dict(self.client.key_value_dir_get(_ALIVE))
        failures = dict(self.client.key_value_dir_get(_FAILED))
        unreachable_since = None
      except Exception:  # pylint: disable=broad-except
        unreachable_since = unreachable_since or now
        if now - unreachable_since > self.silence_s:
          self._end(f"process 0 of {self._count}, the coordinator, stopped "
                    f"answering {self.silence_s:.0f} s ago (killed, "
                    "crashed or cut off; its log says why)")
        continue
      for key, message in failures.items():
        peer = int(key.rsplit("/", 1)[-1])
        if peer != self.me and now - failed_at.setdefault(
            peer, now) >= self._grace_s:
          self._end(f"process {peer} of {self._count} failed: {message}")
      for peer in range(self._count):
        value = posted.get(f"{_ALIVE}{peer}")
        if peer == self.me or value != beats.get(peer):
          beats[peer], heard[peer] = value, now
        elif now - heard[peer] > self.silence_s:
          self._end(f"process {peer} of {self._count} stopped responding "
                    f"(no heartbeat for {self.silence_s:.0f} s: killed, "
                    "crashed or cut off; its log says why)")

  def _end(self, what: str) -> None:
    if self._stopped.is_set():
      return
    exit_now(1, f"error: {what}; this process (process {self.me}) stops "
             "too. Rerun the same command on every process to resume from "
             "the last checkpoint")


def start(client, me: int, count: int, heartbeat_timeout_s: float) -> None:
  """Starts this process's watch over the others (after jax.distributed
  started, through its key-value `client`)."""
  global _peer_watch
  _peer_watch = PeerWatch(client, me, count, heartbeat_timeout_s)
  _peer_watch.start()


def leave(message: str | None) -> None:
  """Before this process ends: tells the other processes why (`message`,
  the error it ends on; None for a stop they share), stops watching them,
  and leaves jax.distributed with them where they are leaving too (at
  most the watch's silence limit: a peer stuck elsewhere is not waited
  for)."""
  if _peer_watch is None:
    return
  _peer_watch.stop()
  client = _peer_watch.client
  if message is not None:
    try:
      client.key_value_set(f"{_FAILED}{_peer_watch.me}", message,
                           allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except
      pass  # the coordinator is gone: the others notice by themselves
  leaving = threading.Thread(target=_shutdown_quietly, daemon=True)
  leaving.start()
  leaving.join(_peer_watch.silence_s)


def wait_for_a_verdict() -> None:
  """On an unexpected error in a run of several processes: waits out the
  watch's silence window first. A collective cut short by a peer that died
  fails here before the watch has heard the silence; the watch then names
  that peer in one line and ends this process, instead of the collective's
  traceback. Returns (for the error to be raised) when no peer is gone."""
  if _peer_watch is None or not _peer_watch.is_alive():
    return
  _peer_watch.join(_peer_watch.silence_s + 2 * _peer_watch.interval_s)


def _shutdown_quietly() -> None:
  try:
    jax.distributed.shutdown()
  except Exception:  # pylint: disable=broad-except
    pass


def finish() -> None:
  """Ends this process of a multi-process run that finished, with the
  others: they leave jax.distributed together (a barrier), then each ends
  at once. (The interpreter's teardown would keep the CPU collectives'
  connections open for a while after the first process had gone, and
  gloo aborts a process whose peer closes a connection under it.) Returns
  in a run of one process, which ends as usual."""
  if _peer_watch is None:
    return
  leave(None)
  exit_now(0)


def exit_now(code: int, message: str | None = None) -> None:
  """Prints `message` (if any) as the process's last line and ends it at
  once.

  Threads still running (a library's, waiting for a peer that died or a
  write that failed) neither keep the process alive nor print after the
  message: stdout and stderr go to /dev/null first.
  """
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  stderr = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  os.dup2(devnull, 1)
  if message is not None:
    # After a newline: a thread may have left a line unfinished.
    os.write(stderr, ("\n" + message + "\n").encode())
  os._exit(code)  # pylint: disable=protected-access
