r"""The outer params against the islands' plain average.

  python -m experiments.outer_vs_island_mean [--seeds=3] [--quick]

Every DiLoCo round evaluates both the outer (global) params after the outer
step and, with config.eval.island_mean, the plain average of the island
params just before it (what FedAvg would serve). Streaming DiLoCo found the outer params evaluate
better. Two outer optimizers: Nesterov (lr 0.7, momentum 0.9), where the
two differ, and SGD with lr 1, where they must be equal (a check).

Full run: 2 points x 3 seeds; the runs take 6 minutes on 2 CPU cores.
"""

from experiments import plots
from experiments import study_lib

STUDY = study_lib.Study(
    name="outer_vs_island_mean",
    title="Outer params against the islands' average",
    claim=("Streaming DiLoCo: evaluating the outer (global) params beats "
           "evaluating the replicas."),
    points=(study_lib.Point("nesterov", {}),
            study_lib.Point("sgd_lr1", {
                "diloco.outer_optimizer.name": "sgd",
                "diloco.outer_optimizer.learning_rate": 1.0})),
    reference="nesterov",
    base_overrides={"eval.island_mean": True},
    plot=plots.curves_plot({"eval_loss": "outer params",
                            "eval_loss_island_mean": "islands' mean"}),
)

if __name__ == "__main__":
  study_lib.main(STUDY)
