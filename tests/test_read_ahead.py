"""The streamed corpus's read-ahead thread (data/read_ahead.py).

It hands out the batches and positions the source itself would, resumes
exactly, raises the source's errors in the loop as the source would, and
ends on close, at a run's end and on SIGTERM; the share of the loop's time
spent waiting for data reaches the log and the summary.
"""
import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from configs import tiny
from diloco_jax.data import c4_files
from diloco_jax.data import errors
from diloco_jax.data import read_ahead
from diloco_jax.data import sharded_batches
from diloco_jax.data import sources
from diloco_jax.data import tokenizer as tokenizer_lib
from diloco_jax.run import train
from diloco_jax.telemetry import metrics_files as metrics_lib
from tests import helpers
from tests import test_checkpoint
from tests import test_data_c4

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO}
VALIDATION_FRACTION = 0.3  # test_data_c4's: shards named so are validation
# test_data_c4's C4 shards and data config.
_write_c4 = test_data_c4._write_c4  # pylint: disable=protected-access
_c4_data_config = test_data_c4._data_config  # pylint: disable=protected-access


class _Counted:
  """A real streamed source that counts the batches read from it, to see
  how far the thread has read ahead."""

  info = sources.SourceInfo(name="c4 (test)", vocab_size=257,
                            eos_id=tokenizer_lib.ByteTokenizer.eos_id,
                            island_split="iid")

  def __init__(self, source):
    self._source, self.reads = source, 0

  def next_batch(self):
    batch = self._source.next_batch()
    self.reads += 1
    return batch

  def state(self):
    return self._source.state()

  def restore(self, state):
    self._source.restore(state)

  def island_token_weights(self):
    return self._source.island_token_weights()


def _stream(path, seed: int = 3):
  """The direct source make_batch_source wraps: 2 islands of 2 x 16 byte
  tokens."""
  train_shards, _ = c4_files.split_shards(str(path), VALIDATION_FRACTION)
  return sharded_batches.StreamingIslandBatches(
      c4_files.ShardFiles(train_shards), num_islands=2, batch_size=2,
      sequence_length=15, tokenizer=tokenizer_lib.ByteTokenizer(), seed=seed)


def _wait_until(predicate, timeout: float = 60.0) -> None:
  deadline = time.monotonic() + timeout
  while not predicate():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.001)


def _new_threads(before: set) -> list:
  return [thread for thread in threading.enumerate()
          if thread not in before and thread.name == read_ahead.THREAD_NAME]


@pytest.fixture(scope="module")
def c4_dir(tmp_path_factory):
  """4 train shards of short documents (epochs of a few batches) and a
  validation shard large enough for tiny's eval."""
  directory = tmp_path_factory.mktemp("c4")
  _write_c4(directory, num_train=4, docs_per_shard=80)
  return directory


def test_streamed_corpora_are_read_ahead_and_in_memory_ones_are_not(c4_dir):
  streamed = sources.make_batch_source(_c4_data_config(path=str(c4_dir)),
                                       num_islands=2, batch_size=2, seed=3)
  assert isinstance(streamed, read_ahead.ReadAhead)
  direct = _stream(c4_dir)
  for _ in range(5):
    np.testing.assert_array_equal(streamed.next_batch(), direct.next_batch())
  assert streamed.state() == direct.state()
  sources.close(streamed)
  # In-memory batches are a pure function of the step, built in
  # microseconds (10-25 us measured at 2 x 16 x 1025): no thread. The
  # bound is a step's order of magnitude, loose for a loaded machine.
  in_memory = sources.make_batch_source(helpers.small_data_config(),
                                        num_islands=2, batch_size=4, seed=0)
  assert not isinstance(in_memory, read_ahead.ReadAhead)
  times = []
  for _ in range(50):
    start = time.perf_counter()
    in_memory.next_batch()
    times.append(time.perf_counter() - start)
  assert np.median(times) < 0.01


@pytest.mark.parametrize("handed", [0, 1, 7, 30])
def test_state_is_the_last_batch_handed_out_not_the_read_ahead(c4_dir,
                                                               handed):
  counted = _Counted(_stream(c4_dir))
  source, direct = read_ahead.ReadAhead(counted), _stream(c4_dir)
  for _ in range(handed):
    np.testing.assert_array_equal(source.next_batch(), direct.next_batch())
  if handed:  # the queue is full and the thread holds one more batch
    _wait_until(lambda: counted.reads == handed + read_ahead.DEPTH + 1)
  state = source.state()
  assert state == direct.state()
  expected = [direct.next_batch() for _ in range(12)]
  # The same source, and a new one restored from the saved JSON, go on
  # with the direct source's batches.
  resumed = read_ahead.ReadAhead(_Counted(_stream(c4_dir)))
  resumed.restore(json.loads(json.dumps(state)))
  for batch in expected:
    np.testing.assert_array_equal(source.next_batch(), batch)
    np.testing.assert_array_equal(resumed.next_batch(), batch)
  # A restore while the thread reads ahead goes back exactly.
  source.restore(state)
  assert source.state() == state
  for batch in expected:
    np.testing.assert_array_equal(source.next_batch(), batch)
  source.close()
  resumed.close()


def test_a_refused_state_leaves_the_source_where_it_was(c4_dir):
  source, direct = read_ahead.ReadAhead(_Counted(_stream(c4_dir))), _stream(
      c4_dir)
  for _ in range(3):
    source.next_batch(), direct.next_batch()
  with pytest.raises(errors.DataError, match="island positions"):
    source.restore({"islands": [{}]})
  for _ in range(6):
    np.testing.assert_array_equal(source.next_batch(), direct.next_batch())
  source.close()


