"""What every study shares: points x seeds of normal runs, resumable, and
their results as JSON, a markdown table and a PNG plot.

A study is a list of points (config overrides on configs/study.py) and a
reference point. Each point runs once per seed (config.seed and
config.data.seed both set to it, so the initialization and the batch order
change) with `train.train_and_evaluate`, in a workdir named by a hash of
its config (RUNS/runs/HASH, so studies share identical runs); that resumes a
stopped run and returns a finished run's summary at once: a killed study
continues where it stopped when rerun. A run that diverges (NaN) is
recorded as such and not retried.

tables.py turns the runs into statistics and a markdown table; plots.py
draws them.
"""

import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import Callable

from absl import flags
from absl import logging

from experiments import tables

QUICK_SEEDS = 2  # --quick: enough seeds to exercise the spread


@dataclasses.dataclass(frozen=True)
class Point:
  """One setting of a study: `overrides` on the study's base config.

  Attributes:
    name: the point's label (a directory name too).
    overrides: {'dotted.config.field': value}.
    x: where sweeps plot it (None for categorical points).
    reference: the point it is compared with (default: the study's).
    series: sweeps draw one line per series (a label; '' for the main one).
  """
  name: str
  overrides: dict
  x: float | None = None
  reference: str | None = None
  series: str = ""


@dataclasses.dataclass(frozen=True)
class Study:
  """A claim, the points that test it, and how to plot them.

  Attributes:
    name: the study's directory and file names.
    title: the plot's and table's title.
    claim: what the paper found, in one sentence.
    points: the full study's points, or a function of the base config
      (configs/study.py with base_overrides) giving them.
    reference: the name of the point others are compared with.
    plot: plot(results, path) writes the PNG.
    quick_points: the names --quick runs (default: all).
    base_overrides: applied to configs/study.py before each point's.
    report: report(results) -> markdown written below the table (more
      columns a study needs), or None.
    base: the module under configs/ the points override: 'study'
      (configs/study.py) or 'scaling' (configs/scaling.py, whose scale
      the --scale flag picks; its results are named STUDY_SCALE).
    seeds: how many seeds (0, 1, ...) a full run takes unless --seeds
      says otherwise.
  """
  name: str
  title: str
  claim: str
  points: tuple | Callable
  reference: str
  plot: Callable
  quick_points: tuple | None = None
  base_overrides: dict = dataclasses.field(default_factory=dict)
  report: Callable | None = None
  base: str = "study"
  scale: str = ""
  seeds: int = 3


def at_scale(study: Study, scale: str) -> Study:
  """`study` on configs/scaling.py at `scale` ('small' or 'large'), its
  results named STUDY_SCALE; a configs/study.py study as it is."""
  if study.base != "scaling":
    return study
  return dataclasses.replace(study, name=f"{study.name}_{scale}",
                             scale=scale)


def base_config(study: Study, quick: bool):
  """The study's base config (its quick version) with its overrides."""
  import importlib  # pylint: disable=g-import-not-at-top
  from diloco_jax.config import schema as config_schema  # pylint: disable=g-import-not-at-top
  module = importlib.import_module(f"configs.{study.base}")
  return config_schema.override(
      module.get_config("quick" if quick else study.scale),
      study.base_overrides)


def study_points(study: Study, quick: bool) -> list[Point]:
  """The points a full or --quick study runs."""
  points = study.points
  if callable(points):
    points = points(base_config(study, quick))
  return [p for p in points if not quick or study.quick_points is None
          or p.name in study.quick_points]


def point_config(study: Study, point: Point, seed: int, quick: bool):
  """The config of one run: base, quick settings, study, point, seed."""
  from diloco_jax.config import schema as config_schema  # pylint: disable=g-import-not-at-top
  config = config_schema.override(base_config(study, quick), point.overrides)
  return config_schema.override(config, {"seed": seed, "data.seed": seed})


