"""An elastic run's records: each round's line of metrics.jsonl, written
(with its eval loss) before the round's checkpoint, in order, at once or
on a thread of its own while the next round runs; and the records of
rounds a rerun trains again dropped."""

import concurrent.futures
import json
import os
import time

from absl import logging
import numpy as np

from diloco_jax.elastic import quorum


def write_and_save(metrics, record: dict, model, evaluate, coordinator,
                    snapshot: dict) -> None:
  """A closed round's record (with `model`'s eval loss, if given) and
  then its checkpoint: a rerun after a kill in between drops the records
  of rounds it did not checkpoint."""
  if model is not None:
    record["eval_loss"] = evaluate(model)
  metrics.write(json.dumps(record) + "\n")
  metrics.flush()
  coordinator.save(snapshot)


class Closer:
  """Runs each round's `write_and_save` in order: at once, or (in the
  background) on a thread of its own while the next round runs; an
  error in it is raised at the next `submit` or at `wait`."""

  def __init__(self, background: bool):
    self._pool = (concurrent.futures.ThreadPoolExecutor(1)
                  if background else None)
    self._last = None

  def submit(self, fn, *args) -> None:
    if self._pool is None:
      fn(*args)
      return
    if self._last is not None:
      self._last.result()
    self._last = self._pool.submit(fn, *args)

  def wait(self) -> None:
    if self._pool is not None:
      try:
        if self._last is not None:
          self._last.result()
      finally:
        self._pool.shutdown(wait=True)


def keep_records_up_to(path: str, rounds_done: int) -> None:
  """Drops the records of rounds after the last checkpointed one (a rerun
  trains them again) and a line cut short, replacing the file in one
  rename."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  kept = []
  for line in lines:
    try:
      if json.loads(line)["round"] <= rounds_done:
        kept.append(line)
    except ValueError:  # the last line, cut short by the kill
      pass
  if len(kept) < len(lines):
    with open(path + ".partial", "w") as f:
      f.writelines(kept)
    os.replace(path + ".partial", path)


def round_record(round_number: int, step: int, included: np.ndarray,
                 came_back: quorum.RoundResults) -> dict:
  """The round's line of metrics.jsonl, also said in the log."""
  results = came_back.results.values()
  record = {
      "round": round_number, "step": step,
      "included": included.astype(int).tolist(),
      "failed": came_back.failed, "late": came_back.late,
      "round_seconds": round(came_back.seconds, 3),
      "train_loss": (float(np.mean([r["losses"][-1] for r in results]))
                     if results else None),
      # Inner steps each result trained (under round_budget 'time' its
      # own), and how many rounds old each applied late one was.
      "steps_taken": {i: len(r["losses"])
                      for i, r in came_back.results.items()},
      "stale": {i: round_number - r["round"]
                for i, r in came_back.results.items()
                if included[i] and r["round"] < round_number},
      # When each result's call began, and when the round closed (its
      # outer step taken; wall clock).
      "started_at": {i: r.get("started_at")
                     for i, r in came_back.results.items()},
      # ...and when its inner steps were done (wall clock).
      "trained_at": {i: r.get("trained_at")
                     for i, r in came_back.results.items()},
      "closed_at": time.time()}
  logging.info("round %d: islands %s took part%s%s", round_number,
               record["included"],
               f"; failed {sorted(came_back.failed)}" if came_back.failed
               else "",
               f"; late {came_back.late}" if came_back.late else "")
  return record
