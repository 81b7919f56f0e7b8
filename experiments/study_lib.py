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

Each point reports the mean and sample standard deviation of the final eval
loss over its seeds, and the change of eval perplexity against the
reference point paired by seed (exp(loss - reference loss) - 1 per seed,
then mean and standard deviation): the papers report perplexity changes,
and pairing removes the seed-to-seed spread both points share.
"""

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from typing import Callable

from absl import flags
from absl import logging

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
  """
  name: str
  title: str
  claim: str
  points: tuple | Callable
  reference: str
  plot: Callable
  quick_points: tuple | None = None
  base_overrides: dict = dataclasses.field(default_factory=dict)


def base_config(study: Study, quick: bool):
  """configs/study.py (its quick version) with the study's overrides."""
  # pylint: disable=g-import-not-at-top
  from configs import study as study_config
  from diloco_jax.config import schema as config_schema
  # pylint: enable=g-import-not-at-top
  return config_schema.override(
      study_config.get_config("quick" if quick else ""), study.base_overrides)


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


def run_workdir(runs_dir: str, config) -> str:
  """RUNS/runs/HASH: one directory per distinct config (seed included).

  Studies share their runs: the reference DiLoCo run of one study is a
  point of several others, and runs once.
  """
  digest = hashlib.sha256(config.to_json_best_effort(
      sort_keys=True).encode()).hexdigest()[:16]
  return os.path.join(runs_dir, "runs", digest)


def run_point(study: Study, point: Point, seed: int, runs_dir: str,
              quick: bool) -> dict:
  """Runs (or resumes, or reads back) one point at one seed."""
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


def _stats(values: list[float]) -> dict:
  n = len(values)
  if not n:
    return {"mean": None, "std": None, "n": 0}
  mean = sum(values) / n
  std = (math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
         if n > 1 else 0.0)
  return {"mean": mean, "std": std, "n": n}


def summarize(study: Study, runs: dict, seeds: list[int], quick: bool,
              points) -> dict:
  """The results record from {point name: [run records]}."""
  done = lambda records: {r["seed"]: r for r in records
                          if r["status"] == "done"}
  rows = []
  for point in points:
    reference_name = point.reference or study.reference
    reference = done(runs.get(reference_name, []))
    finished = done(runs[point.name])
    losses = [r["final_eval_loss"] for r in finished.values()]
    paired = [math.exp(r["final_eval_loss"]
                       - reference[seed]["final_eval_loss"]) - 1
              for seed, r in finished.items() if seed in reference]
    rows.append({
        "name": point.name, "x": point.x, "overrides": point.overrides,
        "reference": reference_name, "series": point.series,
        "runs": runs[point.name],
        "diverged": sum(r["status"] == "diverged" for r in runs[point.name]),
        "eval_loss": _stats(losses),
        "perplexity_change_vs_reference": _stats(paired),
        "comm_bytes": _stats([r["comm_bytes"] for r in finished.values()]),
        "island_mean_eval_loss": _stats(
            [r["final_eval_loss_island_mean"] for r in finished.values()
             if r.get("final_eval_loss_island_mean") is not None]),
        # The outer params against the islands' plain average (DiLoCo),
        # as a perplexity change, per seed.
        "outer_vs_island_mean": _stats(
            [math.exp(r["final_eval_loss"]
                      - r["final_eval_loss_island_mean"]) - 1
             for r in finished.values()
             if r.get("final_eval_loss_island_mean") is not None]),
        "wall_s": sum(r["wall_s"] for r in finished.values()),
    })
  return {
      "study": study.name, "title": study.title, "claim": study.claim,
      "quick": quick, "seeds": seeds, "reference": study.reference,
      "base_overrides": study.base_overrides, "points": rows,
      "runs_wall_s": sum(row["wall_s"] for row in rows),
  }


def _format_mb(value) -> str:
  return "-" if value is None else f"{value / 1e6:.2f} MB"


