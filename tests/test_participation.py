"""Islands that skip rounds: schedules, dropped syncs, idle islands."""

import os
import signal

import jax
import numpy as np
import pytest

from configs import tiny
from diloco_jax.algorithm import inner_step as inner_step_lib
from diloco_jax.algorithm import optimizers
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import participation
from diloco_jax.config import validation
from diloco_jax.run import stops
from diloco_jax.run import train
from tests import helpers
from tests import test_checkpoint
from tests import test_diloco


def _counts(schedule, islands, rounds):
  return [participation.active_count(schedule, islands, r, rounds)
          for r in range(rounds)]


def test_schedules_by_hand():
  assert _counts("1->8", 8, 8) == [1, 2, 3, 4, 5, 6, 7, 8]
  assert _counts("8->1", 8, 8) == [8, 7, 6, 5, 4, 3, 2, 1]
  assert _counts("1->4", 4, 3) == [1, 3, 4]  # 1, 2.5 (half up), 4
  assert _counts("4<->8", 8, 5) == [4, 8, 4, 8, 4]
  assert _counts("", 4, 3) == [4, 4, 4]
  mask = participation.round_mask(8, 2, 8, "1->8")
  assert mask.tolist() == [True] * 3 + [False] * 5  # the first n islands


def test_dropped_syncs_are_seeded_and_at_the_asked_rate():
  masks = np.stack([participation.round_mask(8, r, 400, "",
                                             drop_probability=0.25, seed=3)
                    for r in range(400)])
  again = participation.round_mask(8, 17, 400, "", 0.25, seed=3)
  np.testing.assert_array_equal(masks[17], again)
  assert abs(1 - masks.mean() - 0.25) < 0.03
  assert not np.array_equal(
      masks[17], participation.round_mask(8, 17, 400, "", 0.25, seed=4))


@pytest.mark.parametrize("field,value,message", [
    ("diloco.island_schedule", "1-8", "is not 'A->B'"),
    ("diloco.island_schedule", "1->5", "asks for 5 islands; the run has 4"),
    ("diloco.island_schedule", "0<->4", "asks for 0 islands"),
    ("diloco.drop_probability", 1.0, "must be in \\[0, 1\\)"),
    ("diloco.dropped_islands", "sleep", "is not one of"),
    ("mode", "ddp", "island_schedule and drop_probability are DiLoCo's"),
])
def test_bad_participation_settings_are_one_error(field, value, message):
  config = helpers.with_overrides(tiny.get_config(), {
      "diloco.islands": 4, "diloco.island_schedule": "1->4", field: value})
  with pytest.raises(validation.ConfigError, match=f"^config.*{message}"):
    validation.validate_config(config, num_devices=8)


def _config(**overrides):
  return helpers.with_overrides(tiny.get_config(), {
      "diloco.islands": 4, "total_steps": 12, "diloco.inner_steps": 3,
      "checkpoint.every_steps": 3, "checkpoint.max_to_keep": 20,
      **overrides})


def test_a_schedule_run_follows_its_participation(tmp_path):
  config = _config(**{"diloco.island_schedule": "1->4"})
  train.train_and_evaluate(config, str(tmp_path / "ramp"))
  records = test_checkpoint._metrics(str(tmp_path / "ramp"))
  ends = [r for r in records if "active_islands" in r]
  assert [r["active_islands"] for r in ends] == [1, 2, 3, 4]  # 1..4 in 4
  # Each round's bytes are the active islands' share of a full round's.
  full = train.train_and_evaluate(_config(), str(tmp_path / "full"))
  per_round = full["comm_bytes"] // 4
  sent = np.diff([0] + [r["comm_bytes"] for r in ends])
  np.testing.assert_array_equal(sent, [per_round * n // 4
                                       for n in (1, 2, 3, 4)])


@pytest.mark.slow
def test_resume_mid_schedule_is_exact(tmp_path):
  test_checkpoint.check_resume_from_round_2(
      lambda: _config(**{"diloco.island_schedule": "4<->2",
                         "diloco.drop_probability": 0.3,
                         "diloco.dropped_islands": "idle"}), tmp_path)


