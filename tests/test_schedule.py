"""The host schedule's cadence: rounds' ends, evaluations and checkpoints.

Which synchronization runs after each step is tested with the algorithms it
drives (test_overlap.py, test_streaming.py); these are the pure functions of
the step the loop asks about everything else.
"""

import pytest

from diloco_jax.algorithm import schedule
from diloco_jax.config import run_config
from diloco_jax.config import schema as config_schema


def _plan(**fields) -> schedule.Schedule:
  return schedule.Schedule(**{"mode": "diloco", "inner_steps": 4,
                              "total_steps": 18, **fields})


def test_rounds_end_every_h_steps_and_at_the_last_step():
  plan = _plan()
  assert [t for t in range(1, 19) if plan.ends_round(t)] == [4, 8, 12, 16, 18]


@pytest.mark.parametrize("every_rounds,expected", [
    (1, [4, 8, 12, 16, 18]), (2, [8, 16, 18]), (3, [12, 18]), (0, [18])])
def test_evaluations_every_n_rounds_and_at_the_last_step(every_rounds,
                                                         expected):
  plan = _plan(eval_every_rounds=every_rounds)
  assert [t for t in range(1, 19) if plan.evaluates(t)] == expected


def test_checkpoints_by_rounds_done_by_steps_and_at_the_last_step():
  # every_rounds counts the rounds the run has done (its pretraining's
  # included), not the step.
  plan = _plan(checkpoint_every_rounds=3, checkpoint_every_steps=0)
  assert [t for t in range(1, 19) if plan.checkpoints(t, t // 4)] == [12, 18]
  assert [t for t in range(1, 19) if plan.checkpoints(t, t // 4 + 1)] == [
      8, 18]
  plan = _plan(checkpoint_every_rounds=0, checkpoint_every_steps=5)
  assert [t for t in range(1, 19) if plan.checkpoints(t, t // 4)] == [
      5, 10, 15, 18]
  plan = _plan(checkpoint_every_rounds=2, checkpoint_every_steps=6)
  assert [t for t in range(1, 19) if plan.checkpoints(t, t // 4)] == [
      6, 8, 12, 16, 18]


def test_from_config_takes_the_eval_and_checkpoint_cadence():
  config = config_schema.base_config()
  config.total_steps, config.diloco.inner_steps = 30, 5
  config.eval.every_rounds = 2
  config.checkpoint.every_rounds, config.checkpoint.every_steps = 0, 7
  plan = run_config.schedule(config)
  assert [t for t in range(1, 31) if plan.evaluates(t)] == [10, 20, 30]
  assert [t for t in range(1, 31) if plan.checkpoints(t, t // 5)] == [
      7, 14, 21, 28, 30]