def test_close_ends_the_thread_within_a_bound(c4_dir):
  before = set(threading.enumerate())
  counted = _Counted(_stream(c4_dir))
  source = read_ahead.ReadAhead(counted)
  source.close()  # never started: nothing to end
  assert not _new_threads(before)
  source = read_ahead.ReadAhead(counted)
  source.next_batch()
  _wait_until(lambda: counted.reads == 1 + read_ahead.DEPTH + 1)
  (thread,) = _new_threads(before)  # blocked on the full queue
  assert thread.daemon  # never keeps a process alive
  start = time.monotonic()
  source.close(timeout=30)
  # Blocked on the queue, it ends at once (ms); the bound is loose for a
  # loaded machine, far below close's timeout.
  assert not thread.is_alive() and time.monotonic() - start < 10
  with pytest.raises(RuntimeError, match="closed"):
    source.next_batch()


def _shards_with_a_bad_line(directory) -> None:
  """2 train shards of 150 documents, the second's line 120 not JSON
  (deeper than the lines checked up front), and a validation shard."""
  line = lambda i: json.dumps({"text": f"document {i} " + "abc " * (i % 7)})
  for shard in range(2):
    lines = [line(i) for i in range(150)]
    if shard == 1:
      lines[119] = '{"text": "a broken line'
    with gzip.open(directory / f"c4-train.{shard:05d}-of-00002.json.gz",
                   "wt") as f:
      f.write("\n".join(lines) + "\n")
  with gzip.open(directory / "c4-validation.00000-of-00001.json.gz",
                 "wt") as f:
    f.write("\n".join(line(i) for i in range(20)) + "\n")


def test_a_source_error_reaches_the_loop_where_the_source_raises_it(
    tmp_path):
  _shards_with_a_bad_line(tmp_path)
  direct, good = _stream(tmp_path), []
  with pytest.raises(errors.DataError) as expected:
    for _ in range(10_000):
      good.append(direct.next_batch())
  before = set(threading.enumerate())
  source = read_ahead.ReadAhead(_Counted(_stream(tmp_path)))
  for batch in good:  # the batches read before the error come first
    np.testing.assert_array_equal(source.next_batch(), batch)
  for _ in range(2):  # then the source's own error, each time asked
    with pytest.raises(errors.DataError) as raised:
      source.next_batch()
    assert str(raised.value) == str(expected.value)
    assert "\n" not in str(raised.value)  # main prints it as one line
    assert "c4-train.00001-of-00002.json.gz:120:" in str(raised.value)
  assert not _new_threads(before)  # the thread ended with the error
  source.close()


def test_the_progress_line_shows_the_share_of_time_waited_for_data(
    tmp_path, monkeypatch, caplog):
  clock = [100.0]
  monkeypatch.setattr(metrics_lib.time, "perf_counter", lambda: clock[0])
  writer = metrics_lib.MetricsWriter(str(tmp_path), total_steps=10,
                                     log_every_seconds=0.0)
  writer.start_clock()
  clock[0] += 8.0
  writer.set_data_wait(2.0)  # 2 of 8 seconds
  with caplog.at_level("INFO"):
    writer.write({"step": 4, "round": 1, "train_loss": 1.0,
                  "tokens_seen": 64})
  writer.close()
  assert " data wait 25.0% " in caplog.records[-1].getMessage()


def _c4_overrides(c4_dir) -> dict:
  return {"total_steps": 40, "data.corpus": "c4", "data.path": str(c4_dir),
          "model.vocab_size": 257}


@pytest.fixture(scope="module")
def finished_c4(tmp_path_factory, c4_dir):
  """A whole 40-step run of tiny on the C4 shards, and the read-ahead
  threads it left running (none expected)."""
  workdir = str(tmp_path_factory.mktemp("c4_run"))
  before = set(threading.enumerate())
  summary = train.train_and_evaluate(
      helpers.with_overrides(tiny.get_config(), _c4_overrides(c4_dir)),
      workdir)
  return workdir, summary, _new_threads(before)


def test_a_run_ends_its_thread_and_reports_its_data_wait(finished_c4):
  _, summary, left_running = finished_c4
  assert not left_running
  assert summary["data_wait_s"] > 0  # every batch is timed
  assert summary["data_wait_fraction"] == pytest.approx(
      summary["data_wait_s"] / summary["train_s"])
  assert 0 < summary["data_wait_fraction"] < 1


@pytest.mark.slow
def test_a_sigterm_stops_a_c4_run_cleanly_and_it_resumes_exactly(
    finished_c4, c4_dir, tmp_path):
  workdir = str(tmp_path / "stopped")
  flags = [f"--config.{key}={value}"
           for key, value in _c4_overrides(c4_dir).items()]
  process = subprocess.Popen(
      [sys.executable, "-m", "diloco_jax.main", "--config=configs/tiny.py",
       f"--workdir={workdir}", *flags], cwd=REPO, env=ENV, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  metrics = os.path.join(workdir, "metrics.jsonl")
  try:
    helpers.wait_for(lambda: os.path.exists(metrics) and len(
        metrics_lib.read_metrics(workdir)) >= 6, process)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
  finally:
    if process.poll() is None:
      process.kill()
  assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith("stopped by SIGTERM: saved a checkpoint at step ")
  assert "Traceback" not in err and "Exception in thread" not in err
  assert " data wait " in err  # the progress lines show the share
  # The step in flight and a tiny save (well under a second); loose for a
  # loaded machine.
  assert time.monotonic() - signalled < 60
  # The checkpoint holds the position of the last batch trained on, not
  # the read-ahead's: the resumed run is the uninterrupted one.
  train.train_and_evaluate(
      helpers.with_overrides(tiny.get_config(), _c4_overrides(c4_dir)),
      workdir)
  # pylint: disable-next=protected-access
  test_checkpoint._assert_identical_runs(finished_c4[0], workdir)
