"""A study's plots, from its results record (tables.summarize): one bar per
point, sweeps against each point's x, loss against bytes sent, and eval
curves over the steps. Each is a plot(results, path) that writes a PNG.
"""

import json
import os


def pyplot():
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
  plt = pyplot()
  rows = _finished(results)
  fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(rows) + 2), 4))
  _bars(ax, rows, results)
  _finish(plt, fig, ax, results, path)


def bars_and_curves_plot(results: dict, path: str) -> None:
  """Final eval loss per point (bars, ± one std) beside each point's eval
  curve against the tokens seen (points that spend one budget in
  different steps, e.g. one worker and four, share that axis)."""
  plt = pyplot()
  rows = _finished(results)
  fig, (bars, curves) = plt.subplots(
      1, 2, figsize=(max(5, 1.1 * len(rows) + 2) + 6, 4.5))
  _bars(bars, rows, results)
  bars.set_title("final")
  bars.grid(alpha=0.3)
  for row in rows:
    tokens, values = mean_curves(row, "eval_loss", x_key="tokens_seen")
    if tokens:
      curves.plot([t / 1e6 for t in tokens], values, marker=".",
                  label=row["name"])
  curves.set_xlabel("tokens seen (M)")
  curves.set_ylabel("eval loss (nats/token), mean over seeds")
  if rows:
    finals = [row["eval_loss"]["mean"] for row in rows]
    curves.set_ylim(min(finals) - 0.1, max(finals) + 0.8)
  curves.legend(fontsize=8)
  _finish(plt, fig, curves, results, path)


def _bars(ax, rows: list, results: dict) -> None:
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


def sweep_plot(xlabel: str, logx: bool = False,
               versus_reference: bool = False):
  """A plot(results, path) of final eval loss against each point's x, or
  with `versus_reference` of its perplexity change against the study's
  reference, paired by seed: where the seeds move every point together,
  the paired spread is the one that says which point is better."""

  def plot(results: dict, path: str) -> None:
    plt = pyplot()
    rows = [row for row in _finished(results) if row["x"] is not None]
    if versus_reference:
      rows = [row for row in rows
              if row["perplexity_change_vs_reference"]["mean"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    for series in dict.fromkeys(row.get("series", "") for row in rows):
      line = sorted((row for row in rows if row.get("series", "") == series),
                    key=lambda row: row["x"])
      if versus_reference:
        changes = [row["perplexity_change_vs_reference"] for row in line]
        means = [100 * change["mean"] for change in changes]
        spreads = [100 * change["std"] for change in changes]
      else:
        means = [row["eval_loss"]["mean"] for row in line]
        spreads = [row["eval_loss"]["std"] for row in line]
      ax.errorbar([row["x"] for row in line], means, yerr=spreads,
                  marker="o", capsize=4, label=series or None)
    if any(row.get("series") for row in rows):
      ax.legend(fontsize=8)
    if logx:
      ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    if versus_reference:
      ax.axhline(0, color="black", linewidth=0.8)
      ax.set_ylabel(f"perplexity vs {results['reference']} (%, by seed)")
    else:
      ax.set_ylabel("final eval loss (nats/token)")
    _finish(plt, fig, ax, results, path)

  return plot


def pareto_plot(results: dict, path: str) -> None:
  """Final eval loss against the bytes one island sent, every point."""
  plt = pyplot()
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


def mean_curves(row: dict, key: str,
                x_key: str = "step") -> tuple[list, list]:
  """(steps, or another record field `x_key`, and the mean of `key` over
  the seeds) from the runs' metrics.jsonl, after the pretraining phase
  (whose high early losses would flatten the rest)."""
  by_step = {}
  for run in row["runs"]:
    if run["status"] != "done":
      continue
    with open(os.path.join(run["workdir"], "metrics.jsonl")) as f:
      for line in f:
        record = json.loads(line)
        if (record.get(key) is not None
            and record.get("phase") != "pretrain"):
          by_step.setdefault(record[x_key], []).append(record[key])
  steps = sorted(by_step)
  return steps, [sum(by_step[s]) / len(by_step[s]) for s in steps]


def curves_plot(keys: dict):
  """A plot(results, path) of eval curves (mean over seeds) per point.

  Args:
    keys: {metrics.jsonl key: label}, e.g. {'eval_loss': 'outer params'}.
  """

  def plot(results: dict, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in _finished(results):
      for (key, label), style in zip(keys.items(), ("-", "--", ":")):
        steps, values = mean_curves(row, key)
        if steps:
          ax.plot(steps, values, style, marker=".",
                  label=f"{row['name']}: {label}" if label else row["name"])
    ax.set_xlabel("step")
    ax.set_ylabel("eval loss (nats/token), mean over seeds")
    ax.legend(fontsize=8)
    _finish(plt, fig, ax, results, path)

  return plot
