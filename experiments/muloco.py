r"""MuLoCo: Muon inside the islands against AdamW, in the compute-optimal
regime.

  python -m experiments.muloco --scale=small|large [--seeds=3]

configs/scaling.py with 1 and 4 islands (1 island on 4x the steps, the
same tokens), inner AdamW or Muon (config.inner_optimizer.name; Muon on
the blocks' matrices at AdamW's RMS, AdamW on the rest), and the single
worker and DDP beside them. MuLoCo found Muon inside ahead of AdamW inside
at every worker count, and with one worker ahead of data parallel.

Full run, small: 6 points x 3 seeds; about 45 minutes on 2 CPU cores.
"""

from configs import scaling
from experiments import plots
from experiments import study_lib

_MUON = {"inner_optimizer.name": "muon"}


def _points(config):
  one = {"diloco.islands": 1, "total_steps": scaling.steps_for(config, 1)}
  return (
      study_lib.Point("diloco_k4_adamw", {}),
      study_lib.Point("diloco_k4_muon", _MUON, reference="diloco_k4_adamw"),
      study_lib.Point("diloco_k1_adamw", one),
      study_lib.Point("diloco_k1_muon", {**one, **_MUON},
                      reference="diloco_k1_adamw"),
      study_lib.Point("ddp_adamw", {"mode": "ddp"}),
      study_lib.Point("ddp_muon", {"mode": "ddp", **_MUON},
                      reference="ddp_adamw"),
  )


STUDY = study_lib.Study(
    name="muloco",
    title="Muon inside (MuLoCo) against AdamW inside",
    claim=("MuLoCo: DiLoCo with Muon inside beats DiLoCo with AdamW at "
           "every worker count, and with one worker data parallel."),
    points=_points,
    reference="diloco_k4_adamw",
    plot=plots.bars_and_curves_plot,
    quick_points=("diloco_k4_adamw", "diloco_k4_muon"),
    base="scaling",
)

if __name__ == "__main__":
  study_lib.main(STUDY)
