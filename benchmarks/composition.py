r"""Runs every cell of the composition table (configs/composition.py: 7
codecs x 4 overlaps x 6 island layouts) and prints what each did: trains,
refused (its one line) or crashes, with its final eval loss and the bytes
one island sent.

  .venv/bin/python benchmarks/composition.py [--cell=PATTERN ...] \
      [--rounds=3] [--jobs=1] [--runtime=spmd|elastic] \
      [--out=benchmarks/results/composition.json]

Each cell is its own process (`python -m diloco_jax.main`, or
`python -m diloco_jax.elastic` with --runtime=elastic), on 8 forced CPU
devices, sharing one persistent compilation cache so a program that two
cells share compiles once. A cell:
  trains    exits 0 with a finite final eval loss below its first eval's;
  no gain   exits 0, but its final eval loss is not below its first (or
            is not finite);
  refused   exits 1 with one `error:` line before anything compiled;
  crashes   anything else (a traceback, a signal, an error after compiling).
PATTERN matches cells by fnmatch on 'codec,overlap,layout' (e.g.
'sparseloco,*,stages').
"""

import concurrent.futures
import fnmatch
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from configs import composition  # pylint: disable=g-import-not-at-top

_CELLS = flags.DEFINE_multi_string(
    "cell", ["*"], "An fnmatch pattern of 'codec,overlap,layout' cells to "
    "run (repeat the flag for several).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds of H=4 each cell runs.")
_JOBS = flags.DEFINE_integer("jobs", 1, "Cells run at once.")
_RUNTIME = flags.DEFINE_enum("runtime", "spmd", ["spmd", "elastic"],
                             "One SPMD program, or elastic islands on Ray.")
_OUT = flags.DEFINE_string("out", "", "Where to write the records (JSON).")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 900, "A cell's time limit.")

DEVICES = 8
# Lines of a run's stderr that show a program compiled (the SPMD run's
# and an elastic island's log): an error after one is not a refusal.
_COMPILED_MARKS = ("compiled in", "first inner step done", "round 1:")


def select(patterns) -> list[tuple[str, str, str]]:
  """The cells matching any of `patterns`, in the table's order."""
  return [cell for cell in composition.CELLS
          if any(fnmatch.fnmatch(",".join(cell), p) for p in patterns)]


def run_cell(cell, rounds: int, runtime: str, cache_dir: str,
             timeout_s: int) -> dict:
  """Runs one cell in a process of its own; returns its record."""
  workdir = tempfile.mkdtemp(prefix="composition_")
  entry = "diloco_jax.main" if runtime == "spmd" else "diloco_jax.elastic"
  command = [sys.executable, "-m", entry,
             f"--config={REPO / 'configs' / 'composition.py'}:"
             + ",".join(cell),
             f"--workdir={workdir}", f"--config.total_steps={4 * rounds}"]
  env = dict(os.environ,
             XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
             JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache_dir,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  start = time.perf_counter()
  try:
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    returncode, stderr = done.returncode, done.stderr
  except subprocess.TimeoutExpired as timeout:
    returncode = None
    stderr = (timeout.stderr or b"").decode(errors="replace")
  record = {"cell": ",".join(cell), "seconds": round(
      time.perf_counter() - start, 1), "returncode": returncode}
  record.update(_outcome(returncode, stderr, workdir))
  shutil.rmtree(workdir, ignore_errors=True)
  return record


def _outcome(returncode, stderr: str, workdir: str) -> dict:
  """What a cell's process did, from its exit, its log and its files."""
  errors = [line for line in stderr.splitlines() if line.startswith("error:")]
  compiled = any(mark in stderr for mark in _COMPILED_MARKS)
  if returncode == 0:
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
    final = summary.get("final_eval_loss")
    first = _first_eval(workdir)
    trains = (final is not None and math.isfinite(final)
              and first is not None and final < first)
    return {"outcome": "trains" if trains else "no gain",
            "first_eval_loss": first, "final_eval_loss": final,
            "comm_bytes": summary.get("comm_bytes")}
  if (returncode == 1 and len(errors) == 1 and not compiled
      and "Traceback" not in stderr):
    return {"outcome": "refused", "line": errors[0]}
  tail = (errors[-1:] or [line for line in stderr.splitlines()
                          if line.strip()][-1:] or [""])[0]
  return {"outcome": "crashes", "line": tail[:300],
          "timed_out": returncode is None}


def _first_eval(workdir: str) -> float | None:
  """The eval loss of a run's first evaluation (metrics.jsonl: both
  runtimes write eval_loss in its records)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    for line in f:
      record = json.loads(line) if line.strip() else {}
      if record.get("eval_loss") is not None:
        return record["eval_loss"]
  return None


def table(records: list[dict]) -> str:
  """The records as a markdown table, and the counts of each outcome."""
  lines = ["| codec | overlap | layout | outcome | first eval | final eval "
           "| bytes sent | s |", "|---|---|---|---|---|---|---|---|"]
  for r in records:
    codec, overlap, layout = r["cell"].split(",")
    first, final = r.get("first_eval_loss"), r.get("final_eval_loss")
    outcome = r["outcome"] + (f": {r['line']}" if r.get("line") else "")
    lines.append(
        f"| {codec} | {overlap} | {layout} | {outcome} | "
        f"{'' if first is None else f'{first:.4f}'} | "
        f"{'' if final is None else f'{final:.4f}'} | "
        f"{r.get('comm_bytes') or ''} | {r['seconds']} |")
  counts = {}
  for r in records:
    counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
  return "\n".join(lines) + "\n\n" + ", ".join(
      f"{n} {outcome}" for outcome, n in sorted(counts.items())) + (
          f" of {len(records)} cells")


def main(argv):
  del argv
  cells = select(_CELLS.value)
  if not cells:
    raise app.UsageError(f"--cell={_CELLS.value} matches no cell")
  cache_dir = tempfile.mkdtemp(prefix="composition_cache_")
  start = time.perf_counter()
  records = {}
  try:
    with concurrent.futures.ThreadPoolExecutor(_JOBS.value) as pool:
      futures = {pool.submit(run_cell, cell, _ROUNDS.value, _RUNTIME.value,
                             cache_dir, _TIMEOUT.value): cell
                 for cell in cells}
      for future in concurrent.futures.as_completed(futures):
        record = future.result()
        records[futures[future]] = record
        print(f"{record['cell']}: {record['outcome']} "
              f"{record.get('final_eval_loss') or record.get('line') or ''}"
              f" ({record['seconds']} s)", flush=True)
  finally:
    shutil.rmtree(cache_dir, ignore_errors=True)
  ordered = [records[cell] for cell in cells if cell in records]
  seconds = time.perf_counter() - start
  print(table(ordered))
  print(f"{len(ordered)} cells in {seconds / 60:.1f} min "
        f"({_RUNTIME.value}, {_ROUNDS.value} rounds, {_JOBS.value} job(s))")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump({"runtime": _RUNTIME.value, "rounds": _ROUNDS.value,
                 "jobs": _JOBS.value, "minutes": round(seconds / 60, 1),
                 "date": time.strftime("%Y-%m-%d"), "cells": ordered}, f,
                indent=1)


if __name__ == "__main__":
  app.run(main)
