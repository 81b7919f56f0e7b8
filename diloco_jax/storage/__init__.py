"""What a run keeps on disk: the workdir, its files, checkpoints.

  workdir.py        the workdir checked before anything compiles, and its
                    lock (one run at a time).
  files.py          writes that never follow a symlink, replaced
                    atomically, a failed one said in one line.
  checkpoints.py    the run's checkpoints with orbax (every orbax call);
                    integrity.py the digests and finiteness they are
                    written and read with.
  resume.py         this run's newest readable checkpoint, checked
                    against the config; layout_records.py what a
                    checkpoint records of the state's layout;
                    legacy_state.py older checkpoints read into today's
                    state.
  warm_start.py     another run's model as a start (config.init_from,
                    config.pretrain_steps).

May import config/ and the layers below it; knows nothing of the loop,
the compiled programs or the metrics.
"""
