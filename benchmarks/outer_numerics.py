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

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

from absl import app
from absl import flags
from absl import logging

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

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

# The tests' CPU devices and XLA flags (tests/conftest.py): the fixture's
# numbers are the ones the tests see.
NUM_CPU_DEVICES = 8
FAST_COMPILE = ("--xla_backend_optimization_level=0 "
                "--xla_cpu_use_fusion_emitters=false")

# configs/tiny.py, for every cell.
BASE = {
    "model.num_layers": 2, "model.d_model": 64, "model.num_heads": 4,
    "model.head_dim": 16, "model.mlp_dim": 256,
    "diloco.islands": 2, "total_steps": 16, "diloco.inner_steps": 4,
    # The last step's checkpoint (x) and evaluation only.
    "checkpoint.every_rounds": 0, "eval.every_rounds": 0,
}
OVERLAPS = {
    "none": {},
    "one_step_delay": {"diloco.overlap": "one_step_delay"},
    "one_step_delay_rebase": {"diloco.overlap": "one_step_delay_rebase"},
    "eager": {"diloco.overlap": "eager"},
    "eager_share": {"diloco.overlap": "eager_share"},
    "streaming": {"diloco.fragments": 2, "diloco.fragment_delay": 1,
                  "diloco.fragment_alpha": 0.5},
}
CODECS = {
    "fp32": {},
    "int8": {"diloco.codec": "int8", "diloco.error_feedback": True},
    "sparseloco": {"diloco.outer_optimizer.name": "sparseloco"},
}
LAYOUTS = {
    "plain": {},
    "fsdp": {"mesh.data": 2, "mesh.fsdp": True},
    "stages": {"mesh.stage": 2},
    "host": {"diloco.outer_placement": "host"},
    # Not in the default grid (--layouts): each stage's outer side on an
    # outer device of its own (run/host_outer.py's per-stage side; with
    # streaming, run/stage_fragments.py's StageFragmentOuter).
    "host+stages": {"diloco.outer_placement": "host", "mesh.stage": 2},
}
DEFAULT_LAYOUTS = ("plain", "fsdp", "stages", "host")
CELLS = [f"{o}/{c}/{l}" for o in OVERLAPS for c in CODECS for l in LAYOUTS]


def cell_overrides(name: str) -> dict:
  """configs/tiny.py's fields a cell sets (dotted names)."""
  overlap, codec, layout = name.split("/")
  return {**BASE, **OVERLAPS[overlap], **CODECS[codec], **LAYOUTS[layout]}


def select(patterns, layouts=DEFAULT_LAYOUTS, cells=None) -> list[str]:
  """The cells (of `cells`, else of the grid) in `layouts` whose name
  contains one of `patterns` (any if none)."""
  return [c for c in (CELLS if cells is None else cells)
          if c.split("/")[2] in layouts
          and (not patterns or any(p in c for p in patterns))]


def configure_jax(compilation_cache: str | None = None) -> None:
  """Forces the tests' CPU devices and XLA flags; before JAX starts."""
  flags_now = os.environ.get("XLA_FLAGS", "")
  if FAST_COMPILE not in flags_now and _xla_accepts(FAST_COMPILE):
    os.environ["XLA_FLAGS"] = f"{flags_now} {FAST_COMPILE}".strip()
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)
  jax.config.update("jax_platforms", "cpu")
  if compilation_cache:
    jax.config.update("jax_compilation_cache_dir", compilation_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def _xla_accepts(xla_flags: str) -> bool:
  """Whether this XLA knows the flags (an unknown one aborts a process)."""
  env = {**os.environ, "XLA_FLAGS": xla_flags, "JAX_PLATFORMS": "cpu"}
  probe = "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()"
  return subprocess.run([sys.executable, "-c", probe], env=env,
                        capture_output=True, check=False).returncode == 0


def environment() -> dict:
  """What the sha256s hold only under: JAX, XLA's flags, devices, CPU."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      names = [line.split(":", 1)[1].strip() for line in f
               if line.startswith("model name")]
    cpu = names[0] if names else cpu
  except OSError:
    pass
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "xla_flags": " ".join(os.environ.get("XLA_FLAGS", "").split()),
          "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
          "cpu": cpu}


def fingerprint(params) -> dict:
  """x's sha256 (its leaves' float32 bytes in sorted path order, each
  leaf's path and shape included), a short sha256 per leaf, and the
  float64 sum and sum of squares of all its values."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  leaves = sorted((jax.tree_util.keystr(path), np.asarray(leaf))
                  for path, leaf in jax.tree_util.tree_leaves_with_path(
                      params))
  whole, per_leaf, total, squares, count = hashlib.sha256(), {}, 0.0, 0.0, 0
  for path, leaf in leaves:
    data = np.ascontiguousarray(leaf, dtype=np.float32)
    digest = hashlib.sha256(data.tobytes()).hexdigest()
    whole.update(f"{path}{data.shape}{digest}".encode())
    per_leaf[path] = digest[:16]
    wide = data.astype(np.float64)
    total += float(wide.sum())
    squares += float(np.square(wide).sum())
    count += data.size
  return {"sha256": whole.hexdigest(), "sum": total, "sum_squares": squares,
          "values": count, "leaves": per_leaf}


