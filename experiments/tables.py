"""A study's results: statistics over seeds, paired comparisons against the
reference point, and the markdown table.

Each point reports the mean and sample standard deviation of the final eval
loss over its seeds, and the change of eval perplexity against the
reference point paired by seed (exp(loss - reference loss) - 1 per seed,
then mean and standard deviation): the papers report perplexity changes,
and pairing removes the seed-to-seed spread both points share.
"""

import math


def stats(values: list[float]) -> dict:
  n = len(values)
  if not n:
    return {"mean": None, "std": None, "n": 0}
  mean = sum(values) / n
  std = (math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
         if n > 1 else 0.0)
  return {"mean": mean, "std": std, "n": n}


def summarize(study, runs: dict, seeds: list[int], quick: bool,
              points) -> dict:
  """The results record of `study` (a study_lib.Study) from {point name:
  [run records]}."""
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
        "eval_loss": stats(losses),
        "perplexity_change_vs_reference": stats(paired),
        "comm_bytes": stats([r["comm_bytes"] for r in finished.values()]),
        "island_mean_eval_loss": stats(
            [r["final_eval_loss_island_mean"] for r in finished.values()
             if r.get("final_eval_loss_island_mean") is not None]),
        # The outer params against the islands' plain average (DiLoCo),
        # as a perplexity change, per seed.
        "outer_vs_island_mean": stats(
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
