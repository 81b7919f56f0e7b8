"""One writer fan-out for metrics: console progress, metrics.jsonl, TensorBoard.

Only process 0 writes, so a multi-host run produces one set of files. JSON
has no NaN or inf, so such values are written as null: every line of
metrics.jsonl and every summary parses with any JSON reader.

Both files are written in the loop's thread, each record at once
(files.AppendedFile): a write that fails stops the run with one line
(files.StorageError), and a file removed while the run writes it is
written again whole. A resumed run says in one line which steps before its
checkpoint metrics.jsonl lacks (`missing_steps`): they are not taken
again.
"""

import json
import math
import os
import time

import jax
from absl import logging

from diloco_jax.storage import files
from diloco_jax.storage import workdir as workdir_lib


def _is_writer() -> bool:
  return jax.process_index() == 0


def _format_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def json_safe(value):
  """`value` with every NaN or inf float (at any depth) replaced by None."""
  if isinstance(value, float):
    return value if math.isfinite(value) else None
  if isinstance(value, dict):
    return {k: json_safe(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [json_safe(v) for v in value]
  return value


def write_json_atomically(path: str, payload: dict) -> None:
  """Replaces `path` with `payload` as JSON (files.write_atomically: never
  half-written, never through a symlink; StorageError on failure)."""
  files.write_atomically(path, json.dumps(
      json_safe(payload), indent=2, sort_keys=True, allow_nan=False) + "\n")


class MetricsWriter:
  """Writes each step's scalars to metrics.jsonl and TensorBoard.

  Also logs a progress line (step/total, round, loss, tokens/s, the share
  of the time spent waiting for data, ETA) at most every
  `log_every_seconds`, and always for evaluation steps. A run that
  starts again from step s (a resume, a rollback) has its points after s
  dropped: metrics.jsonl is cut, and TensorBoard is told to purge them
  (event_files.py), so each step has one point.
  """

  def __init__(self, workdir: str, total_steps: int,
               log_every_seconds: float = 5.0, islands: int | None = None,
               start_step: int = 0):
    self._total_steps = total_steps
    self._islands = islands
    self._log_every = log_every_seconds
    self._last_log = -math.inf
    self._start = None
    self._start_tokens = 0
    self._start_step = start_step
    self._data_wait_s = 0.0
    self._jsonl = None
    self._tensorboard = None
    self._workdir = workdir
    self._path = os.path.join(workdir, "metrics.jsonl")
    if _is_writer():
      self._open(start_step)

  def _open(self, start_step: int) -> None:
    # A file removed with the whole workdir (its lock gone too) is not
    # written again: the run stops instead.
    lock = os.path.join(self._workdir, workdir_lib.LOCK_FILE)
    sentinel = lock if os.path.exists(lock) else None
    self._jsonl = files.AppendedFile(self._path, "metrics",
                                     sentinel=sentinel)
    try:
      self._tensorboard = _tensorboard_writer(self._workdir, start_step,
                                              sentinel)
    except BaseException:
      self._jsonl.close()
      self._jsonl = None
      raise

  def start_clock(self, tokens_seen: int = 0, step: int = 0) -> None:
    """Marks the start of timed training (after compilation), at `step`
    with `tokens_seen`: rates and the ETA count from there."""
    self._start = time.perf_counter()
    self._start_tokens = tokens_seen
    self._start_step = step
    self._data_wait_s = 0.0

  def set_data_wait(self, seconds: float) -> None:
    """The seconds the loop has waited for batches since start_clock
    (the loop keeps it current): the progress line shows their share."""
    self._data_wait_s = seconds

  def tokens_per_second(self, tokens_seen: int) -> float:
    elapsed = time.perf_counter() - self._start
    return (tokens_seen - self._start_tokens) / max(elapsed, 1e-9)

  def write(self, record: dict) -> None:
    """Writes one step's record (must hold 'step', 'round', 'tokens_seen')."""
    if self._jsonl is not None:
      line = json.dumps(json_safe(record), sort_keys=True, allow_nan=False)
      self._jsonl.append((line + "\n").encode())
      self._tensorboard.add_scalars(record["step"], {
          key: float(value) for key, value in record.items()
          if key != "step" and isinstance(value, (int, float))
          and math.isfinite(value)})
      self._maybe_log(record)  # one progress line per run, not per process

  def truncate(self, last_step: int) -> None:
    """Drops the records after `last_step` (a rollback takes them again)."""
    if self._jsonl is not None:
      self.close()
      truncate_metrics(self._workdir, last_step)
      self._open(last_step)

  def _maybe_log(self, record: dict) -> None:
    now = time.perf_counter()
    is_eval = "eval_loss" in record
    if not is_eval and now - self._last_log < self._log_every:
      return
    self._last_log = now
    step = record["step"]
    rate = self.tokens_per_second(record["tokens_seen"])
    # The steps left at the pace of the steps taken since the clock began.
    eta = ((now - self._start) * (self._total_steps - step)
           / max(step - self._start_step, 1))
    line = (f"step {step}/{self._total_steps} round {record['round']} "
            f"loss {record['train_loss']:.4f}")
    if is_eval:
      line += f" eval_loss {record['eval_loss']:.4f}"
      if "eval_bits_per_byte" in record:
        line += f" eval_bpb {record['eval_bits_per_byte']:.4f}"
      active = record.get("active_islands", self._islands)
      excluded = record.get("excluded_islands", 0)
      if active != self._islands or excluded:  # say when islands sat out
        line += f" islands {active - excluded}/{self._islands}"
        if excluded:
          line += f" ({excluded} diverged, left out)"
    line += (f" tok/s {rate:,.0f} data wait "
             f"{self._data_wait_s / max(now - self._start, 1e-9):.1%} "
             f"ETA {_format_duration(eta)}")
    logging.info(line)

  def close(self) -> None:
    if self._jsonl is not None:
      jsonl, self._jsonl = self._jsonl, None
      self._tensorboard.close()
      self._tensorboard = None
      jsonl.close()


def _tensorboard_writer(workdir: str, start_step: int,
                        sentinel: str | None):
  """TensorBoard's event file for a run going on from `start_step`: points
  of later steps, left by an earlier attempt, are purged (a first start
  too: an attempt killed before its first checkpoint left points)."""
  # Imported here so that reading metrics (tests, notebooks) does not need
  # TensorBoard's protobuf stack.
  # pylint: disable-next=g-import-not-at-top
  from diloco_jax.telemetry import event_files
  return event_files.EventFile(os.path.join(workdir, "tensorboard"),
                               purge_step=start_step + 1, sentinel=sentinel)


def read_metrics(workdir: str) -> list[dict]:
  """The records of workdir/metrics.jsonl (none when it does not exist);
  a torn last line (a run killed mid-write) is skipped."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  records = []
  with open(path) as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return records


def write_metrics(workdir: str, records: list[dict]) -> None:
  """Replaces workdir/metrics.jsonl with `records`, atomically."""
  if not _is_writer():
    return
  files.write_atomically(os.path.join(workdir, "metrics.jsonl"), "".join(
      json.dumps(json_safe(record), sort_keys=True, allow_nan=False) + "\n"
      for record in records))


def truncate_metrics(workdir: str, last_step: int) -> int:
  """Drops metrics.jsonl records after `last_step`, for a resumed run.

  A run killed after its last checkpoint has logged steps it will take again;
  dropping them keeps one record per step. A torn last line (killed mid-
  write) is dropped too, and a last record that lacks its newline gets
  one, so the next record starts a line of its own. The file is replaced
  atomically.

  Returns:
    How many records were dropped.
  """
  path = os.path.join(workdir, "metrics.jsonl")
  if not _is_writer() or not os.path.exists(path):
    return 0
  kept, dropped, torn = [], 0, False
  with open(path) as f:
    for line in f:
      torn = not line.endswith("\n")
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        dropped += 1
        continue
      if record.get("step", 0) <= last_step:
        kept.append(line if line.endswith("\n") else line + "\n")
      else:
        dropped += 1
  if dropped or torn:
    files.write_atomically(path, "".join(kept))
  return dropped


def missing_steps(workdir: str, first: int, last: int) -> list[tuple[int, int]]:
  """The steps first..last that workdir/metrics.jsonl holds no record of,
  as (start, end) ranges; [] on processes that do not write it."""
  if not _is_writer() or last < first:
    return []
  logged = {record.get("step") for record in read_metrics(workdir)}
  ranges = []
  for step in range(first, last + 1):
    if step in logged:
      continue
    if ranges and ranges[-1][1] == step - 1:
      ranges[-1] = (ranges[-1][0], step)
    else:
      ranges.append((step, step))
  return ranges


def describe_ranges(ranges: list[tuple[int, int]]) -> str:
  """'1-32, 40' for [(1, 32), (40, 40)]."""
  return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)