def _final_x(workdir: str):
  """The final checkpoint's global_params, as numpy arrays (checkpoints
  hold the logical layout whatever the placement or stages)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  path = os.path.join(workdir, "checkpoints")
  step = max(int(s) for s in os.listdir(path) if s.isdigit())
  state_path = os.path.join(path, str(step), "state")
  checkpointer = ocp.PyTreeCheckpointer()
  # orbax warns of no _CHECKPOINT_METADATA; the logger's own level is put
  # back as it was (set_verbosity(get_verbosity()) would pin it, and a test
  # process's later INFO lines would reach no handler).
  absl_logger = logging.get_absl_logger()
  level = absl_logger.level
  logging.set_verbosity(logging.ERROR)
  try:
    metadata = checkpointer.metadata(state_path).item_metadata
    state = checkpointer.restore(state_path, restore_args=jax.tree.map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata))
  finally:
    absl_logger.setLevel(level)
  return step, state["global_params"]


def config_of(name: str):
  """configs/tiny.py with the cell's overrides."""
  from configs import tiny  # pylint: disable=g-import-not-at-top
  from diloco_jax.config import schema  # pylint: disable=g-import-not-at-top
  return schema.override(tiny.get_config(), cell_overrides(name))


def _problem_lines(error) -> list[str]:
  message = str(error)
  if "\n" not in message:
    return [message]
  return [line.strip() for line in message.splitlines()[1:]]


def validate(name: str) -> list[str]:
  """The lines a cell is refused with ([]: it validates), as train
  validates it (the outer devices set aside first)."""
  import jax  # pylint: disable=g-import-not-at-top
  from diloco_jax.config import validation  # pylint: disable=g-import-not-at-top
  from diloco_jax.parallel import outer_devices  # pylint: disable=g-import-not-at-top
  config = config_of(name)
  devices = jax.devices()
  try:
    if config.diloco.outer_placement == "host":
      devices, _ = outer_devices.split_devices(
          devices, per_process=max(config.mesh.stage, 1))
    validation.validate_config(config, len(devices))
  except (validation.ConfigError, ValueError) as e:
    return _problem_lines(e)
  return []


