r"""The outer step tuned per configuration, and the inner state kept or
reset, in the compute-optimal regime.

  python -m experiments.scaling_outer --scale=small|large [--seeds=3]

configs/scaling.py's DiLoCo with 1, 4 and 8 islands (the tokens of 4
islands, so 1 island takes 4x the steps and 8 half), outer Nesterov at
learning rates 0.4 to 1.0 with momentum 0.9, and momentum 0.8 at lr 0.8;
at 8 and 2 islands plain averaging (lr 1, momentum 0) and its
neighbours (lr 0.8 and 1.2 at momentum 0, lr 1 at momentum 0.3); then 4
islands with every island's inner optimizer state reset each round
(config.diloco.inner_state='reset') at two outer steps. The
scaling-laws study found the best outer learning rate growing with the
islands: ~0.4 at M=1, ~0.6 at M=2-4, ~0.8 at M=8.

Full run, small: 32 points x 3 seeds; about 4 hours on 2 CPU cores.
"""

from configs import scaling
from experiments import plots
from experiments import study_lib

# (outer lr, momentum): DiLoCo's Nesterov 0.9 at the scaling-laws study's
# rates (and momentum 0.8), and plain averaging (lr 1, momentum 0; the
# regime's default) with its neighbours.
_NESTEROV = tuple((lr, 0.9) for lr in (0.4, 0.6, 0.8, 1.0)) + ((0.8, 0.8),)
_AVERAGING = ((0.8, 0.0), (1.0, 0.0), (1.2, 0.0), (1.0, 0.3))
_OUTER_STEPS = {  # per island count
    4: _NESTEROV + ((1.0, 0.5), (0.7, 0.5)) + _AVERAGING,
    1: _NESTEROV + ((1.0, 0.3),),
    8: _NESTEROV + _AVERAGING,
    2: _AVERAGING,
}


def _point(k: int, steps: int, lr: float, momentum: float,
           reset: bool = False):
  overrides = {"diloco.islands": k, "total_steps": steps,
               "diloco.outer_optimizer.learning_rate": lr,
               "diloco.outer_optimizer.momentum": momentum}
  if reset:
    overrides["diloco.inner_state"] = "reset"
  return study_lib.Point(
      f"k{k}_lr{lr}" + ("" if momentum == 0.9 else f"_m{momentum}")
      + ("_reset" if reset else ""), overrides,
      x=None if reset else lr,
      series=f"k={k}, momentum {momentum}")


def _points(config):
  points = []
  for k, outer_steps in _OUTER_STEPS.items():
    steps = scaling.steps_for(config, k)
    points += [_point(k, steps, lr, momentum) for lr, momentum in outer_steps]
  # The inner state reset every round at 4 islands, at DiLoCo's outer step
  # and at plain averaging.
  steps = scaling.steps_for(config, 4)
  points += [_point(4, steps, 0.7, 0.9, reset=True),
             _point(4, steps, 1.0, 0.0, reset=True)]
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
