"""What a run reports: metrics files, records, summaries, warnings.

  metrics_files.py  the writers: console, metrics.jsonl, TensorBoard
                    (event_files.py, written in the loop's thread).
  reports.py        what a step's record and the run's summary hold.
  counters.py       the run's counters (rounds, tokens, bytes), saved
                    with each checkpoint.
  rising_loss.py    the warning when x's eval loss keeps rising under an
                    overlap.
  quiet_logs.py     other libraries' chatter kept out of the log.

May import storage/ (its files and workdir) and the layers below it.
"""
