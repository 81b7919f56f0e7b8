r"""SparseLoCo against DiLoCo in fp32 and int8 and against DDP: loss and
bytes, in the compute-optimal regime.

  python -m experiments.sparseloco --scale=small|large [--seeds=3]

configs/scaling.py with 4 islands: DiLoCo (outer Nesterov) in fp32 and
int8, DDP, and SparseLoCo (error feedback as the momentum, beta 0.95,
alpha 1, chunks of 4096, 2-bit values) at 1%, 2%, 3% and 10% density. The
paper (512M model): at 1-3% density and 2 bits SparseLoCo beats fp32
DiLoCo's loss while sending orders of magnitude fewer bytes.

Full run, small: 7 points x 3 seeds; about 45 minutes on 2 CPU cores.
"""

from experiments import plots
from experiments import study_lib

_SPARSELOCO = {"diloco.outer_optimizer.name": "sparseloco"}

STUDY = study_lib.Study(
    name="sparseloco",
    title="SparseLoCo: loss against bytes sent",
    claim=("SparseLoCo: 1-3% density in 2 bits with error feedback as the "
           "momentum beats full-precision DiLoCo."),
    points=(
        study_lib.Point("fp32", {}),
        study_lib.Point("int8", {"diloco.codec": "int8"}),
        study_lib.Point("ddp", {"mode": "ddp"}),
    ) + tuple(
        study_lib.Point(f"sparseloco_{density:.0%}",
                        {**_SPARSELOCO,
                         "diloco.sparseloco.density": density})
        for density in (0.01, 0.02, 0.03, 0.1))
    + (study_lib.Point("sparseloco_2%_beta0.5",
                       {**_SPARSELOCO, "diloco.sparseloco.beta": 0.5}),),
    reference="fp32",
    plot=plots.pareto_plot,
    quick_points=("fp32", "sparseloco_2%"),
    base="scaling",
)

if __name__ == "__main__":
  study_lib.main(STUDY)
