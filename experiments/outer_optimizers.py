r"""Outer optimizers: Nesterov (learning rate x momentum), SGD, Adam.

  python -m experiments.outer_optimizers [--seeds=3] [--quick]

DiLoCo with 4 islands after the shared pretraining, each outer optimizer on
the same pseudo-gradients: Nesterov at learning rates 0.3, 0.7, 1.0 with
momentum 0.9 and lr 0.7 with momentum 0.5; plain SGD with lr 1 (FedAvg:
parameter averaging); Adam (lr 0.01) with the large eps the paper needed
(0.1) and with the usual 1e-8, and Adam with eps 0.1 at lr 0.07 (with eps
far above the pseudo-gradients' size, Adam's step is about lr / eps times
the pseudo-gradient, so this matches SGD at lr 0.7). The paper: Nesterov
is best; FedAvg and Adam are worse, Adam unstable unless eps is about 0.1.

Full run: 8 points x 3 seeds; the runs take 22 minutes on 2 CPU cores.
"""

from experiments import plots
from experiments import study_lib


def _outer(name, **fields):
  return {"diloco.outer_optimizer.name": name,
          **{f"diloco.outer_optimizer.{k}": v for k, v in fields.items()}}


STUDY = study_lib.Study(
    name="outer_optimizers",
    title="Outer optimizers",
    claim=("DiLoCo paper: outer Nesterov is best; SGD (FedAvg) and Adam are "
           "worse, Adam unstable until eps ~ 0.1."),
    points=(
        study_lib.Point("nesterov_lr0.7_m0.9",
                        _outer("nesterov", learning_rate=0.7, momentum=0.9)),
        study_lib.Point("nesterov_lr0.3_m0.9",
                        _outer("nesterov", learning_rate=0.3, momentum=0.9)),
        study_lib.Point("nesterov_lr1.0_m0.9",
                        _outer("nesterov", learning_rate=1.0, momentum=0.9)),
        study_lib.Point("nesterov_lr0.7_m0.5",
                        _outer("nesterov", learning_rate=0.7, momentum=0.5)),
        study_lib.Point("sgd_lr1_fedavg", _outer("sgd", learning_rate=1.0)),
        study_lib.Point("adam_eps0.1",
                        _outer("adam", learning_rate=0.01, eps=0.1)),
        study_lib.Point("adam_eps1e-8",
                        _outer("adam", learning_rate=0.01, eps=1e-8)),
        # With eps = 0.1 far above |pseudo-gradient|, Adam's step is about
        # lr / eps x the pseudo-gradient: lr 0.07 matches SGD's 0.7.
        study_lib.Point("adam_eps0.1_lr0.07",
                        _outer("adam", learning_rate=0.07, eps=0.1)),
    ),
    reference="nesterov_lr0.7_m0.9",
    plot=plots.bar_plot,
    quick_points=("nesterov_lr0.7_m0.9", "adam_eps1e-8"),
)

if __name__ == "__main__":
  study_lib.main(STUDY)
