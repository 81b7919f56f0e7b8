r"""The outer step's numerics, cell by cell: a fixture to hold a refactor to.

  python benchmarks/outer_numerics.py --write=tests/fixtures/outer_numerics.json
  python benchmarks/outer_numerics.py --check=tests/fixtures/outer_numerics.json \
      [--rtol=1e-6] [--strict] [--cells=eager/int8,/host]
  python benchmarks/outer_numerics.py --list    # the cells, validated only

--cells=A,B keeps the cells whose name (overlap/codec/layout) contains A
or B; --layouts picks the layouts of --write and --list (default: plain,
fsdp, stages, host; host+stages adds 18 cells); --check runs the cells the
fixture holds.

Trains configs/tiny.py (2 islands, 2 layers of d_model 64, MLP 256: every
matrix big enough for FSDP to split and for SparseLoCo's chunks; 16 steps,
H = 4, so 4 rounds: the delayed and eager overlaps run past eager's 2
warm-up rounds), 12 cells to a child process, once per cell of

  overlap  none, one_step_delay, one_step_delay_rebase, eager, eager_share
           (each at its own default outer step, config/overlap_defaults.py),
           and streaming (Streaming DiLoCo: 2 fragments, fragment_delay 1,
           fragment_alpha 0.5; overlap 'none')
  codec    fp32; int8 with error feedback; sparseloco (its own chunked
           top-k, error feedback as its momentum; codec left at fp32)
  layout   plain (replicated islands, one device each); fsdp (mesh.data 2,
           mesh.fsdp); stages (mesh.stage 2); host (outer_placement
           'host': x, the outer state and the collective on a CPU device
           set aside)

and records per cell the overrides of configs/tiny.py, the final eval loss,
the bytes one island sent (comm_bytes), and a fingerprint of the final x
(the final checkpoint's global_params): the sha256 of every leaf's float32
bytes in the order of their sorted tree paths (one digest for the whole
tree and a short one per leaf), and the float64 sum and sum of squares of
all of x. A cell the code refuses is recorded as refused, with the
validation error's lines; one that fails while training as failed, with
the error's first line (the traceback is logged), and the others go on.

--check runs the cells again and compares each with the fixture: "exact"
where x's sha256, the eval loss and comm_bytes all match; otherwise the
relative differences of the eval loss, of x's sum and of its sum of
squares, "close" within --rtol and "DIFFERS" beyond it (or where the bytes
sent, a refusal or a failure changed). It exits 1 if any cell DIFFERS and --rtol > 0,
or, with --strict, if any cell is not exact; with neither it only reports.

The sha256 is exact only under the same JAX, XLA flags and CPU: like the
tests (tests/conftest.py) this script forces 8 CPU devices and XLA's
fast-compile flags (which change numbers by rounding only, and compile the
tiny programs ~2.4x faster), and the fixture records the versions, flags
and CPU it was written under; --check says so when they differ.
--compilation_cache=DIR keeps the compiled programs between checks (a
program loaded from it gives the same bits): programs a change leaves
alone then load instead of compiling, about half of a cell's time.
tests/test_outer_numerics.py checks a few cells exactly under pytest.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
from absl import logging

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)
from benchmarks import outer_cells  # pylint: disable=g-import-not-at-top,wrong-import-position

_WRITE = flags.DEFINE_string("write", None,
                             "Run the cells and write the fixture here.")
_CHECK = flags.DEFINE_string(
    "check", None, "Run the fixture's cells and compare them with it.")
_LIST = flags.DEFINE_bool(
    "list", False, "List the cells (validated, refused with the reason) "
    "without training.")
_CELLS = flags.DEFINE_list(
    "cells", [], "Only the cells whose name (overlap/codec/layout) contains "
    "one of these substrings.")
_RTOL = flags.DEFINE_float(
    "rtol", 0.0, "--check: a cell that is not exact passes if its eval "
    "loss, x's sum and x's sum of squares are within this relative "
    "difference; 0: report only.")
_LAYOUTS = flags.DEFINE_list(
    "layouts", ["plain", "fsdp", "stages", "host"], "--write and --list: "
    "the layouts (of plain, fsdp, stages, host, host+stages); --check runs "
    "the fixture's cells.")
_STRICT = flags.DEFINE_bool("strict", False,
                            "--check: fail unless every cell is exact.")
_CHILD_RECORDS = flags.DEFINE_string(
    "child_records", None, "Internal: run exactly the --cells named, in this "
    "process, and write their records here as JSON.")
_CACHE = flags.DEFINE_string(
    "compilation_cache", None, "A persistent JAX compilation cache folder "
    "(results do not change: a cached executable is the one XLA builds).")

def _fmt(value) -> str:
  return "-" if value is None else f"{value:.2e}"


# Cells one process runs: each run compiles its own programs, and a process
# that had compiled ~40 runs' failed with "LLVM compilation error: Cannot
# allocate memory" (its JIT's memory mappings, vm.max_map_count 65530).
CELLS_PER_PROCESS = 12


def _run_all(names: list[str]) -> dict:
  """Every cell's record, CELLS_PER_PROCESS cells to a child process."""
  records = {}
  with tempfile.TemporaryDirectory() as folder:
    for start in range(0, len(names), CELLS_PER_PROCESS):
      chunk = names[start:start + CELLS_PER_PROCESS]
      out = os.path.join(folder, f"{start}.json")
      command = [sys.executable, os.path.abspath(__file__),
                 f"--child_records={out}", f"--cells={','.join(chunk)}"]
      if _CACHE.value:
        command.append(f"--compilation_cache={_CACHE.value}")
      subprocess.run(command, check=True)
      with open(out) as f:
        records.update(json.load(f))
  return records