def markdown_table(results: dict) -> str:
  """The results as a markdown table, one row per point."""
  with_mean = any(row["outer_vs_island_mean"]["n"]
                  for row in results["points"])
  lines = [
      f"**{results['title']}** ({len(results['seeds'])} seeds; reference: "
      f"{results['reference']})", "",
      "| point | eval loss (mean ± std) | perplexity vs reference | sent per "
      "island | runs |" + (" outer params vs islands' average |"
                           if with_mean else ""),
      "|---|---|---|---|---|" + ("---|" if with_mean else "")]
  for row in results["points"]:
    outer = row["outer_vs_island_mean"]
    outer_text = ("-" if not outer["n"] else
                  f"{100 * outer['mean']:+.2f}% ± {100 * outer['std']:.2f}")
    loss, change = row["eval_loss"], row["perplexity_change_vs_reference"]
    loss_text = ("-" if loss["mean"] is None else
                 f"{loss['mean']:.4f} ± {loss['std']:.4f}")
    change_text = ("-" if change["mean"] is None or row["name"] ==
                   row["reference"] else
                   f"{100 * change['mean']:+.2f}% ± {100 * change['std']:.2f}"
                   + ("" if row["reference"] == results["reference"] else
                      f" (vs {row['reference']})"))
    runs = f"{loss['n']}" + (f" ({row['diverged']} diverged)"
                             if row["diverged"] else "")
    lines.append(f"| {row['name']} | {loss_text} | {change_text} | "
                 f"{_format_mb(row['comm_bytes']['mean'])} | {runs} |"
                 + (f" {outer_text} |" if with_mean else ""))
  return "\n".join(lines)


def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _finished(results: dict) -> list[dict]:
  return [row for row in results["points"] if row["eval_loss"]["n"]]


def _finish(plt, fig, ax, results: dict, path: str) -> None:
  ax.set_title(results["title"] + (" (quick)" if results["quick"] else ""))
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def bar_plot(results: dict, path: str) -> None:
  """Final eval loss per point: mean with a bar of ± one std."""
  plt = _pyplot()
  rows = _finished(results)
  fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(rows) + 2), 4))
  means = [row["eval_loss"]["mean"] for row in rows]
  ax.bar(range(len(rows)), means,
         yerr=[row["eval_loss"]["std"] for row in rows], capsize=4,
         color=["tab:orange" if row["name"] == results["reference"]
                else "tab:blue" for row in rows])
  ax.set_xticks(range(len(rows)), [row["name"] for row in rows],
                rotation=20, ha="right")
  if means:
    spread = max(means) - min(means) or 0.05
    ax.set_ylim(min(means) - 1.5 * spread, max(means) + 1.0 * spread)
  ax.set_ylabel("final eval loss (nats/token)")
  _finish(plt, fig, ax, results, path)


