r"""Elastic islands under injected failures: goodput, wall time, loss (root).

  sudo .venv/bin/python benchmarks/elastic_goodput.py \
      [--config=configs/default.py] [--kill_every=5] [--straggler_round=0] \
      [--straggler_seconds=30] [--coordinator_round=0] [--min_islands=0] \
      [--grace_seconds=0] [--straggler_every=0] [--stale_rounds=0,1] \
      [--extra_flags=--config.total_steps=120] [--spmd=true] [--out=res.json]

Runs `python -m diloco_jax.elastic` on the config twice, each in a network
namespace of its own with loopback only (Ray binds there; the namespace and
every process left in it are removed after each run):

  elastic failure-free  no failure injected.
  elastic failures      every --kill_every rounds (rounds N, 2N, ...) one
                        island, drawn from --seed, SIGKILLs its own process
                        at a step of that round drawn from the run's seed
                        (Ray restarts it); with --straggler_round R, island
                        0 sleeps --straggler_seconds before round R (and
                        with --straggler_every N an island drawn from
                        --seed before rounds N - N // 2, then every N); with
                        --coordinator_round C, every process of the run
                        (the coordinator's, Ray's, the islands') is
                        SIGKILLed once round C is checkpointed and the same
                        command is run again. With several
                        --stale_rounds, one such run per value (late
                        results dropped at 0, applied within N rounds).

With --spmd (the default) it then runs today's SPMD path, `python -m
diloco_jax.main` with the same config and --config.* flags (less the
elastic ones) and a checkpoint every round, twice (spmd_restarts.py; no
namespace: it starts no server):

  spmd failure-free     no failure injected.
  spmd failures         the whole job SIGKILLed at each moment of the
                        elastic schedule (an island's death ends every
                        island of an SPMD job; the coordinator's maps to
                        one more kill once round C's checkpoint is
                        finalized), and the same command run again, resuming
                        from its newest checkpoint. The straggler is not
                        injected: main has no hook for it (the whole job
                        would wait for it).

Per run the table gives: goodput, the island-steps whose work reached x
over the island-steps run (elastic: from metrics.jsonl, over both commands
when the coordinator was killed, counting the round in flight at its death
as run and lost; SPMD: the run's steps over the steps its commands ran,
each from its checkpoint to its kill); wall s, from the first command's
start to the last one's end (Ray's start-up, the islands' compiles, each
SPMD rerun's start-up and compile included); the final eval loss and its
difference from the run's own failure-free run and from the elastic
failure-free run; the rounds each elastic island missed, or each SPMD
kill's step, the step its command had reached and the step it was rerun
from.
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
# pylint: disable=g-import-not-at-top,wrong-import-position
import netns
import spmd_restarts
# pylint: enable=g-import-not-at-top,wrong-import-position

REPO = pathlib.Path(__file__).resolve().parents[1]

_CONFIG = flags.DEFINE_string("config", "configs/default.py", "The config.")
_KILL_EVERY = flags.DEFINE_integer(
    "kill_every", 5, "Kill an island every N rounds (0: never).")
_STRAGGLER_ROUND = flags.DEFINE_integer(
    "straggler_round", 0, "Island 0 sleeps before this round (0: never).")
_STRAGGLER_SECONDS = flags.DEFINE_float("straggler_seconds", 30.0,
                                        "How long the straggler sleeps.")
_STRAGGLER_EVERY = flags.DEFINE_integer(
    "straggler_every", 0, "Every N rounds (from round N - N // 2 on) an "
    "island drawn from --seed sleeps --straggler_seconds (0: never).")
_STALE = flags.DEFINE_list(
    "stale_rounds", ["0"], "config.elastic.stale_rounds of the failures "
    "run; several values: one failures run per value.")
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
_SPMD = flags.DEFINE_bool(
    "spmd", True, "Also run the SPMD path (diloco_jax.main), killed whole at "
    "the same moments and rerun from its checkpoints.")
_OUT = flags.DEFINE_string("out", None, "Write the rows as JSON here.")


def _command(namespace, workdir, flags_):
  return namespace.command(
      sys.executable, "-m", "diloco_jax.elastic",
      f"--config={REPO / _CONFIG.value}", f"--workdir={workdir}",
      f"--config.elastic.min_islands={_MIN_ISLANDS.value}",
      f"--config.elastic.grace_seconds={_GRACE.value}", *_EXTRA.value,
      *flags_)


def _run(name: str, flags_: list[str], coordinator_round: int) -> dict:
  """One elastic run (two commands when the coordinator is killed); its
  row."""
  workdir = pathlib.Path(_WORKDIR.value) / name.replace(" ", "-")
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
  contributed = sum(r["island_steps"]["applied"] for r in records)
  ran = (sum(r["island_steps"]["run"] for r in records)
         + killed_in_flight * max(r["island_steps"]["run"] for r in records))
  missed = [[r["round"] for r in records if not r["included"][i]]
            for i in range(islands)]
  return {"run": name, "goodput": contributed / ran,
          "wall_s": round(wall, 1),
          "final_eval_loss": summary["final_eval_loss"],
          "rounds": len(records), "missed_rounds": missed}


def _island_kills(islands: int, rounds: int) -> list[tuple[int, int]]:
  """(island, round) of each kill: rounds N, 2N, ..., islands from --seed."""
  if not _KILL_EVERY.value:
    return []
  rng = np.random.default_rng(_SEED.value)
  return [(int(rng.integers(islands)), r)
          for r in range(_KILL_EVERY.value, rounds + 1, _KILL_EVERY.value)]


def _failure_flags(islands: int, rounds: int) -> list[str]:
  flags_ = []
  kills = [f"{i}@{r}" for i, r in _island_kills(islands, rounds)]
  if kills:
    flags_.append(f"--config.testing.kill_island={','.join(kills)}")
  slow = [f"0@{_STRAGGLER_ROUND.value}"] if _STRAGGLER_ROUND.value else []
  every = _STRAGGLER_EVERY.value
  if every:
    rng = np.random.default_rng([_SEED.value, 1])
    slow += [f"{int(rng.integers(islands))}@{r}"
             for r in range(every - every // 2, rounds + 1, every)]
  if slow:
    flags_ += [f"--config.testing.slow_island={','.join(slow)}",
               f"--config.testing.slow_seconds={_STRAGGLER_SECONDS.value}"]
  return flags_


def _spmd_rows(shape: dict) -> list[dict]:
  """The SPMD path's runs: failure-free, then killed whole at the elastic
  failures' moments (spmd_restarts.py)."""
  # main's flags: the config's, less the elastic islands' own.
  main_flags = [f for f in _EXTRA.value if f.startswith("--config.")
                  and not f.startswith(("--config.elastic.",
                                        "--config.testing.kill_island",
                                        "--config.testing.slow_"))]
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  moments = spmd_restarts.kills(
      _island_kills(shape["islands"], shape["rounds"]),
      _COORDINATOR_ROUND.value, seed=shape["seed"],
      inner_steps=shape["inner_steps"], total_steps=shape["total_steps"])
  rows = []
  for name, kills in (("spmd failure-free", []), ("spmd failures", moments)):
    workdir = pathlib.Path(_WORKDIR.value) / name.replace(" ", "-")
    command = [sys.executable, "-m", "diloco_jax.main",
               f"--config={REPO / _CONFIG.value}", f"--workdir={workdir}",
               *main_flags,
               # What a user who expects failures sets (the last one wins).
               "--config.checkpoint.every_rounds=1"]
    rows.append(spmd_restarts.run(name, command, workdir, kills,
                                  shape["total_steps"], env))
  return rows


