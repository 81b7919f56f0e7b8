r"""Elastic islands of unequal speeds: compute used, wall time and loss (root).

  sudo .venv/bin/python benchmarks/elastic_speeds.py \
      [--config=configs/default.py] [--speeds=1,1,0.5,0.25] \
      [--extra_flags=--config.total_steps=120] [--out=res.json]

Runs `python -m diloco_jax.elastic` on the config, each run in a network
namespace of its own with loopback only (elastic_run.py; removed after the
run), its islands slowed by config.testing.island_speeds (each island's
inner steps take 1/speed as long, speeds.SpeedKnob):

  wait     rounds of H steps that wait for every island (the slowest sets
           each round's length).
  quorum   rounds of H steps that close once the islands but the slowest
           two have sent (config.elastic.min_islands = k - 2, no grace):
           the slow islands' results come late and are dropped.
  time     rounds budgeted in time (config.elastic.round_budget='time'):
           each island takes as many steps as fit in the fastest's H,
           weighted by its tokens.
  async    calls budgeted in time as 'time' budgets them, each result
           applied the moment it arrives (config.elastic.asynchronous):
           no island waits for a round.
  time_delay  'time' under the one-step delay (its measured outer
           step, lr 0.8, momentum 0), its rounds pipelined: each island's
           next call is sent while its round runs.
  equal    every island at the fastest's speed, config.total_steps set
           so that the run trains the tokens the 'time' run trained.
           (The 'wait' run computes what equal islands compute at the
           config's own steps: the knob slows, it changes no number.)

On one machine the islands share its cores, so each island's speed is
the knob's times what the others leave it: give speeds whose sum stays
well under the cores, so that the islands seldom step at once and their
ratios hold (on 2 cores, 0.1,0.1,0.05,0.025 for islands at 1, 1, 0.5
and 0.25 of the fastest: each computes a tenth of the time).

Per run the table gives: compute used, the island-steps whose work
reached x over those the islands could have run in the rounds' time
(island i: the rounds' seconds over its seconds per step measured in that
run, from metrics.jsonl; the time between rounds, the coordinator's step,
evals and checkpoints, is left out, and so is the first round, where the
islands compile their steps); the same with the island-steps run (the
quorum run's late results are run and dropped); busy, the share of the
wall time from round 1's close to the last round's the islands
spent in their calls' inner steps (each call's own setup included,
however slow its steps ran: the rest they waited); per island, its
calls' time over their steps at its median step time (stretch), and for
asynchronous runs the mean wait of a call at each hand-over; island-steps
run and applied; tokens trained (applied); wall s (the command's, Ray's start-up
and the compiles included); the final eval loss and its difference from
the 'equal' run's and from the 'wait' run's.
"""

import importlib.util
import json
import pathlib
import sys

from absl import app
from absl import flags
import numpy as np

_REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO / "benchmarks"))
import elastic_run  # pylint: disable=g-import-not-at-top,wrong-import-position

_CONFIG = flags.DEFINE_string("config", "configs/default.py",
                              "The config file to run.")
_SPEEDS = flags.DEFINE_string("speeds", "1,1,0.5,0.25",
                              "Each island's speed (its config.diloco.islands "
                              "is their count).")
_EXTRA = flags.DEFINE_list("extra_flags", [],
                           "More --config.* flags for every run.")
_OUT = flags.DEFINE_string("out", None, "Write the rows as JSON here.")
_RUNS = flags.DEFINE_list("runs", ["wait", "quorum", "time", "async",
                                   "time_delay", "equal"],
                          "Which runs ('equal' needs 'time').")


def _run(name: str, run_flags: list[str]) -> dict:
  """One elastic run in a namespace of its own: its records and summary."""
  return elastic_run.run(name, _CONFIG.value, [*_EXTRA.value, *run_flags])


