r"""Prints a markdown table comparing finished runs from their summary.json.

  for m in diloco single ddp; do
    python -m diloco_jax.main --config=configs/default.py \
        --workdir=runs/default_$m --config.mode=$m
  done
  python experiments/compare_runs.py runs/default_diloco runs/default_single \
      runs/default_ddp
"""

import json
import os
import sys

COLUMNS = (
    ("run", lambda s, d: os.path.basename(os.path.normpath(d))),
    ("mode", lambda s, d: s["mode"]),
    ("islands", lambda s, d: s["islands"]),
    ("H", lambda s, d: s["inner_steps"] if s["mode"] == "diloco" else "-"),
    ("codec", lambda s, d: s.get("codec", "fp32")),
    ("tokens", lambda s, d: f"{s['tokens_seen'] / 1e6:.2f}M"),
    ("eval loss", lambda s, d: f"{s['final_eval_loss']:.4f}"),
    ("bits/byte", lambda s, d: (f"{s['final_eval_bits_per_byte']:.3f}"
                                if "final_eval_bits_per_byte" in s else "-")),
    ("sent per island", lambda s, d: f"{s['comm_bytes'] / 1e6:.1f} MB"),
    ("DDP would send", lambda s, d: f"{s['ddp_comm_bytes'] / 1e6:.1f} MB"),
    ("train s", lambda s, d: f"{s['train_s']:.0f}"),
    ("tokens/s", lambda s, d: f"{s['tokens_per_s']:,.0f}"),
)


def main(workdirs):
  if not workdirs:
    sys.exit(__doc__)
  rows = []
  for workdir in workdirs:
    path = os.path.join(workdir, "summary.json")
    if not os.path.exists(path):
      sys.exit(f"error: {path} not found (run not finished?)")
    with open(path) as f:
      summary = json.load(f)
    rows.append([str(fn(summary, workdir)) for _, fn in COLUMNS])
  print("| " + " | ".join(name for name, _ in COLUMNS) + " |")
  print("|" + "---|" * len(COLUMNS))
  for row in rows:
    print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
  main(sys.argv[1:])