def _run_record(summary: dict, seed: int, workdir: str) -> dict:
  return {
      "seed": seed, "workdir": workdir, "status": "done",
      "final_eval_loss": summary["final_eval_loss"],
      "final_eval_loss_island_mean": summary.get(
          "final_eval_loss_island_mean"),
      "comm_bytes": summary["comm_bytes"],
      "ddp_comm_bytes": summary["ddp_comm_bytes"],
      "tokens_seen": summary["tokens_seen"],
      "total_steps": summary["total_steps"],
      "wall_s": summary["wall_s"],
  }


FAILURE_FILE = "study_failure.json"  # in a run's workdir: not retried
# Config fields added after runs were cached: left unset (None) they stay
# out of a run's hash, so the runs of a config that does not use them are
# still found.
LATER_FIELDS = ("diloco.eager_own_weight", "diloco.overlap_warmup_rounds")


def _renamed_overlaps(config) -> None:
  """Writes an eager config in `config` (unlocked) as runs were cached
  before 'eager' took an own weight of 1 and 2 warm-up rounds by default:
  the paper's share rule was overlap='eager' with no weight (now
  'eager_share'), a weight of 1 was set explicitly, and every run started
  eager updates at once (no warm-up field). So each rule keeps its runs'
  hashes, and no cached run of one rule is read back for the other."""
  from diloco_jax.config import overlap_defaults  # pylint: disable=g-import-not-at-top
  diloco = config.diloco
  if "overlap_warmup_rounds" in diloco:
    diloco.overlap_warmup_rounds = (
        overlap_defaults.warmup_rounds(diloco) or None)
  if diloco.overlap == "eager_share":
    diloco.overlap, diloco.eager_own_weight = "eager", None
  elif diloco.overlap == "eager" and diloco.eager_own_weight is None:
    diloco.eager_own_weight = 1.0


def run_workdir(runs_dir: str, config) -> str:
  """RUNS/runs/HASH: one directory per distinct config (seed included).

  Studies share their runs: the reference DiLoCo run of one study is a
  point of several others, and runs once.
  """
  hashed = config.copy_and_resolve_references()
  with hashed.unlocked():
    _renamed_overlaps(hashed)
    for name in LATER_FIELDS:
      *sections, field = name.split(".")
      fields = hashed
      for section in sections:
        fields = fields[section]
      if field in fields and fields[field] is None:
        del fields[field]
  digest = hashlib.sha256(hashed.to_json_best_effort(
      sort_keys=True).encode()).hexdigest()[:16]
  return os.path.join(runs_dir, "runs", digest)


def run_point(study: Study, point: Point, seed: int, runs_dir: str,
              quick: bool) -> dict:
  """Runs (or resumes, or reads back) one point at one seed.

  A workdir holding summary.json is a finished run: its record is read
  back without training or loading its checkpoints.
  """
  # pylint: disable=g-import-not-at-top
  from diloco_jax.algorithm import guards
  from diloco_jax.run import train
  # pylint: enable=g-import-not-at-top
  config = point_config(study, point, seed, quick)
  workdir = run_workdir(runs_dir, config)
  failure = os.path.join(workdir, FAILURE_FILE)
  if os.path.exists(failure):
    with open(failure) as f:
      return json.load(f)
  # Only a finished run writes its summary: read it back as it is, so a runs
  # directory copied without its checkpoints (runs made on another machine,
  # or checkpoints deleted for disk space) still counts as finished.
  summary_path = os.path.join(workdir, "summary.json")
  if os.path.exists(summary_path):
    with open(summary_path) as f:
      return _run_record(json.load(f), seed, workdir)
  start = time.perf_counter()
  try:
    summary = train.train_and_evaluate(config, workdir)
  except guards.NonFiniteError as e:
    record = {"seed": seed, "workdir": workdir, "status": "diverged",
              "error": str(e)}
    with open(failure, "w") as f:
      json.dump(record, f, indent=2)
    print(f"  {point.name} seed {seed}: diverged ({e})", flush=True)
    return record
  record = _run_record(summary, seed, workdir)
  print(f"  {point.name} seed {seed}: eval loss "
        f"{record['final_eval_loss']:.4f} "
        f"({time.perf_counter() - start:.0f}s)", flush=True)
  return record


