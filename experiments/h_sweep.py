r"""The number of inner steps H: communication against quality.

  python -m experiments.h_sweep [--seeds=3] [--quick]

DiLoCo with 4 islands after 100 pretraining steps; the 300 steps that follow
are split into rounds of H = 5, 10, 25, 50 or 100 steps (60 to 3 rounds).
The paper: going from H=50 to H=1000 costs about 2.9% perplexity while
sending 20x less.

Full run: 5 points x 3 seeds; the runs take 14 minutes on 2 CPU cores.
"""

from experiments import plots
from experiments import study_lib

STUDY = study_lib.Study(
    name="h_sweep",
    title="Inner steps per round H",
    claim=("DiLoCo paper: H=1000 costs about 2.9% perplexity against H=50 "
           "while communicating 20x less."),
    points=tuple(study_lib.Point(f"H={h}", {"diloco.inner_steps": h}, x=h)
                 for h in (5, 10, 25, 50, 100)),
    reference="H=25",
    plot=plots.sweep_plot("H (inner steps per round)", logx=True),
    quick_points=("H=5", "H=25"),
)

if __name__ == "__main__":
  study_lib.main(STUDY)