def test_idle_islands_rejoin_with_a_fresh_inner_state():
  islands = 2
  _, loss_fn, inner_opt, outer_opt, mesh, state = test_diloco._setup(islands)
  inner = inner_step_lib.make_inner_step(loss_fn, inner_opt, mesh)
  outer_step = outer_step_lib.make_outer_step(outer_opt, mesh, inner_opt=inner_opt,
                                              restart_dropped=True)
  for batch in helpers.random_batches(2, islands, 2):
    state, _ = inner(state, test_diloco._put_batch(batch, mesh))
  before = jax.device_get(state.inner_opt_state)
  state = outer_step(state, test_diloco._island_weights([1.0, 0.0], mesh))
  after = jax.device_get(state.inner_opt_state)
  fresh = optimizers.with_step_counts(
      inner_opt.init(jax.device_get(state.global_params)), 2)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[0], b[0]),
               after, before)
  jax.tree.map(lambda a, f: np.testing.assert_array_equal(a[1], f),
               after, fresh)


# Islands that diverge.


def test_a_nan_island_is_left_out_and_the_run_goes_on(tmp_path, caplog):
  caplog.set_level("INFO")
  workdir = str(tmp_path / "nan")
  config = _config(**{"testing.nan_island": "2@2",
                      "checkpoint.every_steps": 1})
  summary = train.train_and_evaluate(config, workdir)
  assert np.isfinite(summary["final_eval_loss"])
  records = test_checkpoint._metrics(workdir)
  ends = {r["round"]: r for r in records if "excluded_islands" in r}
  assert [ends[r]["excluded_islands"] for r in (1, 2, 3, 4)] == [0, 1, 0, 0]
  # Round 2's steps average the three finite islands and count the other.
  for record in records:
    if record["round"] == 2:
      assert record["diverged_islands"] == 1
      assert np.isfinite(record["train_loss"])
  # x never saw the NaN: every eval is finite, and the run checkpointed no
  # state holding it (round 2's mid-round saves were skipped).
  assert all(np.isfinite(r["eval_loss"]) for r in ends.values())
  steps = sorted(int(s) for s in os.listdir(os.path.join(workdir,
                                                         "checkpoints")))
  assert steps == [1, 2, 3, 6, 7, 8, 9, 10, 11, 12]
  assert "no checkpoint while island(s) [2] are diverged" in caplog.text
  # The diverged island's sync is not counted as sent.
  assert ends[2]["comm_bytes"] - ends[1]["comm_bytes"] == (
      3 * (ends[1]["comm_bytes"] // 4))


def test_every_island_diverging_still_stops_the_run(tmp_path):
  config = _config(**{"inner_optimizer.learning_rate": 1e4,
                      "inner_optimizer.grad_clip_norm": 0.0})
  with pytest.raises(Exception, match=r"^step \d+: island \d+"):
    train.train_and_evaluate(config, str(tmp_path / "all"))


@pytest.mark.slow
def test_a_stop_while_an_island_is_diverged_saves_nothing_and_resumes(
    tmp_path, monkeypatch):
  # Island 2 diverges at step 4 (round 2's start); SIGTERM during step 5.
  overrides = {"testing.nan_island": "2@2"}
  whole = str(tmp_path / "whole")
  train.train_and_evaluate(_config(**overrides), whole)
  calls = []

  def stopping(inner_step, state, batch):
    calls.append(1)
    if len(calls) == 5:
      os.kill(os.getpid(), signal.SIGTERM)
    return inner_step(state, batch)

  helpers.wrap_inner_step(monkeypatch, stopping)
  stopped = str(tmp_path / "stopped")
  with pytest.raises(stops.StopRequested,
                     match=r"step 5 was not saved \(island\(s\) \[2\] had "
                     r"diverged in this round\); rerun the same command to "
                     r"resume from step 3"):
    train.train_and_evaluate(_config(**overrides), stopped)
  monkeypatch.undo()
  train.train_and_evaluate(_config(**overrides), stopped)
  test_checkpoint._assert_identical_runs(whole, stopped)
