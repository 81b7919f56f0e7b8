r"""DiLoCo's Table 2 in the compute-optimal regime, at two scales.

  python -m experiments.scaling_table2 --scale=small|large [--seeds=3]

configs/scaling.py: every run from scratch on 20 tokens per parameter,
the same tokens and the same warmup + cosine schedule shape (over each
run's own steps) for every point:
- `single`: one worker, an island's batch, 4x the steps;
- `ddp` / `ddp_lr2x` / `ddp_lr4x`: 4 workers all-reduce gradients every
  step (4x the batch), at the islands' peak inner learning rate and at
  twice and 4x it (its larger batch may take a larger one; the best is
  DDP's tuned result);
- `diloco`: 4 islands, H=10, outer Nesterov at the config's defaults;
- `diloco_k1`: one island on the single worker's batch and steps, with
  the outer step (the DiLoCo paper: it beats `single`).
The papers: DiLoCo (8 workers) ahead of data parallel at 8x batch; the
scaling-laws study: M=4 within +2.0% eval loss of data parallel at 35M,
+0.3% at 2.4B, and M=1 ahead of data parallel.

Full run, small: 6 points x 3 seeds; about 40 minutes on 2 CPU cores.
"""

from configs import scaling
from experiments import plots
from experiments import study_lib


def _points(config):
  single_steps = scaling.steps_for(config, 1)
  lr = config.inner_optimizer.learning_rate
  return (
      study_lib.Point("single", {"mode": "single",
                                 "total_steps": single_steps}),
      study_lib.Point("ddp", {"mode": "ddp"}),
      study_lib.Point("ddp_lr2x", {"mode": "ddp",
                                   "inner_optimizer.learning_rate": 2 * lr}),
      study_lib.Point("ddp_lr4x", {"mode": "ddp",
                                   "inner_optimizer.learning_rate": 4 * lr}),
      study_lib.Point("diloco", {}),
      study_lib.Point("diloco_k1", {"diloco.islands": 1,
                                    "total_steps": single_steps}),
  )


STUDY = study_lib.Study(
    name="scaling_table2",
    title="Table 2 at 20 tokens per parameter",
    claim=("Scaling laws for DiLoCo: M=4 within +2.0% eval loss of data "
           "parallel at 35M, +0.3% at 2.4B; M=1 ahead of data parallel."),
    points=_points,
    reference="ddp",
    plot=plots.bars_and_curves_plot,
    quick_points=("ddp", "diloco", "diloco_k1"),
    base="scaling",
)

if __name__ == "__main__":
  study_lib.main(STUDY)
