r"""One run's islands in one process against N processes (the launcher).

  python benchmarks/multiprocess_benchmark.py [--processes=4] \
      [--config=configs/default.py] [--workdir=runs/multiprocess_benchmark]

Trains `--config` twice, from scratch, with the same islands: once as one
process, once over `--processes` local CPU processes through
`python -m diloco_jax.launch` (jax.distributed, gloo collectives between
the processes). Prints a markdown table: tokens/s (training only, from each
summary), wall-clock from launch to exit, and final eval loss. The losses
should agree up to float summation order (the cross-island all-reduce adds
islands in another order across processes). Run the two one after the
other on an otherwise idle machine: they share its cores.
"""

import json
import os
import shutil
import subprocess
import sys
import time

from absl import app
from absl import flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROCESSES = flags.DEFINE_integer("processes", 4, "Processes of the run.")
_CONFIG = flags.DEFINE_string("config", "configs/default.py",
                              "The config both runs train.")
_WORKDIR = flags.DEFINE_string(
    "workdir", "runs/multiprocess_benchmark",
    "Parent of the two runs' workdirs (emptied first).")


def _train(command: list[str], workdir: str) -> tuple[dict, float]:
  start = time.perf_counter()
  subprocess.run(command, cwd=_REPO, check=True,
                 env={**os.environ, "PYTHONPATH": _REPO},
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  wall = time.perf_counter() - start
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f), wall


def main(argv):
  del argv
  root = os.path.abspath(_WORKDIR.value)
  shutil.rmtree(root, ignore_errors=True)
  flags_of = lambda workdir: [f"--config={_CONFIG.value}",
                              f"--workdir={workdir}"]
  one, many = os.path.join(root, "one"), os.path.join(root, "many")
  rows = [("1 process", *_train(
      [sys.executable, "-m", "diloco_jax.main", *flags_of(one)], one))]
  rows.append((f"{_PROCESSES.value} processes (launch)", *_train(
      [sys.executable, "-m", "diloco_jax.launch",
       f"--processes={_PROCESSES.value}", "--", *flags_of(many)], many)))
  print(f"{_CONFIG.value}: {rows[0][1]['islands']} islands, "
        f"{rows[0][1]['total_steps']} steps\n")
  print("| run | tokens/s | wall-clock (s) | final eval loss |")
  print("|---|---|---|---|")
  for name, summary, wall in rows:
    print(f"| {name} | {summary['tokens_per_s']:,.0f} | {wall:.1f} | "
          f"{summary['final_eval_loss']:.6f} |")
  ratio = rows[1][1]["tokens_per_s"] / rows[0][1]["tokens_per_s"]
  print(f"\n{_PROCESSES.value} processes / 1 process tokens/s: {ratio:.2f}x")


if __name__ == "__main__":
  app.run(main)
