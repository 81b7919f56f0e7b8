"""Today's SPMD path under elastic_goodput.py's failure schedule: the whole
job SIGKILLed at each failure's moment, then the same command run again.

`python -m diloco_jax.main` runs every island in one program, so one
island's death ends them all: each kill is a SIGKILL of the job's process
group, and rerunning the command resumes from the newest checkpoint in
WORKDIR/checkpoints (saved every round here). The moments are the elastic
run's:

  island i in round r  the elastic island dies before inner step d of the
                       round, d drawn from np.random.default_rng([seed, i,
                       r]) as diloco_jax/elastic/driver.py draws it; the job
                       is killed once it has recorded global step
                       (r-1)*H + d.
  coordinator round C  the job is killed once the checkpoint of step C*H is
                       finalized (WORKDIR/checkpoints/C*H exists).

Each kill happens once, in the first command that reaches its moment after
its own first step (a command resumed past a moment is killed after that
step). How precise: a step's record reaches metrics.jsonl once the next
step is queued and its own metrics are fetched, and the file's tail is read
every 20 ms, so the job dies a step or two after its moment; each kill says
the step its command had recorded when it died. Checkpoints are saved in
the background (config.checkpoint.async_save), so a kill before the newest
one is finalized resumes from the one before it, as a real failure would.

Goodput: the steps of the final model's history (total_steps, on every
island) over the steps the commands ran (each from the step it resumed from
to the last step it recorded), the same count on every island. The steps in
flight at a kill (at most two) are not counted as run, which flatters the
SPMD rows slightly. Wall time: from the first command's start to the last
one's end, each rerun's start-up and compile included.
"""

import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import time

import numpy as np

# What main logs (run/loop.py, run/train.py): a command's first step is done
# (metrics.jsonl no longer holds an earlier command's records past its
# start), and the checkpoint it resumed from.
_FIRST_STEP_DONE = "first inner step done"
_RESUMED = re.compile(r"resuming from the checkpoint at step (\d+)")
_POLL_S = 0.02


@dataclasses.dataclass(frozen=True)
class Kill:
  """One SIGKILL of the whole job.

  Attributes:
    step: the global step of its moment.
    at_checkpoint: at the finalized checkpoint of `step`, not at its record.
    what: the elastic failure it stands for.
  """
  step: int
  at_checkpoint: bool
  what: str


def kills(island_kills: list[tuple[int, int]], coordinator_round: int, *,
          seed: int, inner_steps: int, total_steps: int) -> list[Kill]:
  """The moments of the elastic schedule (ISLAND, ROUND pairs; the round
  after which the coordinator dies, 0: never), in the order they come."""
  moments = []
  for island, round_number in island_kills:
    first = (round_number - 1) * inner_steps
    steps = min(inner_steps, total_steps - first)
    drawn = int(np.random.default_rng([seed, island, round_number]).integers(
        inner_steps))
    # As the elastic island does: a short last round dies at its last step.
    moments.append(Kill(first + min(drawn, steps - 1), False,
                        f"island {island} in round {round_number}"))
  if coordinator_round:
    moments.append(Kill(min(coordinator_round * inner_steps, total_steps),
                        True, f"coordinator after round {coordinator_round}"))
  return sorted(moments, key=lambda k: (k.step, k.at_checkpoint))


def last_recorded_step(metrics: pathlib.Path) -> int:
  """The step of metrics.jsonl's last whole record (0: none). Only the
  file's tail is read: the watcher reads it every 20 ms."""
  try:
    with open(metrics, "rb") as f:
      f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
      lines = f.read().decode(errors="replace").splitlines()
  except FileNotFoundError:
    return 0
  for line in reversed(lines):
    try:
      return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
      continue  # a torn last line, or the tail's cut first one
  return 0


def _reached(kill: Kill, process: subprocess.Popen, log: pathlib.Path,
             workdir: pathlib.Path) -> bool:
  """Waits until the command reaches `kill`'s moment (True) or ends
  (False)."""
  saved = workdir / "checkpoints" / str(kill.step)
  started = False
  while process.poll() is None:
    started = started or _FIRST_STEP_DONE in log.read_text(errors="replace")
    metrics = workdir / "metrics.jsonl"
    if started and (saved.is_dir() if kill.at_checkpoint
                    else last_recorded_step(metrics) >= kill.step):
      return True
    time.sleep(_POLL_S)
  return False


def run(name: str, command: list[str], workdir: pathlib.Path,
        moments: list[Kill], total_steps: int, env: dict) -> dict:
  """Runs `command` (whose --workdir is `workdir`), killed at each of
  `moments` and run again; returns the row. Each command's output goes to
  WORKDIR.logs/commandN.txt."""
  logs = workdir.with_name(workdir.name + ".logs")
  logs.mkdir(parents=True)
  pending = list(moments)
  commands = []  # per command: the steps it ran, and the kill that ended it
  start = time.monotonic()
  while True:
    log = logs / f"command{len(commands)}.txt"
    with open(log, "w") as out:
      process = subprocess.Popen(command, env=env, stdout=out,
                                 stderr=subprocess.STDOUT,
                                 start_new_session=True)
    kill = pending[0] if pending else None
    try:
      killed = kill is not None and _reached(kill, process, log, workdir)
      if not killed:
        process.wait()
    finally:  # the benchmark stopped: the job is not left running
      if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)  # every island at once
    if killed:
      pending.pop(0)
    process.wait()
    text = log.read_text(errors="replace")
    if not killed and process.returncode:
      raise SystemExit(f"{name}: command {len(commands)} exit "
                       f"{process.returncode}\n{text[-3000:]}")
    resumed = _RESUMED.search(text)
    commands.append({
        "from_step": int(resumed.group(1)) if resumed else 0,
        "to_step": (last_recorded_step(workdir / "metrics.jsonl") if killed
                    else total_steps),
        "kill": kill.what if killed else None,
        "kill_step": kill.step if killed else None})
    if not killed:
      break
  wall = time.monotonic() - start
  unreached = [k for k in pending if k.step < total_steps]
  if unreached:  # the watcher missed a moment the run went through
    raise SystemExit(f"{name}: the run ended before the kill of "
                     f"{unreached[0].what} at step {unreached[0].step}")
  summary = json.loads((workdir / "summary.json").read_text())
  ran = sum(c["to_step"] - c["from_step"] for c in commands)
  return {"run": name, "goodput": total_steps / ran,
          "wall_s": round(wall, 1),
          "final_eval_loss": summary["final_eval_loss"],
          "rounds": summary["rounds"], "steps_run": ran,
          "commands": commands,
          "kills_not_reached": [k.what for k in pending]}


def describe(row: dict) -> str:
  """The table's last column: each kill, as 'at step T: ran to E, rerun
  from S'."""
  commands = row["commands"]
  said = [f"step {c['kill_step']}: ran to {c['to_step']}, rerun from "
          f"{after['from_step']}" for c, after in zip(commands, commands[1:])]
  said += [f"{what}: not reached" for what in row["kills_not_reached"]]
  return "; ".join(said) or "no kills"
