r"""Eager updates' warm-up: how many rounds at the start wait for their own
mean before the overlap begins, what each costs against no overlap, and
what it takes from the overlap's utilization.

  python -m experiments.eager_warmup [--seeds=6] [--quick]

DiLoCo with 4 islands and H=25 after the shared pretraining (configs/
study.py), without overlap (outer Nesterov lr 0.7, momentum 0.9) and with
eager updates at their outer step (each island's whole round at once, lr
0.5, momentum 0.7, set here as the values they are so that the runs are
eager_own_weight's and overlaps' own) after 0, 1, 2 (the default: `eager`)
or 3 warm-up rounds (config.diloco.overlap_warmup_rounds), paired by seed.
Six seeds: over three, one seed moves the mean of a paired change by
about a point.

Below the table, each point's utilization at 10 Mbit/s from the network
model, of a steady round and over the run's 12 rounds, where the warm-up
rounds wait as rounds without overlap do.

Full run: 5 points x 6 seeds; the runs take about 35 minutes on 2 CPU
cores.
"""

from diloco_jax.config import overlap_defaults
from experiments import overlaps
from experiments import plots
from experiments import study_lib

_EAGER_LR, _EAGER_MOMENTUM = overlap_defaults.NESTEROV_DEFAULTS["eager"]
_EAGER = {"diloco.overlap": "eager",
          "diloco.outer_optimizer.learning_rate": _EAGER_LR,
          "diloco.outer_optimizer.momentum": _EAGER_MOMENTUM}
_DEFAULT_WARMUP = overlap_defaults.WARMUP_ROUNDS_DEFAULTS["eager"]


def _eager_point(warmup: int) -> study_lib.Point:
  if warmup == _DEFAULT_WARMUP:  # the mode as a user gets it
    return study_lib.Point("eager", _EAGER, x=warmup)
  return study_lib.Point(f"eager_warmup{warmup}", {
      **_EAGER, "diloco.overlap_warmup_rounds": warmup}, x=warmup)


STUDY = study_lib.Study(
    name="eager_warmup",
    title="Eager updates after 0-3 warm-up rounds against no overlap",
    claim=("Eager updates cost ~1% loss against no overlap at 500M-1B "
           "(2.69 against 2.67); at 35M, 3.62 against 3.54."),
    points=(study_lib.Point("none", {}),
            *(_eager_point(warmup) for warmup in range(4))),
    reference="none",
    plot=plots.curves_plot({"eval_loss": ""}),
    quick_points=("none", "eager"),
    report=overlaps.utilization_report,
    seeds=6,
)

if __name__ == "__main__":
  study_lib.main(STUDY)
