r"""The outer step tuned per configuration, and the inner state kept or
reset, in the compute-optimal regime.

  python -m experiments.scaling_outer --scale=small|large [--seeds=3]

configs/scaling.py's DiLoCo with 1, 4 and 8 islands (the tokens of 4
islands, so 1 island takes 4x the steps and 8 half), outer Nesterov at
learning rates 0.4 to 1.0 with momentum 0.9, and momentum 0.8 at lr 0.8;
then the best 4-island setting with every island's inner optimizer
state reset each round (config.diloco.inner_state='reset'). The
scaling-laws study found the best outer learning rate growing with the
islands: ~0.4 at M=1, ~0.6 at M=2-4, ~0.8 at M=8.

Full run, small: 16 points x 3 seeds; about 100 minutes on 2 CPU cores.
"""

from configs import scaling
from experiments import plots
from experiments import study_lib

_RATES = (0.4, 0.6, 0.8, 1.0)


def _points(config):
  points = []
  for k in (1, 4, 8):
    steps = scaling.steps_for(config, k)
    for lr in _RATES:
      points.append(study_lib.Point(
          f"k{k}_lr{lr}", {"diloco.islands": k, "total_steps": steps,
                           "diloco.outer_optimizer.learning_rate": lr,
                           "diloco.outer_optimizer.momentum": 0.9},
          x=lr, series=f"k={k}, momentum 0.9"))
    points.append(study_lib.Point(
        f"k{k}_lr0.8_m0.8", {"diloco.islands": k, "total_steps": steps,
                             "diloco.outer_optimizer.learning_rate": 0.8,
                             "diloco.outer_optimizer.momentum": 0.8},
        x=0.8, series=f"k={k}, momentum 0.8"))
  points.append(study_lib.Point("k4_inner_reset",
                                {"diloco.inner_state": "reset"}))
  return tuple(points)


STUDY = study_lib.Study(
    name="scaling_outer",
    title="Outer learning rate and momentum per island count",
    claim=("Scaling laws for DiLoCo: the best outer learning rate grows "
           "with M: ~0.4 at M=1, ~0.6 at M=2-4, ~0.8 at M=8."),
    points=_points,
    reference="k4_lr0.6",
    plot=plots.sweep_plot("outer learning rate"),
    quick_points=("k4_lr0.6",),
    base="scaling",
)

if __name__ == "__main__":
  study_lib.main(STUDY)
