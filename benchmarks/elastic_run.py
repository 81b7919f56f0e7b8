"""One `python -m diloco_jax.elastic` run for the elastic benchmarks
(elastic_speeds.py, elastic_links.py): in a loopback-only network
namespace of its own (removed after), its records and summary read back."""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from diloco_jax.elastic import netns

_REPO = pathlib.Path(__file__).resolve().parents[1]


def run(name: str, config: str, flags: list[str]) -> dict:
  """The run of `config` (a path under the repository) with `flags`:
  {"name", "records", "summary", "wall_s"}; RuntimeError with its log's
  end if it fails."""
  workdir = tempfile.mkdtemp(prefix=f"elastic_{name}_")
  with netns.LoopbackNamespace() as namespace:
    command = namespace.command(
        sys.executable, "-m", "diloco_jax.elastic",
        f"--config={_REPO / config}", f"--workdir={workdir}", *flags)
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(_REPO)})
    wall = time.monotonic() - started
    namespace.kill_everything()
  if done.returncode:
    raise RuntimeError(f"{name}: exit {done.returncode}\n"
                       f"{done.stderr[-3000:]}")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  return {"name": name, "records": records, "summary": summary,
          "wall_s": wall}
