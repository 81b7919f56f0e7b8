"""The cells of benchmarks/outer_numerics.py (its docstring says what they
are): each cell's config, its training run, the fingerprint of its final
x, and how two records compare. The tests' XLA settings apply
(tests/xla_settings.py): the fixture's numbers are the ones the tests see.
"""
import hashlib
import os
import platform
import shutil
import tempfile
import time
import traceback

from absl import logging

from tests import xla_settings

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
    # outer device of its own (compiled/host_outer.py's per-stage side; with
    # streaming, compiled/stage_sends.py's StageFragmentOuter).
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
  fast = xla_settings.FAST_COMPILE
  if fast not in flags_now and xla_settings.xla_accepts(fast):
    os.environ["XLA_FLAGS"] = f"{flags_now} {fast}".strip()
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_num_cpu_devices", xla_settings.NUM_CPU_DEVICES)
  jax.config.update("jax_platforms", "cpu")
  if compilation_cache:
    jax.config.update("jax_compilation_cache_dir", compilation_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


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


def environment_note(recorded: dict, now: dict) -> list[str]:
  """One line per way `now` (environment()) differs from `recorded`."""
  return [f"{key}: fixture {recorded.get(key)!r}, now {now[key]!r}"
          for key in now if recorded.get(key) != now[key]]