def _row(run: dict, tokens_per_step: int, knob: list[float]) -> dict:
  """The table's figures of one run (`knob`: its islands' speeds)."""
  records = run["records"]
  # The first round compiles the islands' steps (but under 'time', whose
  # islands compile while timed before it): left out of compute used.
  timed = records[1:]
  round_seconds = sum(r["round_seconds"] for r in timed)
  # island -> its median seconds per step over the timed rounds.
  speed = {int(i): float(np.median([r["seconds_per_step"][i] for r in timed
                                    if i in r["seconds_per_step"]]))
           for i in records[-1]["seconds_per_step"]}
  # An island with no result to time (the quorum run's slow ones): the
  # fastest measured one's time, scaled by the knobs.
  fastest = min(speed, key=speed.get)
  for i, factor in enumerate(knob):
    speed.setdefault(i, speed[fastest] * knob[fastest] / factor)
  possible = sum(round_seconds / s for s in speed.values())
  run_steps = sum(r["island_steps"]["run"] for r in timed)
  applied = sum(r["island_steps"]["applied"] for r in records)
  # The same over the wall time from round 1's close to the last's (the
  # time between rounds counted: pipelined islands train through it,
  # blocked ones wait).
  wall = records[-1]["closed_at"] - records[0]["closed_at"]
  possible_wall = sum(wall / s for s in speed.values())
  # Busy: the share of the wall time the islands spent in their inner
  # steps (each call's start to its steps' end, the call's own setup
  # included), however long the steps took; the rest they waited.
  begin, end = records[0]["closed_at"], records[-1]["closed_at"]
  calls = [c for r in timed for c in _calls(r)]
  # Each call's time within the timed wall (calls that began in round 1
  # cut at its close).
  trained = sum(max(0.0, min(c["trained_at"], end)
                    - max(c["started_at"], begin)) for c in calls)
  # Stretch: island -> its calls' time over their steps at its median
  # step time (above 1: its steps ran slower than their median, or the
  # call's own setup took time; neither is waiting).
  stretch = {i: sum(c["trained_at"] - c["started_at"] for c in mine)
                / sum(c["steps"] * speed[i] for c in mine)
             for i in speed
             if (mine := [c for c in calls if c["island"] == i])}
  return {"run": run["name"],
          "busy": trained / ((end - begin) * len(knob)),
          "stretch": stretch,
          # Asynchronous calls: mean milliseconds from a call's last step
          # to its result at the coordinator, to the result applied, and
          # to the island's next call begun.
          "call_waits_ms": _call_waits_ms(
              [a for r in timed for a in r.get("arrivals", [])]),
          "compute_used": sum(r["island_steps"]["applied"]
                              for r in timed) / possible,
          "compute_used_wall": sum(r["island_steps"]["applied"]
                                   for r in timed) / possible_wall,
          "compute_run": run_steps / possible,
          "seconds_per_step": speed,
          "island_steps_run": sum(r["island_steps"]["run"] for r in records),
          "island_steps_applied": applied,
          "tokens": applied * tokens_per_step,
          "round_seconds": round(round_seconds, 1),
          "wall_s": round(run["wall_s"], 1),
          "final_eval_loss": run["summary"]["final_eval_loss"]}


def _calls(record: dict) -> list[dict]:
  """A round's calls that trained (island, steps, started_at, trained_at):
  its asynchronous arrivals, or each island's call of the round."""
  if record.get("asynchronous"):
    return record["arrivals"]
  return [{"island": int(i), "steps": record["steps_taken"][i],
           "started_at": record["started_at"][i], "trained_at": t}
          for i, t in record.get("trained_at", {}).items()
          if t is not None]


def _call_waits_ms(arrivals: list[dict]) -> dict | None:
  """The mean milliseconds asynchronous calls waited: their result on its
  way ('to_coordinator'), being applied ('applied'), and the island's
  next call to begin after it ('next_call'); None for rounds."""
  if not arrivals:
    return None
  by_island = {}
  for a in sorted(arrivals, key=lambda a: a["started_at"]):
    by_island.setdefault(a["island"], []).append(a)
  gaps = [b["started_at"] - a["applied_at"] for mine in by_island.values()
          for a, b in zip(mine, mine[1:])]
  mean_ms = lambda values: round(1000 * float(np.mean(values)), 1)
  return {"to_coordinator": mean_ms([a["arrived_at"] - a["trained_at"]
                                     for a in arrivals]),
          "applied": mean_ms([a["applied_at"] - a["arrived_at"]
                              for a in arrivals]),
          "next_call": mean_ms(gaps), "calls": len(arrivals)}


