r"""Eager updates: how much of its own fresh pseudo-gradient an island
applies while the islands' mean is in flight.

  python -m experiments.eager_own_weight [--seeds=3] [--quick]

DiLoCo with 4 islands and H=25 after the shared pretraining (configs/
study.py), without overlap (the reference, outer Nesterov lr 0.7,
momentum 0.9) and with eager updates at own weights from the island's
share of the mean (the paper's, 1/4 here; overlap='eager_share') through
0.5, 0.75 and 0.9 to 1 (its whole round at once, as the rebasing delay
does; 'eager' unless config.diloco.eager_own_weight says otherwise), each
at a few outer steps between outer averaging (lr 1, momentum 0, the
share's default) and lr 0.4, momentum 0.8, finer around the best. A
small weight keeps the islands' points together but leaves most of the
round's progress a round late; a weight of 1 leaves nothing late when the
islands agree but lets each drift from the others for a round.

Full run: 18 points x 3 seeds; the runs take about 65 minutes on 2 CPU
cores.
"""

from experiments import plots
from experiments import study_lib

# (own weight, outer lr, outer momentum); None: the island's share.
POINTS = ((None, 1.0, 0.0), (0.5, 1.0, 0.0), (0.5, 0.7, 0.5),
          (0.5, 0.5, 0.7), (0.75, 0.7, 0.5), (0.75, 0.5, 0.7),
          (1.0, 1.0, 0.0), (1.0, 0.7, 0.5), (1.0, 0.8, 0.5), (1.0, 0.5, 0.7),
          (1.0, 0.4, 0.8),
          # A finer look around the best of the points above.
          (0.9, 0.5, 0.7), (0.9, 0.6, 0.6), (1.0, 0.5, 0.6), (1.0, 0.6, 0.6),
          (1.0, 0.6, 0.7), (1.0, 0.5, 0.8))


def _point(own_weight, lr: float, momentum: float) -> study_lib.Point:
  name = "share" if own_weight is None else f"own{own_weight}"
  rule = ({"diloco.overlap": "eager_share"} if own_weight is None else
          {"diloco.overlap": "eager", "diloco.eager_own_weight": own_weight})
  return study_lib.Point(
      f"eager_{name}_lr{lr}_m{momentum}",
      {**rule, "diloco.outer_optimizer.learning_rate": lr,
       "diloco.outer_optimizer.momentum": momentum},
      x=0.25 if own_weight is None else own_weight,
      series=f"lr {lr}, momentum {momentum}")


STUDY = study_lib.Study(
    name="eager_own_weight",
    title="Eager updates: the weight of an island's own pseudo-gradient",
    claim=("Eager updates (the island's share of the mean applied at once, "
           "the others' a round late) cost ~1% loss at 500M-1B over many "
           "rounds."),
    points=(study_lib.Point("none_lr0.7_m0.9", {}),) + tuple(
        _point(*p) for p in POINTS),
    reference="none_lr0.7_m0.9",
    plot=plots.sweep_plot("own weight (0.25: the island's share, 4 islands)",
                         versus_reference=True),
    quick_points=("none_lr0.7_m0.9", "eager_own0.5_lr0.7_m0.5"),
    # The rule from the first round: the warm-up is eager_warmup's study.
    base_overrides={"diloco.overlap_warmup_rounds": 0},
)

if __name__ == "__main__":
  study_lib.main(STUDY)
