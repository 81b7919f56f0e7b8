"""Input that goes wrong under a running run: shards cut, removed or
stalled mid-run never crash, hang or train on wrong data.

Each process test starts a real `python -m diloco_jax.main` on a prepared
(tokens) or streamed (c4) corpus, freezes it with SIGSTOP once it has
written its first record, breaks a file the run reads now or will read
next, and lets it go on: the run must end in one `error:` line naming the
file (or, for a stall, stop on SIGTERM with a checkpoint), keeping every
checkpoint whole. Which shard an island reads when is computed with the
run's own shard order, so nothing depends on timing but the margin of
steps between the freeze and the shard's end (asserted).
"""

import fcntl
import gzip
import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from diloco_jax.data import c4_files
from diloco_jax.data import errors
from diloco_jax.data import prepare
from diloco_jax.data import prepare_plan
from diloco_jax.data import read_ahead
from diloco_jax.data import shard_files
from diloco_jax.data import sharded_batches
from diloco_jax.data import token_shards

REPO = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
_WORDS = ("ka", "lo", "mi", "ne", "ru", "ta", "vi", "so", "pe", "du")
# configs/tiny.py's batch: 4 rows of 33 tokens per island and step.
_TOKENS_PER_STEP = 4 * 33
# Train files of this many bytes (byte tokens): ~230 steps per shard, so a
# run frozen within its first steps is far from its shards' ends.
_FILE_BYTES = 30_000
_ISLANDS = 2
_TIMEOUT_S = 240  # only a hang exceeds it


def _text(rng: random.Random, size: int) -> str:
  words = []
  while sum(len(word) + 1 for word in words) < size:
    words.append(rng.choice(_WORDS))
  return " ".join(words)[:size]


@pytest.fixture(scope="module")
def tokens_dir(tmp_path_factory) -> pathlib.Path:
  """A prepared corpus of 20 text files: one shard per train file."""
  root = tmp_path_factory.mktemp("input_faults")
  rng = random.Random(0)
  (root / "text").mkdir()
  for number in range(20):
    (root / "text" / f"{number:02d}.txt").write_text(_text(rng, _FILE_BYTES))
  plan = prepare_plan.make_plan("text_files", str(root / "text"),
                                str(root / "tokens"))
  prepare.prepare(plan)
  return root / "tokens"


def _island_shards(index: token_shards.TokenIndex, island: int) -> list:
  """The train shards `island` reads in its first epoch, in order (the
  run's seed 0)."""
  owned = sharded_batches.iid_shards(len(index.splits["train"]),
                                     _ISLANDS)[island]
  order = sharded_batches.shard_order(np.asarray(owned, np.int64), 0,
                                      island, 0)
  return [index.splits["train"][int(shard)] for shard in order]


def _start(workdir: pathlib.Path, *flags) -> subprocess.Popen:
  return subprocess.Popen(
      [sys.executable, "-m", "diloco_jax.main", "--config=configs/tiny.py",
       f"--workdir={workdir}", "--config.total_steps=3000",
       "--config.checkpoint.every_steps=25", *flags],
      cwd=REPO, env=ENV, text=True, stdout=subprocess.PIPE,
      stderr=subprocess.PIPE)


def _freeze_after_first_record(process, workdir: pathlib.Path) -> int:
  """SIGSTOPs the run once metrics.jsonl holds a record; returns the
  newest step recorded."""
  metrics = workdir / "metrics.jsonl"
  deadline = time.monotonic() + _TIMEOUT_S
  while time.monotonic() < deadline and process.poll() is None:
    if metrics.exists() and metrics.read_text().strip():
      process.send_signal(signal.SIGSTOP)
      return json.loads(metrics.read_text().splitlines()[-1])["step"]
    time.sleep(0.005)
  _, stderr = process.communicate(timeout=_TIMEOUT_S)
  pytest.fail(f"the run wrote no record: {stderr[-3000:]}")


