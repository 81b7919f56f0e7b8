r"""Eager updates against no overlap over twice the seeds: what the overlap
costs, with its spread across seeds.

  python -m experiments.eager_seeds [--seeds=6] [--quick]

DiLoCo with 4 islands and H=25 after the shared pretraining (configs/
study.py), without overlap (outer Nesterov lr 0.7, momentum 0.9) and with
eager updates at their defaults (each island's whole round at once, lr 0.5,
momentum 0.7, set here as the values they are so that the runs are
eager_own_weight's and overlaps' own), paired by seed. The other studies
run 3 seeds, where one seed moves the mean of a paired change by about a
point; this one runs 6.

Full run: 2 points x 6 seeds; the runs take about 18 minutes on 2 CPU
cores (6 with the other studies' first 3 seeds already run).
"""

from diloco_jax.config import overlap_defaults
from experiments import plots
from experiments import study_lib

_EAGER_LR, _EAGER_MOMENTUM = overlap_defaults.NESTEROV_DEFAULTS["eager"]

STUDY = study_lib.Study(
    name="eager_seeds",
    title="Eager updates against no overlap, 6 seeds",
    claim=("Eager updates cost ~1% loss against no overlap at 500M-1B "
           "(2.69 against 2.67)."),
    points=(study_lib.Point("none", {}),
            study_lib.Point("eager", {
                "diloco.overlap": "eager",
                "diloco.outer_optimizer.learning_rate": _EAGER_LR,
                "diloco.outer_optimizer.momentum": _EAGER_MOMENTUM})),
    reference="none",
    plot=plots.curves_plot({"eval_loss": ""}),
    seeds=6,
)

if __name__ == "__main__":
  study_lib.main(STUDY)
