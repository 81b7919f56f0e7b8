"""A streamed corpus's batches, read ahead by a background thread.

A streamed corpus (C4 JSON lines or a TFDS split, tokenized as it is read)
spends host time on every batch: JSON parsing, SentencePiece (0.6-2.5M
tokens/s on one core), packing, and opening each new shard (37-96 ms on
C4). `ReadAhead` does that work in one thread that keeps up to DEPTH
batches ready in a bounded queue, so that the loop's next_batch takes a
batch already built while the device computes the step before.

To the loop it is the same batch source (sources.BatchSource), resuming
exactly: each queued batch carries the source's state right after it, and
state() answers the position after the last batch handed out, never the
read-ahead's. restore() stops the thread, drops the queue and reads on
from the restored position. An error of the source (a DataError naming the
file and line) is queued after the batches read before it, and the
next_batch that reaches it raises that same exception. close() stops the
thread within one batch's reading; the thread is a daemon, so a process
that never calls close() still exits.

A read can stall (a file system or network mount that stops answering): next_batch waits at most `wait_limit_s` (config.data.
read_timeout_s), then raises a DataError naming the corpus and the file
each island reads. It waits in short slices, so a stop the loop is asked
for meanwhile (a SIGTERM: `interrupt_when`) ends the wait at once with
WaitInterrupted, and the run saves and stops as at any step.

Why one thread, and not worker processes or grain (measured on 2 loaded
CPU cores, batches of 16 x 1025 SentencePiece tokens, 8k vocabulary, a
40 ms sleep standing for the device's step): the loop took 68.7 ms a step
with the source read in it (41% of the time waiting), 40.5 ms with
ReadAhead (0.6%), 40.9 ms with grain 0.2.18's thread prefetch (0.8%). One
core tokenizes 1.5-6x what the 150M model trains on an H200 (0.41M
tokens/s); SentencePiece holds the GIL while it encodes (its extension
never releases it), so the thread has one core, which the loop, mostly
waiting on the device, leaves free.
grain's thread prefetch is this same queue of (element, state), behind a
0.5-1.5 s import and a new dependency; its process prefetch (mp_prefetch)
slices the dataset over its workers, so a packed stream's order, and its
resume, depend on the worker count, and needs random-access sources
(gzip JSON lines are not). A position is already a few integers per
island in the checkpoint's metadata. A run that needs more than a core of
tokenizing trains on the `tokens` corpus (tokenized beforehand) instead.
In-memory corpora need no read-ahead: a batch is a pure function of the
step, built in 10-25 microseconds (2 x 16 x 1025 tokens).
"""
import copy
import queue
import threading
import time
from typing import Callable, NamedTuple

import numpy as np

from diloco_jax.data import errors

# Batches kept ready: enough to ride over a shard's opening or a run of
# long documents; each is islands x batch x (L + 1) int32 (2 MB at
# 8 x 64 x 1025).
DEPTH = 4
# How long close() waits for the thread to finish the batch it is reading
# (a daemon: one still reading then ends with the process).
CLOSE_TIMEOUT_S = 10.0
THREAD_NAME = "batch-read-ahead"
# How often a wait for a batch looks whether it should stop waiting.
POLL_S = 0.2


class WaitInterrupted(Exception):
  """next_batch stopped waiting for a batch: the loop is to stop."""


class _Failure(NamedTuple):
  """What the source raised, queued where its next batch would be."""
  error: BaseException


def _produce(source, ready: queue.Queue, stopping: threading.Event) -> None:
  """The thread: each batch with the source's state after it, until
  stopped or the source fails."""
  try:
    while not stopping.is_set():
      batch = source.next_batch()
      # A copy: the source may hand out a dict it changes later.
      ready.put((batch, copy.deepcopy(source.state())))
  except BaseException as error:  # pylint: disable=broad-except
    ready.put(_Failure(error))  # raised by the loop when it gets there


def _drain(ready: queue.Queue) -> None:
  while True:
    try:
      ready.get_nowait()
    except queue.Empty:
      return


