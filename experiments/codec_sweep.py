r"""Trains the default config once per codec and prints what each one costs.

  python -m experiments.codec_sweep [--runs=runs] [--only=int8,topk_ef]

Each variant is a normal training run (`python -m diloco_jax.main`) in
RUNS/codec_<variant>; a finished run is not repeated (rerunning its command
returns its summary), so the sweep can be stopped and restarted. The table
gives each codec's final eval loss against fp32's, the bytes one island sent
in total, and the compression against fp32 DiLoCo and against DDP.
"""

import json
import os
import subprocess
import sys

from absl import app
from absl import flags

_RUNS = flags.DEFINE_string("runs", "runs", "Where the runs' workdirs go.")
_CONFIG = flags.DEFINE_string("config", "configs/default.py", "Base config.")
_ONLY = flags.DEFINE_list("only", [], "Variants to run (default: all).")

_NO_MOMENTUM = ["--config.diloco.outer_optimizer.name=sgd",
                "--config.diloco.outer_optimizer.learning_rate=1.0"]

# variant -> flags on top of the base config
VARIANTS = {
    "fp32": [],
    "bf16": ["--config.diloco.codec=bf16"],
    "fp16": ["--config.diloco.codec=fp16"],
    "int8": ["--config.diloco.codec=int8"],
    "int4": ["--config.diloco.codec=int4"],
    "int4_ef": ["--config.diloco.codec=int4",
                "--config.diloco.error_feedback=true"],
    # The structured codecs' vectors and small tensors go through the
    # fallback codec.
    "sign_prune": ["--config.diloco.codec=sign_prune",
                   "--config.diloco.fallback_codec=int8"],
    # Top-k and low rank with error feedback diverge under outer momentum
    # (refused): they run under plain averaging. SparseLoCo makes the
    # residual the momentum instead.
    "topk_ef": ["--config.diloco.codec=topk",
                "--config.diloco.fallback_codec=int8",
                "--config.diloco.error_feedback=true", *_NO_MOMENTUM],
    "topk2_ef": ["--config.diloco.codec=topk",
                 "--config.diloco.topk_fraction=0.02",
                 "--config.diloco.fallback_codec=int8",
                 "--config.diloco.error_feedback=true", *_NO_MOMENTUM],
    "lowrank_ef": ["--config.diloco.codec=lowrank",
                   "--config.diloco.fallback_codec=int8",
                   "--config.diloco.error_feedback=true", *_NO_MOMENTUM],
    "sparseloco": ["--config.diloco.outer_optimizer.name=sparseloco"],
    "sparseloco1": ["--config.diloco.outer_optimizer.name=sparseloco",
                    "--config.diloco.sparseloco.density=0.01"],
    # The schema's adaptive settings: ranks 16..64, int4 factors, 90% of
    # the energy; 128 x 128 matrices are too small to factor at rank 64
    # and go through the int4 fallback.
    "adaptive_r64_int4_ef": ["--config.diloco.codec=adaptive_lowrank",
                             "--config.diloco.error_feedback=true",
                             "--config.diloco.fallback_codec=int4",
                             "--config.diloco.lowrank.min_rank=16",
                             "--config.diloco.lowrank.max_rank=64",
                             "--config.diloco.lowrank.factor_codec=int4",
                             "--config.diloco.lowrank.energy_fraction=0.9"],
    # Smaller ranks: more compression, more loss.
    "adaptive_r48_int4_ef": ["--config.diloco.codec=adaptive_lowrank",
                             "--config.diloco.error_feedback=true",
                             "--config.diloco.fallback_codec=int8",
                             "--config.diloco.lowrank.min_rank=8",
                             "--config.diloco.lowrank.max_rank=48",
                             "--config.diloco.lowrank.factor_codec=int4",
                             "--config.diloco.lowrank.energy_fraction=0.9"],
    "adaptive_r16_int8_ef": ["--config.diloco.codec=adaptive_lowrank",
                             "--config.diloco.error_feedback=true",
                             "--config.diloco.fallback_codec=int8",
                             "--config.diloco.lowrank.min_rank=2",
                             "--config.diloco.lowrank.max_rank=16",
                             "--config.diloco.lowrank.energy_fraction=0.5",
                             "--config.diloco.lowrank.factor_codec=int8"],
}


def _mean_rank(workdir: str) -> str:
  ranks = []
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      record = json.loads(line)
      if "codec_mean_rank" in record:
        ranks.append(record["codec_mean_rank"])
  return f"{sum(ranks) / len(ranks):.1f}" if ranks else "-"


def main(argv):
  del argv
  names = _ONLY.value or list(VARIANTS)
  unknown = sorted(set(names) - set(VARIANTS))
  if unknown:
    sys.exit(f"error: unknown variants {unknown}; known: {list(VARIANTS)}")
  summaries = {}
  for name in ["fp32"] + [n for n in names if n != "fp32"]:
    workdir = os.path.join(_RUNS.value, f"codec_{name}")
    command = [sys.executable, "-m", "diloco_jax.main",
               f"--config={_CONFIG.value}", f"--workdir={workdir}",
               *VARIANTS[name]]
    print("$", " ".join(command[1:]), flush=True)
    with open(workdir + ".log", "a") as log:
      subprocess.run(command, check=True, stdout=log, stderr=log)
    with open(os.path.join(workdir, "summary.json")) as f:
      summaries[name] = json.load(f)
  base = summaries["fp32"]["final_eval_loss"]
  print("\n| codec | final eval loss | vs fp32 | sent per island | "
        "compression vs fp32 | vs DDP | mean rank |")
  print("|---|---|---|---|---|---|---|")
  for name, s in summaries.items():
    loss = s["final_eval_loss"]
    print(f"| {name} | {loss:.4f} | {100 * (loss / base - 1):+.2f}% | "
          f"{s['comm_bytes'] / 1e6:.2f} MB | {s['compression_vs_fp32']:.2f}x"
          f" | {s['compression_vs_ddp']:.0f}x | "
          f"{_mean_rank(os.path.join(_RUNS.value, f'codec_{name}'))} |")


if __name__ == "__main__":
  app.run(main)