def sweep_plot(xlabel: str, logx: bool = False):
  """A plot(results, path) of final eval loss against each point's x."""

  def plot(results: dict, path: str) -> None:
    plt = _pyplot()
    rows = [row for row in _finished(results) if row["x"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    for series in dict.fromkeys(row.get("series", "") for row in rows):
      line = sorted((row for row in rows if row.get("series", "") == series),
                    key=lambda row: row["x"])
      ax.errorbar([row["x"] for row in line],
                  [row["eval_loss"]["mean"] for row in line],
                  yerr=[row["eval_loss"]["std"] for row in line], marker="o",
                  capsize=4, label=series or None)
    if any(row.get("series") for row in rows):
      ax.legend(fontsize=8)
    if logx:
      ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("final eval loss (nats/token)")
    _finish(plt, fig, ax, results, path)

  return plot


def pareto_plot(results: dict, path: str) -> None:
  """Final eval loss against the bytes one island sent, every point."""
  plt = _pyplot()
  rows = sorted(_finished(results), key=lambda row: row["comm_bytes"]["mean"])
  markers = {series: "osD^v"[i % 5] for i, series in enumerate(
      dict.fromkeys(row.get("series", "") for row in rows))}
  fig, ax = plt.subplots(figsize=(8, 5))
  for i, row in enumerate(rows):
    sent = row["comm_bytes"]["mean"] / 1e6
    series = row.get("series", "")
    ax.errorbar([sent], [row["eval_loss"]["mean"]],
                yerr=[row["eval_loss"]["std"]], marker=markers[series],
                capsize=3, color="tab:gray" if series else None)
    # Neighbours in bytes often sit at the same loss: alternate the labels
    # above and below so they stay readable.
    ax.annotate(row["name"], (sent, row["eval_loss"]["mean"]),
                textcoords="offset points",
                xytext=(4, 5 if i % 2 == 0 else -11), fontsize=8)
  for series, marker in markers.items():
    if series:
      ax.plot([], [], marker, color="tab:gray", label=series)
  if len(markers) > 1:
    ax.legend(fontsize=8)
  ax.set_xscale("log")
  ax.set_xlabel("MB sent per island (log)")
  ax.set_ylabel("final eval loss (nats/token)")
  _finish(plt, fig, ax, results, path)


def _mean_curves(row: dict, key: str) -> tuple[list, list]:
  """(steps, mean of `key` over the seeds) from the runs' metrics.jsonl,
  after the pretraining phase (whose high early losses would flatten the
  rest)."""
  by_step = {}
  for run in row["runs"]:
    if run["status"] != "done":
      continue
    with open(os.path.join(run["workdir"], "metrics.jsonl")) as f:
      for line in f:
        record = json.loads(line)
        if (record.get(key) is not None
            and record.get("phase") != "pretrain"):
          by_step.setdefault(record["step"], []).append(record[key])
  steps = sorted(by_step)
  return steps, [sum(by_step[s]) / len(by_step[s]) for s in steps]


def curves_plot(keys: dict):
  """A plot(results, path) of eval curves (mean over seeds) per point.

  Args:
    keys: {metrics.jsonl key: label}, e.g. {'eval_loss': 'outer params'}.
  """

  def plot(results: dict, path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in _finished(results):
      for (key, label), style in zip(keys.items(), ("-", "--", ":")):
        steps, values = _mean_curves(row, key)
        if steps:
          ax.plot(steps, values, style, marker=".",
                  label=f"{row['name']}: {label}" if label else row["name"])
    ax.set_xlabel("step")
    ax.set_ylabel("eval loss (nats/token), mean over seeds")
    ax.legend(fontsize=8)
    _finish(plt, fig, ax, results, path)

  return plot


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
    f.write(markdown_table(results) + "\n")
  study.plot(results, paths["png"])
  return paths


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
  results = summarize(study, runs, seeds, quick, points)
  results["study_wall_s"] = time.perf_counter() - start
  paths = write_results(study, results, out_dir)
  print("\n" + markdown_table(results))
  print(f"\nwrote {paths['json']}, {paths['md']}, {paths['png']} "
        f"({results['study_wall_s'] / 60:.1f} min this time; the runs took "
        f"{results['runs_wall_s'] / 60:.1f} min in all)")
  return results


_RUNS = flags.DEFINE_string("runs", "runs/studies",
                            "Where each run's workdir goes.")
_OUT = flags.DEFINE_string(
    "out", None, "Where STUDY.json/.md/.png go (default: RUNS/STUDY).")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds per point (0, 1, ...).")
_QUICK = flags.DEFINE_bool(
    "quick", False, "A minute-long version (tiny model, few steps, "
    f"{QUICK_SEEDS} seeds) that checks the study runs end to end.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 4, "Host CPU devices (islands fold onto them).")


def main(study: Study):
  """The command line of a study module: absl flags, then run_study."""
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
    seeds = list(range(QUICK_SEEDS if _QUICK.value else _SEEDS.value))
    out_dir = _OUT.value or os.path.join(runs_dir, study.name)
    from diloco_jax.run import stops  # pylint: disable=g-import-not-at-top
    try:
      run_study(study, runs_dir, seeds, _QUICK.value, out_dir)
    except stops.StopRequested as e:
      sys.exit(f"{e}; rerun the study to continue")

  app.run(run)