def run_cell(name: str, workdir: str | None = None) -> dict:
  """Trains the cell in `workdir` (a fresh temporary folder, removed
  after, when None); its record for the fixture."""
  from diloco_jax.config import validation  # pylint: disable=g-import-not-at-top
  from diloco_jax.run import train  # pylint: disable=g-import-not-at-top
  record = {"overrides": cell_overrides(name)}
  own = workdir is None
  if own:
    workdir = tempfile.mkdtemp(prefix="outer_numerics_")
    os.rmdir(workdir)  # the run makes it
  config = config_of(name)
  start = time.perf_counter()
  try:
    summary = train.train_and_evaluate(config, workdir)
    step, x = _final_x(workdir)
  except validation.ConfigError as e:
    record["refused"] = _problem_lines(e)
    return record
  except Exception as e:  # pylint: disable=broad-except
    # Recorded (a cell that fails today is part of today's numbers), so
    # one cell does not end a run of them.
    logging.error("%s failed:\n%s", name, traceback.format_exc())
    record["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return record
  finally:
    if own:
      shutil.rmtree(workdir, ignore_errors=True)
  if step != config.total_steps:
    raise RuntimeError(f"{name}: the newest checkpoint is step {step}, not "
                       f"the last step {config.total_steps}")
  record.update(eval_loss=summary["final_eval_loss"],
                comm_bytes=summary["comm_bytes"], x=fingerprint(x),
                seconds=round(time.perf_counter() - start, 1))
  return record


def _relative(a: float, b: float) -> float:
  if a == b:
    return 0.0
  return abs(a - b) / max(abs(a), abs(b))


def compare(expected: dict, got: dict, rtol: float = 0.0) -> dict:
  """How `got` (run_cell's record) stands against the fixture's record:
  {'status': 'exact' | 'close' | 'DIFFERS', 'why': ..., and the relative
  differences 'eval_loss', 'sum', 'sum_squares' where both ran}."""
  if expected.get("overrides") != got.get("overrides"):
    return {"status": "DIFFERS", "why": "the cell's overrides changed"}
  for outcome in ("refused", "failed"):
    if outcome in expected or outcome in got:
      if expected.get(outcome) == got.get(outcome):
        return {"status": "exact", "why": f"{outcome}, as before"}
      now = got.get("refused") or got.get("failed")
      if now is None:
        why = f"{outcome} before, runs now"
      else:
        now = "; ".join(now) if isinstance(now, list) else now
        why = f"{'refused' if 'refused' in got else 'failed'} now: {now}"
      return {"status": "DIFFERS", "why": why}
  result = {
      "eval_loss": _relative(expected["eval_loss"], got["eval_loss"]),
      "sum": _relative(expected["x"]["sum"], got["x"]["sum"]),
      "sum_squares": _relative(expected["x"]["sum_squares"],
                               got["x"]["sum_squares"]),
  }
  if expected["comm_bytes"] != got["comm_bytes"]:
    return {**result, "status": "DIFFERS",
            "why": f"comm_bytes {got['comm_bytes']} (was "
                   f"{expected['comm_bytes']})"}
  if (expected["x"]["sha256"] == got["x"]["sha256"]
      and expected["eval_loss"] == got["eval_loss"]):
    return {**result, "status": "exact", "why": ""}
  moved = [path for path, digest in expected["x"]["leaves"].items()
           if got["x"]["leaves"].get(path) != digest]
  why = (f"{len(moved)} of {len(expected['x']['leaves'])} leaves of x "
         "moved" if moved else "x is the same, the eval loss is not")
  largest = max(result.values())
  status = "close" if rtol > 0 and largest <= rtol else "DIFFERS"
  return {**result, "status": status, "why": why}


def _fmt(value) -> str:
  return "-" if value is None else f"{value:.2e}"


def environment_note(recorded: dict, now: dict) -> list[str]:
  """One line per way `now` (environment()) differs from `recorded`."""
  return [f"{key}: fixture {recorded.get(key)!r}, now {now[key]!r}"
          for key in now if recorded.get(key) != now[key]]


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
    record = run_cell(name)
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
  configure_jax(_CACHE.value)
  logging.set_verbosity(logging.WARNING)
  unknown = set(_LAYOUTS.value) - set(LAYOUTS)
  if unknown:
    raise app.UsageError(f"--layouts: no layout {sorted(unknown)} (the "
                         f"layouts: {', '.join(LAYOUTS)})")
  if _CHILD_RECORDS.value:
    with open(_CHILD_RECORDS.value, "w") as f:
      json.dump(_run_here(_CELLS.value), f)
    return 0
  names = select(_CELLS.value, _LAYOUTS.value)

  if _LIST.value or _WRITE.value:
    if not names:
      raise app.UsageError(f"no cell matches --cells={_CELLS.value}")
  if _LIST.value:
    for name in names:
      lines = validate(name)
      print(f"{name:42s} {'refused: ' + '; '.join(lines) if lines else 'ok'}")
    return 0

  if _WRITE.value:
    start = time.perf_counter()
    records = _run_all(names)
    fixture = {
        "about": "benchmarks/outer_numerics.py: final eval loss and x per "
                 "cell on configs/tiny.py; written by --write",
        "environment": environment(), "cells": records}
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
  notes = environment_note(fixture["environment"], environment())
  if notes:
    print("the fixture was written elsewhere (sha256s need not match):\n  "
          + "\n  ".join(notes))
  rtol = _RTOL.value
  print("relative differences from the fixture:")
  print(f"{'cell':42s} {'status':8s} {'eval loss':>9s} {'sum':>9s} "
        f"{'sum sq':>9s} {'time':>6s}  why")
  failed = []
  runs = _run_all([name for name in names if name in CELLS])
  for name in names:
    if name not in CELLS:
      result, seconds = {"status": "DIFFERS",
                         "why": "no longer a cell of this grid"}, None
    else:
      got = runs[name]
      result, seconds = (compare(fixture["cells"][name], got, rtol),
                         got.get("seconds"))
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