def write_results(study: Study, results: dict, out_dir: str) -> dict:
  """Writes STUDY.json, STUDY.md and STUDY.png under out_dir; returns
  their paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = {kind: os.path.join(out_dir, f"{study.name}.{kind}")
           for kind in ("json", "md", "png")}
  with open(paths["json"] + ".tmp", "w") as f:
    json.dump(results, f, indent=2, sort_keys=True)
  os.replace(paths["json"] + ".tmp", paths["json"])
  with open(paths["md"], "w") as f:
    f.write(study_markdown(study, results) + "\n")
  study.plot(results, paths["png"])
  return paths


def study_markdown(study: Study, results: dict) -> str:
  """The study's markdown: the table, and its report below it."""
  text = tables.markdown_table(results)
  if study.report is not None:
    text += "\n\n" + study.report(results)
  return text


def run_study(study: Study, runs_dir: str, seeds: list[int], quick: bool,
              out_dir: str) -> dict:
  """Runs every point at every seed (resuming), then writes the results."""
  points = study_points(study, quick)
  start = time.perf_counter()
  runs = {}
  for point in points:
    print(f"{study.name}: {point.name}", flush=True)
    runs[point.name] = [run_point(study, point, seed, runs_dir, quick)
                        for seed in seeds]
  results = tables.summarize(study, runs, seeds, quick, points)
  results["study_wall_s"] = time.perf_counter() - start
  paths = write_results(study, results, out_dir)
  print("\n" + study_markdown(study, results))
  print(f"\nwrote {paths['json']}, {paths['md']}, {paths['png']} "
        f"({results['study_wall_s'] / 60:.1f} min this time; the runs took "
        f"{results['runs_wall_s'] / 60:.1f} min in all)")
  return results


_RUNS = flags.DEFINE_string("runs", "runs/studies",
                            "Where each run's workdir goes.")
_OUT = flags.DEFINE_string(
    "out", None, "Where STUDY.json/.md/.png go (default: RUNS/STUDY).")
_SEEDS = flags.DEFINE_integer(
    "seeds", None, "Seeds per point (0, 1, ...); default: the study's own "
    "(3 for most).")
_QUICK = flags.DEFINE_bool(
    "quick", False, "A minute-long version (tiny model, few steps, "
    f"{QUICK_SEEDS} seeds) that checks the study runs end to end.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 4, "Host CPU devices (islands fold onto them).")
_SCALE = flags.DEFINE_enum(
    "scale", "small", ["small", "large", "gpu"],
    "Studies on configs/scaling.py: the model scale.")


def main(study: Study):
  """The command line of a study module: absl flags, then run_study."""
  main_many(lambda scale: [study])


def main_many(choose: Callable[[str], list[Study]]):
  """The command line of one study or several (experiments/all.py):
  `choose(scale)`, called once the flags are parsed, gives the studies,
  run one after another with the same flags and runs directory."""
  from absl import app  # pylint: disable=g-import-not-at-top

  def run(argv):
    if len(argv) > 1:
      raise app.UsageError(f"unexpected arguments {argv[1:]}")
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
    runs_dir = _RUNS.value + ("_quick" if _QUICK.value else "")
    # The points of a study compile the same programs again and again (seeds
    # and most settings change values, not shapes): keep them on disk.
    jax.config.update("jax_compilation_cache_dir",
                      os.path.join(runs_dir, ".jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    logging.set_verbosity(logging.WARNING)  # one line per run instead
    from diloco_jax.run import stops  # pylint: disable=g-import-not-at-top
    for study in choose(_SCALE.value):
      scaled = at_scale(study, _SCALE.value)
      out_dir = _OUT.value or os.path.join(runs_dir, scaled.name)
      seeds = list(range(QUICK_SEEDS if _QUICK.value
                         else _SEEDS.value or study.seeds))
      try:
        run_study(scaled, runs_dir, seeds, _QUICK.value, out_dir)
      except stops.StopRequested as e:
        sys.exit(f"{e}; rerun the study to continue")

  app.run(run)
