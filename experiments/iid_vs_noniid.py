r"""IID islands against non-iid islands (each its own k-means cluster).

  python -m experiments.iid_vs_noniid [--seeds=3] [--quick]

DiLoCo with 4 islands after the shared pretraining. `non_iid` gives each
island the documents of one k-means cluster of the corpus (cheap n-gram
features), with the clusters' boundaries moved so that each holds a quarter
of the tokens (`clustered_balanced`). `non_iid_kmeans` keeps plain k-means
clusters, which on the embedded corpus hold 98.1 / 1.7 / 0.14 / 0.02% of
the tokens; the outer mean weights islands by their cluster's share, so
its update is nearly one island's. The paper: non-iid data converges a
little slower early and ends about the same (Table 3: 4 workers 15.23 iid /
15.18 non-iid; 8: 15.08 / 15.02).

Full run: 3 points x 3 seeds; the runs take 9 minutes on 2 CPU cores.
"""

from experiments import plots
from experiments import study_lib

STUDY = study_lib.Study(
    name="iid_vs_noniid",
    title="IID against non-iid (clustered) islands",
    claim=("DiLoCo paper: non-iid islands converge a bit slower early and "
           "end about the same (4 workers: 15.23 iid, 15.18 non-iid)."),
    points=(study_lib.Point("iid", {"data.island_split": "iid"}),
            study_lib.Point("non_iid",
                            {"data.island_split": "clustered_balanced"}),
            study_lib.Point("non_iid_kmeans",
                            {"data.island_split": "clustered"})),
    reference="iid",
    quick_points=("iid", "non_iid"),
    plot=plots.curves_plot({"eval_loss": ""}),
)

if __name__ == "__main__":
  study_lib.main(STUDY)
