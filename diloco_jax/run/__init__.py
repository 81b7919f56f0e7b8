"""Running a job: the driver over the compiled pieces.

  train.py          train_and_evaluate: validate, claim the workdir, set
                    up, restore or start, run the loop, write the summary.
  setup.py          the mesh, data, state layout and programs (RunSetup).
  start.py          where the loop starts: this run's checkpoint, fresh
                    params, or another run's model.
  loop.py           the training loop over the schedule's events;
                    syncs.py the syncs after a step; step_exchange.py
                    each step's metrics, fetched a step late (the
                    processes' one exchange per step).
  rollback.py       a diverged run rolled back to its last good state;
                    stops.py SIGTERM and Ctrl-C at a step boundary.

May import every layer below it: compiled/, telemetry/, storage/ and
lower. What it stores lives in storage/, what it reports in telemetry/,
what it compiles in compiled/.
"""
