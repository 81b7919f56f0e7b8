r"""What overlapping communication with training costs in quality, and what
it buys in utilization.

  python -m experiments.overlaps [--seeds=3] [--quick]

DiLoCo with 4 islands and H=25 after the shared pretraining (configs/
study.py), with pseudo-gradients sent as int8 and as 4-bit floats (e2m1),
against the ways this codebase lets the collective run beside training:

  none                   no overlap: the islands wait for each round's mean;
  delay                  one_step_delay at its default outer step (lr 0.8,
                         momentum 0; config/overlap_defaults.py);
  delay_m0.9             the same at DiLoCo's lr 0.7, momentum 0.9;
  rebase, rebase_m0.9    one_step_delay_rebase, likewise;
  eager                  eager updates, each island's whole fresh
                         pseudo-gradient applied at once, at their default
                         outer step (lr 0.5, momentum 0.7), from the first
                         round (the default's 2 warm-up rounds, which wait
                         for their mean, are experiments/eager_warmup.py's);
  eager_share            the paper's eager updates, each island's share of
                         the mean applied at once, at theirs (lr 1,
                         momentum 0);
  streaming              Streaming DiLoCo: 2 fragments on staggered
                         schedules, each sync overlapping tau = 5 inner
                         steps, merged with alpha = 0.5.

Eager updates for Streaming DiLoCo's fragments are not offered (refused
with one line): its fragments overlap tau steps of their own round, not a
round.

The table below the results gives each point's utilization at 10 Mbit/s
per island from the network model (diloco_jax/analysis/workloads.py), and
the link each needs for 95%: the run's config with its collective on a
device of its own (outer_placement='host', where an overlap hides it), at
the reference run's measured inner-step time; and over the run's 12
rounds, its warm-up rounds and the end's last wait included. The delayed modes' per-round evals score x
before the mean in flight lands; eager's score the islands' average point.

Full run: 16 points x 3 seeds; the runs take about 70 minutes on 2 CPU
cores.
"""

import json
import os

from experiments import plots
from experiments import study_lib

_CODECS = {"int8": {"diloco.codec": "int8"}, "fp4": {"diloco.codec": "fp4"}}
_DILOCO_OUTER = {"diloco.outer_optimizer.learning_rate": 0.7,
                 "diloco.outer_optimizer.momentum": 0.9}
_MODES = {
    "none": {},
    "delay": {"diloco.overlap": "one_step_delay"},
    "delay_m0.9": {"diloco.overlap": "one_step_delay", **_DILOCO_OUTER},
    "rebase": {"diloco.overlap": "one_step_delay_rebase"},
    "rebase_m0.9": {"diloco.overlap": "one_step_delay_rebase",
                    **_DILOCO_OUTER},
    "eager": {"diloco.overlap": "eager"},
    "eager_share": {"diloco.overlap": "eager_share"},
    "streaming": {"diloco.fragments": 2, "diloco.fragment_delay": 5,
                  "diloco.fragment_alpha": 0.5},
}
BANDWIDTH_BITS_PER_S = 10e6


def _points():
  return tuple(
      study_lib.Point(f"{mode}_{codec}", {**overrides, **codec_overrides},
                      reference=f"none_{codec}", series=codec)
      for codec, codec_overrides in _CODECS.items()
      for mode, overrides in _MODES.items())


def utilization_report(results: dict) -> str:
  """Each point's modeled utilization at 10 Mbit/s beside its cost: of a
  steady round, and over the run's rounds."""
  # pylint: disable=g-import-not-at-top
  import ml_collections
  from diloco_jax.analysis import workloads
  # pylint: enable=g-import-not-at-top

  def first_run(row):
    return next((run for run in row["runs"] if run["status"] == "done"),
                None)

  rows = {row["name"]: row for row in results["points"]}
  reference = first_run(rows[results["reference"]])
  if reference is None:
    return ""
  with open(os.path.join(reference["workdir"], "summary.json")) as f:
    step_s = json.load(f)["network_step_time_s"]
  lines = [
      f"Modeled at {BANDWIDTH_BITS_PER_S / 1e6:g} Mbit/s per island, "
      f"latency 10 ms, inner step {step_s:.3f} s (the reference run's, "
      "measured), the collective on a device of its own:", "",
      "| point | perplexity vs no overlap | utilization | over the run | "
      "round s | Mbit/s for 95% |",
      "|---|---|---|---|---|---|"]
  for row in results["points"]:
    run = first_run(row)
    if run is None:
      continue
    with open(os.path.join(run["workdir"], "config.json")) as f:
      config = ml_collections.ConfigDict(json.load(f))
    config.diloco.outer_placement = "host"
    estimate = workloads.run_estimate(config, step_s, BANDWIDTH_BITS_PER_S,
                                      latency_s=0.01)
    change = row["perplexity_change_vs_reference"]
    change_text = ("-" if change["mean"] is None
                   or row["name"] == row["reference"] else
                   f"{100 * change['mean']:+.1f}% ± {100 * change['std']:.1f}")
    needed = estimate["network_bandwidth_for_utilization"]["0.95"]
    lines.append(f"| {row['name']} | {change_text} | "
                 f"{estimate['network_utilization']:.3f} | "
                 f"{estimate['network_run_utilization']:.3f} | "
                 f"{estimate['network_round_s']:.2f} | "
                 f"{'-' if needed is None else f'{needed / 1e6:.2f}'} |")
  return "\n".join(lines)


def _curves_by_codec(results: dict, path: str) -> None:
  """x's eval loss per round (mean over seeds), a panel per codec."""
  plt = plots.pyplot()
  fig, axes = plt.subplots(1, len(_CODECS), figsize=(12, 4.5), sharey=True)
  rows = [row for row in results["points"] if row["eval_loss"]["n"]]
  for ax, codec in zip(axes, _CODECS):
    for row in rows:
      if row["series"] != codec:
        continue
      steps, losses = plots.mean_curves(row, "eval_loss")
      mode = row["name"][:-len(codec) - 1]
      ax.plot(steps, losses, "--" if mode.endswith("m0.9") else "-",
              marker=".", label=mode)
    ax.set_title(f"{codec} pseudo-gradients")
    ax.set_xlabel("step")
    ax.set_ylim(top=3.2)  # the delay at momentum 0.9 climbs past 4
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("x's eval loss, mean over seeds")
  axes[-1].legend(fontsize=8)
  fig.suptitle(results["title"] + (" (quick)" if results["quick"] else "")
               + ": the delays score x before the mean in flight lands, "
               "eager the islands' average point", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


STUDY = study_lib.Study(
    name="overlaps",
    title="Overlapped communication: the loss it costs",
    claim=("Eager updates: overlapping a whole round costs ~1% eval loss "
           "(2.69 vs 2.67 at 500M) where the naive delay costs 13% (3.01) "
           "and 2% with a lowered outer lr (2.73); Streaming DiLoCo: "
           "overlapping tau steps and 4-bit floats cost little."),
    points=_points(),
    reference="none_int8",
    plot=_curves_by_codec,
    quick_points=("none_int8", "eager_int8"),
    report=utilization_report,
    # Eager from its first round: the warm-up is eager_warmup's study.
    base_overrides={"diloco.overlap_warmup_rounds": 0},
)

if __name__ == "__main__":
  study_lib.main(STUDY)
