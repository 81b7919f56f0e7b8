r"""Overlapped communication in the compute-optimal regime: what hiding a
round or a fragment's sync costs over many rounds.

  python -m experiments.scaling_overlaps --scale=small|large [--seeds=3]

configs/scaling.py (4 islands, H=10, 73 rounds at the small scale; outer
averaging, lr 1, momentum 0, the regime's tuned step) without overlap,
with eager updates (an own weight of 1 at its own outer step, lr 0.5,
momentum 0.7; of 0.5; and the paper's, the island's share), with
the rebasing one-step delay, and as Streaming DiLoCo (2 fragments, tau 5,
alpha 0.5). The eager-updates paper: eager costs ~1% loss at 500M-1B
with H=30 over many rounds, where the naive delay costs 13%.

Full run, small: 6 points x 3 seeds; about 45 minutes on 2 CPU cores.
"""

from diloco_jax.config import overlap_defaults
from experiments import plots
from experiments import study_lib

_EAGER_LR, _EAGER_MOMENTUM = overlap_defaults.NESTEROV_DEFAULTS["eager"]

STUDY = study_lib.Study(
    name="scaling_overlaps",
    title="Overlaps over many rounds",
    claim=("Eager updates: overlapping a whole round costs ~1% loss (the "
           "naive delay 13%); Streaming DiLoCo's overlap costs little."),
    points=(
        study_lib.Point("none", {}),
        # Eager wants a smaller lr and more momentum than averaging: its
        # default step, set here since the regime's base config sets
        # averaging.
        study_lib.Point("eager", {
            "diloco.overlap": "eager",
            "diloco.outer_optimizer.learning_rate": _EAGER_LR,
            "diloco.outer_optimizer.momentum": _EAGER_MOMENTUM}),
        study_lib.Point("eager_own0.5", {"diloco.overlap": "eager",
                                         "diloco.eager_own_weight": 0.5}),
        study_lib.Point("eager_share", {"diloco.overlap": "eager_share"}),
        study_lib.Point("rebase", {"diloco.overlap": "one_step_delay_rebase"}),
        study_lib.Point("streaming", {"diloco.fragments": 2,
                                      "diloco.fragment_delay": 5,
                                      "diloco.fragment_alpha": 0.5}),
    ),
    reference="none",
    plot=plots.bars_and_curves_plot,
    quick_points=("none", "eager"),
    base="scaling",
    # Eager from the first round, as these runs were measured.
    base_overrides={"diloco.overlap_warmup_rounds": 0},
)

if __name__ == "__main__":
  study_lib.main(STUDY)