class ReadAhead:
  """A batch source whose next batches a background thread prepares.

  The thread starts at the first next_batch (a restore before it, as a
  resumed run does, reads nothing twice).
  """

  def __init__(self, source, depth: int = DEPTH,
               wait_limit_s: float | None = None):
    """`wait_limit_s`: how long next_batch waits for a batch before it
    calls the source stalled (None: for ever)."""
    if depth < 1:
      raise ValueError(f"depth must be >= 1, got {depth}")
    self.info = source.info
    self._source = source
    self._wait_limit_s = wait_limit_s
    self._interrupt: Callable[[], bool] = lambda: False
    self._thread_stuck = False  # then close() does not join it
    self._ready = queue.Queue(maxsize=depth)
    self._state = copy.deepcopy(source.state())
    self._failure = None
    self._thread = None
    self._stopping = None
    self._closed = False

  def next_batch(self) -> np.ndarray:
    """The next batch of every island held, as the source gives it."""
    if self._closed:
      raise RuntimeError("next_batch() on a closed ReadAhead")
    if self._failure is not None:
      raise self._failure
    if self._thread is None:
      self._start()
    item = self._wait()
    if isinstance(item, _Failure):
      self._failure = item.error
      self._stop()  # the thread has ended: join it
      raise self._failure
    batch, self._state = item
    return batch

  def interrupt_when(self, predicate: Callable[[], bool]) -> None:
    """Makes a next_batch that is waiting raise WaitInterrupted as soon as
    `predicate()` (polled every POLL_S) is true."""
    self._interrupt = predicate

  def _wait(self):
    """The next queued item, within the wait limit (DataError past it)."""
    started = time.monotonic()
    while True:
      try:
        return self._ready.get(timeout=POLL_S)
      except queue.Empty:
        pass
      if self._interrupt():
        # The thread may be stuck in a read that never returns: the run
        # stops without waiting for it.
        self._thread_stuck = True
        raise WaitInterrupted()
      waited = time.monotonic() - started
      if self._wait_limit_s is not None and waited >= self._wait_limit_s:
        self._thread_stuck = True
        self._failure = errors.DataError(
            f"config.data.read_timeout_s: corpus {self.info.name} has given "
            f"no batch for {waited:.0f} s, reading {self._reading()} (a "
            f"stalled file system or network mount, a FIFO nobody writes?); "
            f"raise config.data.read_timeout_s to wait longer")
        raise self._failure

  def _reading(self) -> str:
    reading = getattr(self._source, "reading", None)
    return reading() if reading is not None else "its files"

  def state(self) -> dict:
    """The source's state after the last batch next_batch returned."""
    return copy.deepcopy(self._state)

  def restore(self, state: dict) -> None:
    """Continues as the source that returned `state` would have.

    A state the source refuses (DataError) leaves this one where it was:
    the next thread starts from the last batch handed out.
    """
    if self._closed:
      raise RuntimeError("restore() on a closed ReadAhead")
    self._stop()
    self._source.restore(state)
    self._state, self._failure = copy.deepcopy(self._source.state()), None

  def island_token_weights(self) -> np.ndarray:
    """The source's: fixed, so read here rather than through the queue."""
    return self._source.island_token_weights()

  def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
    """Stops the thread, waiting at most `timeout` seconds for the batch
    it is reading; the source is not used after."""
    self._closed = True
    self._stop(0.0 if self._thread_stuck else timeout)

  def _start(self) -> None:
    """Reads on from the last batch handed out (the source itself may
    stand further on: a stopped thread's read-ahead, a refused restore)."""
    self._source.restore(self._state)
    self._stopping = threading.Event()
    self._thread = threading.Thread(
        target=_produce, args=(self._source, self._ready, self._stopping),
        name=THREAD_NAME, daemon=True)
    self._thread.start()

  def _stop(self, timeout: float | None = None) -> None:
    """Ends the thread (waiting `timeout` seconds at most; None: until it
    has ended) and drops what it read ahead."""
    if self._thread is None:
      return
    self._stopping.set()
    _drain(self._ready)  # a put blocked on the full queue returns
    self._thread.join(timeout)
    _drain(self._ready)  # what it put before it saw the stop
    self._thread = None
