"""Running a job: the driver over the compiled pieces.

  train.py        train_and_evaluate: validate, claim the workdir, set up,
                  restore or start, run the loop, write the summary.
  setup.py        the mesh, data and state layout (RunSetup);
                  start.py where the loop starts (a checkpoint, fresh
                  params, another run's model).
  programs.py     the compiled programs, built from shapes in the
                  background (background.py).
  loop.py         the training loop over the schedule's events;
                  syncs.py runs the syncs, step_records.py writes each
                  step's record, recovery.py rolls back or stops,
                  overlap_watch.py warns when x's eval loss keeps rising
                  under an overlap.
  host_outer.py   the outer step on devices of its own
                  (outer_placement='host'); outer_side.py their base.
  state_spec.py   the TrainState a config implies.
  warm_start.py   starting from another run (init_from, pretrain_steps).
  resume.py       restoring this run's checkpoint, checked against the
                  config; checkpoints.py and integrity.py write and verify
                  them with orbax.
  workdir.py, files.py, stops.py, metrics.py, records.py, progress.py,
  placing.py:     the workdir lock, writes that never follow symlinks,
                  stop signals, the metrics writers,
                  the step records and summary, the run's counters, and
                  host arrays onto the mesh.

May import every other layer.
"""
