r"""Pruning pseudo-gradients per neuron by sign: 25%, 50%, 75% dropped.

  python -m experiments.sign_pruning [--seeds=3] [--quick]

DiLoCo with 4 islands after the shared pretraining; the `sign_prune` codec
drops that fraction of each neuron's pseudo-gradient (vectors and small
tensors go through int8). The paper: +0.0% perplexity at 25%, +0.4% at 50%,
+1.7% at 75%.
"""

from experiments import study_lib

STUDY = study_lib.Study(
    name="sign_pruning",
    title="Sign pruning of pseudo-gradients",
    claim=("DiLoCo paper: pruning 25% / 50% / 75% of each neuron's "
           "pseudo-gradient costs +0.0% / +0.4% / +1.7% perplexity."),
    points=(study_lib.Point("fp32", {"diloco.codec": "fp32"}, x=0.0),) +
    tuple(study_lib.Point(
        f"pruned_{int(100 * rate)}%",
        {"diloco.codec": "sign_prune", "diloco.prune_rate": rate,
         "diloco.fallback_codec": "int8"}, x=rate)
          for rate in (0.25, 0.5, 0.75)),
    reference="fp32",
    plot=study_lib.sweep_plot("fraction of each neuron pruned"),
    quick_points=("fp32", "pruned_50%"),
)

if __name__ == "__main__":
  study_lib.main(STUDY)
