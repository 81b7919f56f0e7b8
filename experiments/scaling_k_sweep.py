r"""Islands k against data parallel with k workers, in the compute-optimal
regime: how DiLoCo's gap to DDP moves with k and with the model's size.

  python -m experiments.scaling_k_sweep --scale=small|large [--seeds=3]

configs/scaling.py's token budget spent by k = 1, 2, 4 or 8 islands
(k islands take 4/k of the 4-island steps, so every point sees the same
tokens) at the regime's outer step, each against DDP with k workers on
the same steps and batches (k = 1: the single worker). The scaling-laws
study (arXiv 2503.09799): DiLoCo's loss gap to data parallel grows with M
and shrinks with model size; M = 1 is ahead of data parallel.

Full run, small: 8 points x 3 seeds; about an hour on 2 CPU cores.
"""

from configs import scaling
from experiments import plots
from experiments import study_lib

ISLANDS = (1, 2, 4, 8)


def _points(config):
  points = []
  for k in ISLANDS:
    steps = {"total_steps": scaling.steps_for(config, k)}
    # One DDP worker is the single worker (named so, to share its run).
    ddp = {"mode": "single"} if k == 1 else {"mode": "ddp",
                                              "diloco.islands": k}
    points.append(study_lib.Point(f"ddp_k{k}", {**ddp, **steps}, x=k,
                                  reference="ddp_k4", series="DDP"))
    points.append(study_lib.Point(
        f"diloco_k{k}", {"diloco.islands": k, **steps}, x=k,
        reference=f"ddp_k{k}", series="DiLoCo"))
  return tuple(points)


STUDY = study_lib.Study(
    name="scaling_k_sweep",
    title="DiLoCo with k islands against DDP with k workers",
    claim=("Scaling laws for DiLoCo: the gap to data parallel grows with "
           "M (M=4 +2.0% at 35M, +0.3% at 2.4B) and M=1 beats it."),
    points=_points,
    reference="ddp_k4",
    plot=plots.sweep_plot("islands / workers k", logx=True),
    quick_points=("ddp_k4", "ddp_k2", "diloco_k2"),
    base="scaling",
)

if __name__ == "__main__":
  study_lib.main(STUDY)