def _resume_and_wait(process) -> tuple[int, str]:
  process.send_signal(signal.SIGCONT)
  try:
    _, stderr = process.communicate(timeout=_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    process.kill()
    _, stderr = process.communicate()
    pytest.fail(f"the run hung: {stderr[-3000:]}")
  return process.returncode, stderr


def _assert_one_error_line(returncode: int, stderr: str, pattern: str):
  assert returncode == 1, stderr[-3000:]
  assert "Traceback" not in stderr, stderr[-3000:]
  last = stderr.strip().splitlines()[-1]
  assert re.match(pattern, last), last
  return last


def _assert_checkpoints_whole(workdir: pathlib.Path, last: str) -> None:
  """The step the run stopped after is saved (the checkpoint in flight
  was finished, not lost), and no save was left half-written."""
  saved = re.search(r"stopped after step (\d+); a rerun resumes from step "
                    r"(\d+)\)$", last)
  assert saved and saved.group(1) == saved.group(2), last
  steps = sorted(int(entry.name) for entry in
                 (workdir / "checkpoints").iterdir() if entry.name.isdigit())
  assert int(saved.group(2)) == steps[-1], (last, steps)
  leftovers = [entry.name for entry in (workdir / "checkpoints").iterdir()
               if not entry.name.isdigit()]
  assert not leftovers, leftovers


def _copy(directory: pathlib.Path, to: pathlib.Path) -> pathlib.Path:
  """A copy of a prepared corpus, for a test to break."""
  to.mkdir()
  for entry in directory.iterdir():
    (to / entry.name).write_bytes(entry.read_bytes())
  return to


def _tokens_flags(corpus: pathlib.Path, *more) -> tuple:
  return ("--config.data.corpus=tokens", f"--config.data.path={corpus}",
          "--config.model.vocab_size=257", *more)


_MID_RUN = {
    # Island 0 reads `first` now: its second half goes. (Through a memory
    # map this was a SIGBUS that lost the checkpoint being saved.)
    "cut while read": r"ended at byte \d+, before the \d+ that index.json "
                      r"says: cut while the run read it\?",
    # The next shard: a traceback naming no file, before.
    "removed before read": r"cannot be opened \(No such file or directory\)",
    # Same size, same ids, other order: only the checksum tells, and the
    # run stops before a batch of it reaches the model.
    "overwritten before read": r"is not the shard prepare wrote: its bytes' "
                               r"sha256 is",
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(_MID_RUN))
def test_a_shard_broken_mid_run_is_one_line_and_the_run_saves(
    fault, tokens_dir, tmp_path):
  corpus = _copy(tokens_dir, tmp_path / "tokens")
  index = token_shards.read_index(str(corpus))
  workdir = tmp_path / "run"
  process = _start(workdir, *_tokens_flags(corpus))
  step = _freeze_after_first_record(process, workdir)
  first, second = _island_shards(index, 0)[:2]
  margin = first.tokens // (2 * _TOKENS_PER_STEP) - read_ahead.DEPTH - 2
  assert step < margin, f"frozen at step {step}: too late to break a shard"
  broken = corpus / (first.file if fault == "cut while read" else
                     second.file)
  if fault == "cut while read":
    os.truncate(broken, first.tokens // 2 * 2)
  elif fault == "removed before read":
    broken.unlink()
  else:
    tokens = np.fromfile(broken, "<u2")
    np.random.default_rng(0).permutation(tokens).tofile(broken)
  returncode, stderr = _resume_and_wait(process)
  last = _assert_one_error_line(
      returncode, stderr,
      rf"error: config\.data\.path: shard {broken} {_MID_RUN[fault]}")
  _assert_checkpoints_whole(workdir, last)


# A read that stalls. A file under a write lease (fcntl F_SETLEASE) is a
# regular file whose open() blocks until the lease is let go, as on a file
# system that stops answering; the kernel breaks the lease after
# /proc/sys/fs/lease-break-time (45 s by default), which these tests stay
# well within.


class _Leased:
  """Holds a write lease on `path`: other processes' opens of it block."""

  def __init__(self, path: pathlib.Path):
    self._previous = signal.signal(signal.SIGIO, signal.SIG_IGN)
    self._fd = os.open(path, os.O_RDONLY)
    try:
      fcntl.fcntl(self._fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except OSError as error:
      self.release()
      pytest.skip(f"no file leases here ({error})")

  def release(self) -> None:
    if self._fd is not None:
      os.close(self._fd)  # lets the lease go
      self._fd = None
    signal.signal(signal.SIGIO, self._previous)


@pytest.mark.slow
def test_a_stalled_read_is_one_line_naming_its_file_after_the_wait(
    tokens_dir, tmp_path):
  corpus = _copy(tokens_dir, tmp_path / "tokens")
  index = token_shards.read_index(str(corpus))
  workdir = tmp_path / "run"
  process = _start(workdir, *_tokens_flags(
      corpus, "--config.data.read_timeout_s=3"))
  _freeze_after_first_record(process, workdir)
  stalled = corpus / _island_shards(index, 1)[1].file
  lease = _Leased(stalled)
  try:
    returncode, stderr = _resume_and_wait(process)
  finally:
    lease.release()
  last = _assert_one_error_line(
      returncode, stderr,
      r"error: config\.data\.read_timeout_s: corpus tokens \(.*\) has "
      rf"given no batch for 3 s, reading island 0: .*; island 1: {stalled} ")
  _assert_checkpoints_whole(workdir, last)


def _c4_shards(directory: pathlib.Path) -> None:
  rng = random.Random(1)
  directory.mkdir()
  for number in range(6):
    name = (f"c4-train.{number:05d}-of-00005.json.gz" if number < 5
            else "c4-validation.00000-of-00001.json.gz")
    with gzip.open(directory / name, "wt") as f:
      for _ in range(20):
        f.write(json.dumps({"text": _text(rng, 1500)}) + "\n")


@pytest.mark.slow
def test_a_run_waiting_on_a_stalled_read_stops_and_saves_on_sigterm(
    tmp_path):
  """A streamed C4 shard: it used to wait for ever, SIGTERM unheard."""
  shards = tmp_path / "c4"
  _c4_shards(shards)
  paths, _ = c4_files.split_shards(str(shards), 0.05)
  workdir = tmp_path / "run"
  process = _start(workdir, "--config.data.corpus=c4",
                   f"--config.data.path={shards}",
                   "--config.model.vocab_size=257")
  _freeze_after_first_record(process, workdir)
  owned = sharded_batches.iid_shards(len(paths), _ISLANDS)[0]
  order = sharded_batches.shard_order(np.asarray(owned, np.int64), 0, 0, 0)
  lease = _Leased(paths[int(order[1])])
  try:
    process.send_signal(signal.SIGCONT)
    _wait_until_still(workdir / "metrics.jsonl")
    process.send_signal(signal.SIGTERM)
    try:
      _, stderr = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
      process.kill()
      pytest.fail("SIGTERM did not stop a run waiting for data")
  finally:
    lease.release()
  assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
  assert "Traceback" not in stderr
  last = stderr.strip().splitlines()[-1]
  saved = re.search(r"stopped by SIGTERM: saved a checkpoint at step (\d+)",
                    last)
  assert saved, last
  assert (workdir / "checkpoints" / saved.group(1)).is_dir()


def _wait_until_still(path: pathlib.Path, quiet_s: float = 2.0) -> None:
  """Returns once `path` has not grown for `quiet_s` seconds."""
  size, since = -1, time.monotonic()
  deadline = since + 30
  while time.monotonic() < deadline:
    now = path.stat().st_size if path.exists() else 0
    if now != size:
      size, since = now, time.monotonic()
    elif time.monotonic() - since >= quiet_s:
      return
    time.sleep(0.1)
  pytest.fail(f"{path} kept growing: the read did not stall")


# Files that are no files: refused, not waited on.


def test_a_fifo_in_place_of_a_shard_is_refused_not_waited_on(
    tokens_dir, tmp_path):
  corpus = _copy(tokens_dir, tmp_path / "tokens")
  index = token_shards.read_index(str(corpus))
  shard = index.splits["train"][0]
  (corpus / shard.file).unlink()
  os.mkfifo(corpus / shard.file)
  with pytest.raises(errors.DataError, match=r"is not a regular file"):
    shard_files.ShardFile(index, shard)
  shards = tmp_path / "c4"
  _c4_shards(shards)
  paths, _ = c4_files.split_shards(str(shards), 0.05)
  paths[2].unlink()
  os.mkfifo(paths[2])
  with pytest.raises(errors.DataError, match=rf"{paths[2]}: not a regular "):
    c4_files.check_first_lines(paths)
