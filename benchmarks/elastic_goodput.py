r"""Elastic islands under injected failures: goodput, wall time, loss (root).

  sudo .venv/bin/python benchmarks/elastic_goodput.py \
      [--config=configs/default.py] [--kill_every=5] [--straggler_round=0] \
      [--straggler_seconds=30] [--coordinator_round=0] [--min_islands=0] \
      [--grace_seconds=0] [--extra_flags=--config.total_steps=120] \
      [--out=res.json]

Runs `python -m diloco_jax.elastic` on the config twice, each in a network
namespace of its own with loopback only (Ray binds there; the namespace and
every process left in it are removed after each run):

  failure-free  no failure injected.
  failures      every --kill_every rounds (rounds N, 2N, ...) one island,
                drawn from --seed, SIGKILLs its own process at a step of
                that round drawn from the run's seed (Ray restarts it);
                with --straggler_round R, island 0 sleeps
                --straggler_seconds before round R; with
                --coordinator_round C, every process of the run (the
                coordinator's, Ray's, the islands') is SIGKILLed once round
                C is checkpointed and the same command is run again.

Per run the table gives: goodput, the island-steps whose work reached x
over the island-steps the rounds ran (from metrics.jsonl, over both
commands when the coordinator was killed, counting the round in flight at
its death as run and lost); wall s, from the first command's start to the
last one's end (Ray's start-up and the islands' compiles included); the
final eval loss and its difference from the failure-free run; the rounds
each island missed.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

from absl import app
from absl import flags
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import netns  # pylint: disable=g-import-not-at-top,wrong-import-position

REPO = pathlib.Path(__file__).resolve().parents[1]

_CONFIG = flags.DEFINE_string("config", "configs/default.py", "The config.")
_KILL_EVERY = flags.DEFINE_integer(
    "kill_every", 5, "Kill an island every N rounds (0: never).")
_STRAGGLER_ROUND = flags.DEFINE_integer(
    "straggler_round", 0, "Island 0 sleeps before this round (0: never).")
_STRAGGLER_SECONDS = flags.DEFINE_float("straggler_seconds", 30.0,
                                        "How long the straggler sleeps.")
_COORDINATOR_ROUND = flags.DEFINE_integer(
    "coordinator_round", 0, "Kill every process once this round is "
    "checkpointed, then rerun (0: never).")
_MIN_ISLANDS = flags.DEFINE_integer("min_islands", 0,
                                    "config.elastic.min_islands.")
_GRACE = flags.DEFINE_float("grace_seconds", 0.0,
                            "config.elastic.grace_seconds.")
_EXTRA = flags.DEFINE_list("extra_flags", [],
                           "More diloco_jax.elastic flags, for both runs.")
_SEED = flags.DEFINE_integer("seed", 0, "Which island each kill hits.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/elastic_goodput",
                               "Where the runs write (emptied first).")
_OUT = flags.DEFINE_string("out", None, "Write the rows as JSON here.")


def _command(namespace, workdir, flags_):
  return namespace.command(
      sys.executable, "-m", "diloco_jax.elastic",
      f"--config={REPO / _CONFIG.value}", f"--workdir={workdir}",
      f"--config.elastic.min_islands={_MIN_ISLANDS.value}",
      f"--config.elastic.grace_seconds={_GRACE.value}", *_EXTRA.value,
      *flags_)


def _run(name: str, flags_: list[str], coordinator_round: int) -> dict:
  """One run (two commands when the coordinator is killed); its row."""
  workdir = pathlib.Path(_WORKDIR.value) / name
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  start = time.monotonic()
  killed_in_flight = 0
  with netns.LoopbackNamespace() as namespace:
    command = _command(namespace, workdir, flags_)
    if coordinator_round:
      first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
      saved = workdir / "coordinator" / str(coordinator_round)
      while not saved.exists() and first.poll() is None:
        time.sleep(0.05)
      namespace.kill_everything()
      first.wait()
      killed_in_flight = 1
    done = subprocess.run(command, env=env, capture_output=True, text=True)
  if done.returncode:
    raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
  wall = time.monotonic() - start
  records = [json.loads(line) for line in
             (workdir / "metrics.jsonl").read_text().splitlines()]
  summary = json.loads((workdir / "summary.json").read_text())
  islands = len(records[0]["included"])
  steps = [r["step"] - (records[i - 1]["step"] if i else 0)
           for i, r in enumerate(records)]
  contributed = sum(sum(r["included"]) * n for r, n in zip(records, steps))
  ran = islands * (sum(steps) + killed_in_flight * max(steps))
  missed = [[r["round"] for r in records if not r["included"][i]]
            for i in range(islands)]
  return {"run": name, "goodput": contributed / ran,
          "wall_s": round(wall, 1),
          "final_eval_loss": summary["final_eval_loss"],
          "rounds": len(records), "missed_rounds": missed}


def _failure_flags(islands: int, rounds: int) -> list[str]:
  flags_ = []
  if _KILL_EVERY.value:
    rng = np.random.default_rng(_SEED.value)
    kills = [f"{int(rng.integers(islands))}@{r}"
             for r in range(_KILL_EVERY.value, rounds + 1, _KILL_EVERY.value)]
    if kills:
      flags_.append(f"--config.testing.kill_island={','.join(kills)}")
  if _STRAGGLER_ROUND.value:
    flags_ += [f"--config.testing.slow_island=0@{_STRAGGLER_ROUND.value}",
               f"--config.testing.slow_seconds={_STRAGGLER_SECONDS.value}"]
  return flags_


def _islands_and_rounds() -> tuple[int, int]:
  """The config's islands and rounds, as the runs will read them."""
  probe = subprocess.run(
      [sys.executable, "-c",
       "import sys; from ml_collections import config_flags; "
       "from absl import flags; "
       "c = config_flags.DEFINE_config_file('config'); "
       "flags.FLAGS(sys.argv[:1] + sys.argv[1:]); c = c.value; "
       "print(c.diloco.islands, -(-c.total_steps // c.diloco.inner_steps))",
       f"--config={REPO / _CONFIG.value}",
       *[f for f in _EXTRA.value if f.startswith("--config.")]],
      env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
      text=True, check=True)
  islands, rounds = probe.stdout.split()
  return int(islands), int(rounds)


def main(argv):
  del argv
  if os.geteuid() != 0:
    raise SystemExit("needs root (ip netns); run it with sudo")
  subprocess.run(["rm", "-rf", _WORKDIR.value], check=True)
  islands, rounds = _islands_and_rounds()
  rows = [_run("failure-free", [], 0),
          _run("failures", _failure_flags(islands, rounds),
               _COORDINATOR_ROUND.value)]
  base = rows[0]["final_eval_loss"]
  print(f"{islands} islands, {rounds} rounds, {_CONFIG.value} "
        f"{' '.join(_EXTRA.value)}")
  print(f"{'run':<14}{'goodput':>9}{'wall s':>9}{'eval loss':>11}"
        f"{'vs free':>9}  missed rounds per island")
  for row in rows:
    row["vs_failure_free"] = row["final_eval_loss"] / base - 1
    print(f"{row['run']:<14}{row['goodput']:>9.3f}{row['wall_s']:>9.1f}"
          f"{row['final_eval_loss']:>11.4f}{row['vs_failure_free']:>+9.2%}"
          f"  {row['missed_rounds']}")
  if _OUT.value:
    pathlib.Path(_OUT.value).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
  app.run(main)