def main(argv):
  del argv
  speeds = _SPEEDS.value
  islands = len(speeds.split(","))
  sys.path.insert(0, str(_REPO))
  spec = importlib.util.spec_from_file_location("config",
                                                _REPO / _CONFIG.value)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  for flag in _EXTRA.value:  # the token count of a step, as the runs see it
    name, value = flag.removeprefix("--config.").split("=", 1)
    if name in ("data.batch_size", "data.sequence_length",
                "diloco.inner_steps"):
      section, leaf = name.split(".")
      config[section][leaf] = int(value)
  tokens_per_step = config.data.batch_size * config.data.sequence_length
  common = [f"--config.diloco.islands={islands}"]
  slowed = [*common, f"--config.testing.island_speeds={speeds}"]
  slowed_runs = {
      "wait": slowed,
      "quorum": [*slowed, f"--config.elastic.min_islands={max(1, islands - 2)}",
                 "--config.elastic.grace_seconds=0"],
      "time": [*slowed, "--config.elastic.round_budget=time"],
      # Time-budgeted calls, each result applied as it arrives: no round
      # waits for anyone.
      "async": [*slowed, "--config.elastic.round_budget=time",
                "--config.elastic.asynchronous=true"],
      # Time-budgeted and pipelined: the one-step delay at its measured
      # outer step, each island's next call sent while its round runs.
      "time_delay": [*slowed, "--config.elastic.round_budget=time",
                     "--config.diloco.overlap=one_step_delay",
                     "--config.diloco.outer_optimizer.learning_rate=0.8",
                     "--config.diloco.outer_optimizer.momentum=0.0"]}
  knob = [float(s) for s in speeds.split(",")]
  rows = [_row(_run(name, run_flags), tokens_per_step, knob)
          for name, run_flags in slowed_runs.items() if name in _RUNS.value]
  by_name = {row["run"]: row for row in rows}
  if "equal" in _RUNS.value and "time" in by_name:
    # The equal islands train the 'time' run's tokens: total steps of k
    # islands at H each, whole rounds, all at the fastest's speed.
    inner_steps = config.diloco.inner_steps
    total_steps = inner_steps * max(1, round(
        by_name["time"]["tokens"]
        / (tokens_per_step * islands * inner_steps)))
    fastest = max(knob)
    rows.append(_row(_run("equal", [
        *common, "--config.testing.island_speeds="
        + ",".join([f"{fastest:g}"] * islands),
        f"--config.total_steps={total_steps}"]), tokens_per_step,
                     [fastest] * islands))
  _print(rows)


def _print(rows) -> None:
  """The table (and --out)."""
  losses = {row["run"]: row["final_eval_loss"] for row in rows}
  print(f"{'run':10} {'used':>6} {'wall':>6} {'busy':>6} {'run':>6} "
        f"{'steps run':>9} "
        f"{'applied':>8} {'tokens':>9} {'rounds s':>9} {'wall s':>7} "
        f"{'eval loss':>9} {'vs equal':>8} {'vs wait':>8}")
  for row in rows:
    versus = {name: (row["final_eval_loss"] / losses[name] - 1
                     if name in losses else None)
              for name in ("equal", "wait")}
    row.update(loss_vs_equal=versus["equal"], loss_vs_wait=versus["wait"])
    shown = {name: "" if v is None else f"{v:+.2%}"
             for name, v in versus.items()}
    print(f"{row['run']:10} {row['compute_used']:6.3f} "
          f"{row['compute_used_wall']:6.3f} {row['busy']:6.3f} "
          f"{row['compute_run']:6.3f} "
          f"{row['island_steps_run']:9d} {row['island_steps_applied']:8d} "
          f"{row['tokens']:9d} {row['round_seconds']:9.1f} "
          f"{row['wall_s']:7.1f} {row['final_eval_loss']:9.4f} "
          f"{shown['equal']:>8} {shown['wait']:>8}")
  for row in rows:
    print(f"{row['run']:10} stretch per island: "
          + " ".join(f"{i}: {v:.2f}" for i, v in sorted(
              row["stretch"].items()))
          + (f"; waits per call (ms): {row['call_waits_ms']}"
             if row["call_waits_ms"] else ""))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  app.run(main)