def _run_here(names: list[str]) -> dict:
  records = {}
  for name in names:
    record = outer_cells.run_cell(name)
    records[name] = record
    if "refused" in record:
      print(f"{name:42s} refused: {'; '.join(record['refused'])}",
            flush=True)
    elif "failed" in record:
      print(f"{name:42s} failed: {record['failed']}", flush=True)
    else:
      print(f"{name:42s} {record['seconds']:6.1f}s  eval loss "
            f"{record['eval_loss']:.6f}  x {record['x']['sha256'][:12]}",
            flush=True)
  return records


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  modes = [bool(_WRITE.value), bool(_CHECK.value), _LIST.value,
           bool(_CHILD_RECORDS.value)]
  if sum(modes) != 1:
    raise app.UsageError("give one of --write=PATH, --check=PATH, --list")
  outer_cells.configure_jax(_CACHE.value)
  logging.set_verbosity(logging.WARNING)
  unknown = set(_LAYOUTS.value) - set(outer_cells.LAYOUTS)
  if unknown:
    raise app.UsageError(f"--layouts: no layout {sorted(unknown)} (the "
                         f"layouts: {', '.join(outer_cells.LAYOUTS)})")
  if _CHILD_RECORDS.value:
    with open(_CHILD_RECORDS.value, "w") as f:
      json.dump(_run_here(_CELLS.value), f)
    return 0
  names = outer_cells.select(_CELLS.value, _LAYOUTS.value)

  if _LIST.value or _WRITE.value:
    if not names:
      raise app.UsageError(f"no cell matches --cells={_CELLS.value}")
  if _LIST.value:
    for name in names:
      lines = outer_cells.validate(name)
      print(f"{name:42s} {'refused: ' + '; '.join(lines) if lines else 'ok'}")
    return 0

  if _WRITE.value:
    start = time.perf_counter()
    records = _run_all(names)
    fixture = {
        "about": "benchmarks/outer_numerics.py: final eval loss and x per "
                 "cell on configs/tiny.py; written by --write",
        "environment": outer_cells.environment(), "cells": records}
    os.makedirs(os.path.dirname(os.path.abspath(_WRITE.value)),
                exist_ok=True)
    with open(_WRITE.value, "w") as f:
      json.dump(fixture, f, indent=1, sort_keys=True)
      f.write("\n")
    print(f"wrote {len(records)} cells to {_WRITE.value} in "
          f"{time.perf_counter() - start:.0f}s")
    return 0

  with open(_CHECK.value) as f:
    fixture = json.load(f)
  names = [name for name in fixture["cells"]
           if not _CELLS.value or any(p in name for p in _CELLS.value)]
  if not names:
    raise app.UsageError(f"no cell of {_CHECK.value} matches --cells="
                         f"{_CELLS.value}")
  notes = outer_cells.environment_note(fixture["environment"],
                                       outer_cells.environment())
  if notes:
    print("the fixture was written elsewhere (sha256s need not match):\n  "
          + "\n  ".join(notes))
  rtol = _RTOL.value
  print("relative differences from the fixture:")
  print(f"{'cell':42s} {'status':8s} {'eval loss':>9s} {'sum':>9s} "
        f"{'sum sq':>9s} {'time':>6s}  why")
  failed = []
  runs = _run_all([name for name in names if name in outer_cells.CELLS])
  for name in names:
    if name not in outer_cells.CELLS:
      result, seconds = {"status": "DIFFERS",
                         "why": "no longer a cell of this grid"}, None
    else:
      got = runs[name]
      result = outer_cells.compare(fixture["cells"][name], got, rtol)
      seconds = got.get("seconds")
    print(f"{name:42s} {result['status']:8s} "
          f"{_fmt(result.get('eval_loss')):>9s} {_fmt(result.get('sum')):>9s}"
          f" {_fmt(result.get('sum_squares')):>9s} "
          f"{'-' if seconds is None else f'{seconds:.0f}s':>6s}  "
          f"{result['why']}", flush=True)
    if (result["status"] == "DIFFERS" and rtol > 0) or (
        _STRICT.value and result["status"] != "exact"):
      failed.append(name)
  if failed:
    print(f"{len(failed)} cell(s) moved: {', '.join(failed)}")
    return 1
  return 0


if __name__ == "__main__":
  app.run(main)
