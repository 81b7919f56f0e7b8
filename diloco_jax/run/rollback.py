"""What the loop does when a run diverges.

A NaN or inf (algorithm/guards.py) stops the run with an error naming the
step and island, or under config.nonfinite='rollback' restores the last
good checkpoint and goes on, skipping the batches taken since. (A run
asked to stop: stops.py.)
"""

from absl import logging

from diloco_jax.algorithm import guards
from diloco_jax.run import start as start_lib


def rollback_start(error: guards.NonFiniteError, step: int, setup,
                   checkpointer, source, progress) -> start_lib.Start:
  """Where a run that diverged at `step` goes on from: its newest readable
  checkpoint, or its first start (from `source`) when it has none; the
  rollback is recorded in the Start's progress, with `progress`'s config
  changes carried over. The data stream goes on from where it is, so the
  batches of the steps after that state are skipped.

  Raises:
    `error`: config.nonfinite is not 'rollback'.
    guards.NonFiniteError: config.max_rollbacks rollbacks were taken.
  """
  config = setup.config
  rollbacks = progress.rollbacks
  if config.nonfinite != "rollback":
    raise error
  if len(rollbacks) >= config.max_rollbacks:
    raise guards.NonFiniteError(
        f"{error} (after {len(rollbacks)} rollbacks, config.max_rollbacks)",
        error.step) from error
  checkpointer.wait()
  start = (start_lib.restore(setup, checkpointer, compare_config=False)
           or start_lib.first_start(setup, source))
  start.progress.config_changes = progress.config_changes
  start.progress.rollbacks = rollbacks + [{
      "step": error.step, "to_step": start.step,
      "skipped_batches": step - start.step, "error": str(error)}]
  logging.warning("%s; rolled back to step %d, skipping the %d batches "
                  "taken since (rollback %d of at most %d)", error,
                  start.step, step - start.step,
                  len(start.progress.rollbacks), config.max_rollbacks)
  return start
