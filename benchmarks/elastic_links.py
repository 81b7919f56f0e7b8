r"""Elastic islands behind shaped links: utilization against the network
model's star channel (root).

  sudo .venv/bin/python benchmarks/elastic_links.py \
      [--config=configs/tiny.py] [--mbit=10000,100,10] \
      [--extra_flags=--config.model.d_model=128,...] [--out=res.json]

Runs `python -m diloco_jax.elastic` with config.elastic.link_mbit at each
rate (elastic/island_nodes.py: each island a Ray node in a network
namespace of its own, its link to the coordinator shaped both ways with
tc's tbf), the whole run inside a loopback-only namespace of its own.
The first rate is the reference: fast enough that the link costs nothing
measurable, it gives the step time.

Per run: the steady round (the median time from one round's close to the
next, rounds 3 to R: round 1 holds the compiles); util, H x step / round, with the step time the reference
run's median seconds per step; what one island sent up per round (its
params through Ray, the summary's ray_bytes) and got back (x, as many
bytes in float32) and what crossed island 0's link both ways (the
bridge's end of its veth, per steady round); and the network model's
star round
(analysis/star_channel.star_timing: H steps, then the gather and the
broadcast at the link's rate; the coordinator's own link is not shaped,
so the islands' links set the pace) with its utilization and the error
of the measured round against it. Under the one-step delay the rounds
are pipelined (config.elastic.overlap_rounds): the model's round is then
the longer of the compute and the exchange.
"""

import json
import os
import pathlib
import sys

from absl import app
from absl import flags
import numpy as np

_REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO))
# pylint: disable=g-import-not-at-top,wrong-import-position
from diloco_jax.analysis import network_model as nm
from diloco_jax.analysis import star_channel
sys.path.insert(0, str(_REPO / "benchmarks"))
import elastic_run

_CONFIG = flags.DEFINE_string("config", "configs/tiny.py",
                              "The config file to run.")
_MBIT = flags.DEFINE_list("mbit", ["10000", "100", "10"],
                          "Link rates in Mbit/s; the first is the "
                          "reference.")
_EXTRA = flags.DEFINE_list(
    "extra_flags",
    ["--config.model.d_model=128", "--config.model.num_heads=4",
     "--config.model.head_dim=32", "--config.model.mlp_dim=512",
     "--config.model.num_layers=2", "--config.diloco.inner_steps=20",
     "--config.total_steps=120", "--config.eval.every_rounds=0"],
    "More --config.* flags for every run.")
_OUT = flags.DEFINE_string("out", None, "Write the rows as JSON here.")


def _run(mbit: float) -> dict:
  """One elastic run behind links of `mbit`: its records and summary."""
  return {"mbit": mbit, **elastic_run.run(
      f"links_{mbit:g}", _CONFIG.value,
      [f"--config.elastic.link_mbit={mbit}", *_EXTRA.value])}


def _step_seconds(run: dict) -> float:
  return float(np.median([s for r in run["records"][1:]
                          for s in r["seconds_per_step"].values()]))


def _row(run: dict, step_s: float, inner_steps: int) -> dict:
  records, islands = run["records"], len(run["records"][0]["members"])
  # A round's time from the close before it to its own (the coordinator's
  # step, evals and checkpoints in between count: pipelined islands train
  # through them, blocked ones wait).
  round_s = float(np.median([b["closed_at"] - a["closed_at"]
                             for a, b in zip(records[1:], records[2:])]))
  pipelined = bool(records[-1].get("pipelined"))
  up = run["summary"]["ray_bytes"] / (len(records) * islands)
  workload = nm.Workload(mode="diloco", islands=islands,
                         inner_steps=inner_steps, step_time_s=step_s,
                         sync_bytes=0.0)
  # The coordinator's own link (the bridge) is not shaped: the islands'
  # links set the pace.
  model = star_channel.star_timing(
      star_channel.Star(up, up, coordinator_bits_per_s=1e15), workload,
      nm.Link(run["mbit"] * 1e6))
  # Pipelined rounds (the one-step delay) hide the exchange behind the
  # next round's compute: a round takes the longer of the two.
  model_round_s = (max(model.compute_s, model.stall_s) if pipelined
                   else model.round_s)
  # What crossed island 0's link per steady round, both ways (the
  # bridge's end of its veth), against what the model sends.
  first, last = records[1]["link_bytes"]["0"], records[-1]["link_bytes"]["0"]
  link = sum(last[d] - first[d] for d in ("up", "down")) / (
      len(records) - 2)
  return {"mbit": run["mbit"], "pipelined": pipelined,
          "round_s": round(round_s, 3),
          "util": round(inner_steps * step_s / round_s, 3),
          "model_round_s": round(model_round_s, 3),
          "model_util": round(model.compute_s / model_round_s, 3),
          "error": round(round_s / model_round_s - 1, 3),
          "up_mb_per_round": round(up / 1e6, 3),
          "link_mb_per_round": round(link / 1e6, 3),
          "wall_s": round(run["wall_s"], 1),
          "final_eval_loss": run["summary"]["final_eval_loss"]}


def main(argv):
  del argv
  if os.geteuid() != 0:
    sys.exit("elastic_links.py shapes links with tc in namespaces of its "
             "own: run it as root")
  inner_steps = next(int(f.split("=")[1]) for f in _EXTRA.value
                     if f.startswith("--config.diloco.inner_steps="))
  runs = [_run(float(mbit)) for mbit in _MBIT.value]
  step_s = _step_seconds(runs[0])
  rows = [_row(run, step_s, inner_steps) for run in runs]
  print(f"step {step_s * 1e3:.1f} ms (the {runs[0]['mbit']:g} Mbit/s run's "
        f"median), H = {inner_steps}")
  print("| Mbit/s | round s | util | model round s | model util | err | "
        "up MB/round/island | link MB/round/island | wall s | final loss |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for row in rows:
    print(f"| {row['mbit']:g} | {row['round_s']} | {row['util']} | "
          f"{row['model_round_s']} | {row['model_util']} | "
          f"{row['error']:+.0%} | {row['up_mb_per_round']} | "
          f"{row['link_mb_per_round']} | {row['wall_s']} | "
          f"{row['final_eval_loss']:.4f} |")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump({"step_s": step_s, "rows": rows}, f, indent=2)


if __name__ == "__main__":
  app.run(main)