def _shape() -> dict:
  """The config's islands, rounds, seed, H and steps, as the runs will read
  them."""
  probe = subprocess.run(
      [sys.executable, "-c",
       "import sys; from ml_collections import config_flags; "
       "from absl import flags; "
       "c = config_flags.DEFINE_config_file('config'); "
       "flags.FLAGS(sys.argv[:1] + sys.argv[1:]); c = c.value; "
       "print(c.diloco.islands, -(-c.total_steps // c.diloco.inner_steps), "
       "c.seed, c.diloco.inner_steps, c.total_steps)",
       f"--config={REPO / _CONFIG.value}",
       *[f for f in _EXTRA.value if f.startswith("--config.")]],
      env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
      text=True, check=True)
  return dict(zip(("islands", "rounds", "seed", "inner_steps", "total_steps"),
                  map(int, probe.stdout.split())))


def main(argv):
  del argv
  if os.geteuid() != 0:
    raise SystemExit("needs root (ip netns); run it with sudo")
  subprocess.run(["rm", "-rf", _WORKDIR.value], check=True)
  shape = _shape()
  islands, rounds = shape["islands"], shape["rounds"]
  rows = [_run("elastic failure-free", [], 0)]
  for stale in _STALE.value:
    name = ("elastic failures" if len(_STALE.value) == 1
            else f"elastic failures stale {stale}")
    rows.append(_run(name, [*_failure_flags(islands, rounds),
                            f"--config.elastic.stale_rounds={stale}"],
                     _COORDINATOR_ROUND.value))
  if _SPMD.value:
    rows += _spmd_rows(shape)
  print(f"{islands} islands, {rounds} rounds, {_CONFIG.value} "
        f"{' '.join(_EXTRA.value)}")
  if _SPMD.value and (_STRAGGLER_ROUND.value or _STRAGGLER_EVERY.value):
    print("spmd failures: the straggler is not injected (main has no hook)")
  print(f"{'run':<22}{'goodput':>9}{'wall s':>9}{'eval loss':>11}"
        f"{'vs own free':>13}{'vs elastic free':>17}  missed rounds per "
        "island (elastic) or kills (spmd)")
  for row in rows:
    # Each run against its own path's failure-free run.
    own = next(r for r in rows if r["run"] == (
        "spmd failure-free" if row["run"].startswith("spmd")
        else "elastic failure-free"))
    row["vs_failure_free"] = (row["final_eval_loss"]
                              / own["final_eval_loss"] - 1)
    row["vs_elastic_failure_free"] = (row["final_eval_loss"]
                                      / rows[0]["final_eval_loss"] - 1)
    said = (spmd_restarts.describe(row) if "commands" in row
            else str(row["missed_rounds"]))
    print(f"{row['run']:<22}{row['goodput']:>9.3f}{row['wall_s']:>9.1f}"
          f"{row['final_eval_loss']:>11.4f}{row['vs_failure_free']:>+13.2%}"
          f"{row['vs_elastic_failure_free']:>+17.2%}  {said}")
  if _OUT.value:
    pathlib.Path(_OUT.value).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
  app.run(main)
