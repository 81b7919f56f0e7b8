r"""What overlapping communication with training costs in quality.

  python -m experiments.overlaps [--seeds=3] [--quick]

DiLoCo with 4 islands and H=25 after the shared pretraining, against the
ways this codebase lets the collective run beside local training:

  one_step_delay         each round's mean is applied a round late, and
                         every island starts the next round from x_r
                         (DiLoCoX's overlap as we define it);
  one_step_delay_rebase  the same timing, but each island keeps its own
                         progress of the round on top of x_r until the
                         islands' mean of it lands;
  streaming              Streaming DiLoCo: 2 fragments on staggered
                         schedules (offsets 0 and 12), each sync
                         overlapping tau = 5 inner steps, merged with
                         alpha = 0.5;
  streaming_fp4 and diloco_fp4: the same with pseudo-gradients sent as
                         4-bit floats (e2m1), as Streaming DiLoCo sends them;
  *_m0.5                 both delays with the outer momentum at 0.5 instead
                         of 0.9: a one-round-stale update under heavy
                         momentum overshoots.

DiLoCoX reports a negligible loss from the one-step delay; Streaming DiLoCo
finds its overlap and 4-bit outer gradients cost little against DiLoCo.

Full run: 8 points x 3 seeds; the runs take about 30 minutes on 2 CPU cores.
"""

from experiments import plots
from experiments import study_lib

_STREAMING = {"diloco.fragments": 2, "diloco.fragment_delay": 5,
              "diloco.fragment_alpha": 0.5}
_FP4 = {"diloco.codec": "fp4"}
_M05 = {"diloco.outer_optimizer.momentum": 0.5}

STUDY = study_lib.Study(
    name="overlaps",
    title="Overlapped communication: the loss it costs",
    claim=("DiLoCoX: the one-step delay's loss is negligible; Streaming "
           "DiLoCo: overlapping tau steps and sending 4-bit floats cost "
           "little against DiLoCo."),
    points=(
        study_lib.Point("diloco", {}),
        study_lib.Point("one_step_delay",
                        {"diloco.overlap": "one_step_delay"}),
        study_lib.Point("one_step_delay_rebase",
                        {"diloco.overlap": "one_step_delay_rebase"}),
        study_lib.Point("streaming", _STREAMING),
        study_lib.Point("streaming_fp4", {**_STREAMING, **_FP4}),
        study_lib.Point("diloco_fp4", _FP4),
        # A stale update under heavy momentum: the delays with the outer
        # momentum at 0.5 (the outer optimizers study's better setting).
        study_lib.Point("one_step_delay_m0.5",
                        {"diloco.overlap": "one_step_delay", **_M05}),
        study_lib.Point("one_step_delay_rebase_m0.5",
                        {"diloco.overlap": "one_step_delay_rebase", **_M05}),
    ),
    reference="diloco",
    plot=plots.bar_plot,
    quick_points=("diloco", "one_step_delay_rebase"),
)

if __name__ == "__main__":
  study_lib.main(STUDY)
