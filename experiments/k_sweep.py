r"""The number of islands k: more islands, more compute, diminishing gains.

  python -m experiments.k_sweep [--seeds=3] [--quick]

DiLoCo with k = 1, 2, 4, 8 or 16 islands (H=25, per-island batch fixed, so
k islands process k times the tokens) after the shared pretraining. The
paper (Table 3, iid): perplexity 16.23 with 1 worker, 15.23 with 4, 15.08
with 8, 15.02 with 16, 14.95 with 64: the gains level off. k=1 is DiLoCo
with one island (the paper: it beats the plain single worker).

Full run: 5 points x 3 seeds; the runs take 23 minutes on 2 CPU cores.
"""

from experiments import plots
from experiments import study_lib

STUDY = study_lib.Study(
    name="k_sweep",
    title="Islands k",
    claim=("DiLoCo paper (Table 3): 1 worker 16.23, 4: 15.23, 8: 15.08, "
           "16: 15.02, 64: 14.95 perplexity; gains level off."),
    points=tuple(study_lib.Point(f"k={k}", {"diloco.islands": k}, x=k)
                 for k in (1, 2, 4, 8, 16)),
    reference="k=1",
    plot=plots.sweep_plot("islands k", logx=True),
    quick_points=("k=1", "k=2"),
)

if __name__ == "__main__":
  study_lib.main(STUDY)
