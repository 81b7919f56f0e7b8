"""Runs that survive being killed: resume, fallback, mismatch, island changes."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from configs import tiny
from diloco_jax.algorithm import outer_settings
from diloco_jax.algorithm import state as state_lib
from diloco_jax.run import train
from diloco_jax.storage import checkpoints as checkpointing
from diloco_jax.telemetry import metrics_files as metrics_lib
from tests import helpers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**overrides):
  config = tiny.get_config()
  config.total_steps = 12
  config.diloco.inner_steps = 3
  config.checkpoint.every_steps = 2  # also mid-round checkpoints
  config.checkpoint.max_to_keep = 20
  return helpers.with_overrides(config, overrides)


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _final_state(workdir):
  """The newest checkpoint's state as numpy arrays (whatever devices and
  processes saved it)."""
  path = os.path.join(workdir, "checkpoints")
  step = max(int(s) for s in os.listdir(path) if s.isdigit())
  checkpointer = ocp.PyTreeCheckpointer()
  state_path = os.path.join(path, str(step), "state")
  metadata = checkpointer.metadata(state_path).item_metadata
  return checkpointer.restore(state_path, restore_args=jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata))


def _assert_identical_runs(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x),
                                                          np.asarray(y)),
               _final_state(a), _final_state(b))
  ma, mb = _metrics(a), _metrics(b)
  assert [r["step"] for r in mb] == [r["step"] for r in ma]
  for ra, rb in zip(ma, mb):
    assert ra["train_loss"] == rb["train_loss"]
    assert ra.get("eval_loss") == rb.get("eval_loss")
    assert ra["comm_bytes"] == rb["comm_bytes"]


def forget_after(whole: str, resumed: str, step: int) -> None:
  """Copies the finished run in `whole` to `resumed` as if it had been
  killed just after `step`: the later checkpoints and the summary gone.
  The next run in `resumed` resumes from a checkpoint `whole` wrote, so
  its end must be `whole`'s end, bit for bit."""
  shutil.copytree(whole, resumed)
  checkpoints = os.path.join(resumed, "checkpoints")
  for saved in os.listdir(checkpoints):
    if saved.isdigit() and int(saved) > step:
      shutil.rmtree(os.path.join(checkpoints, saved))
  os.remove(os.path.join(resumed, "summary.json"))


def check_resume_from_round_2(make_config, tmp_path):
  """Runs a 12-step, 3-step-round config whole, forgets everything after
  round 2 (as if killed there), resumes it, and checks that both runs end
  identical. make_config() must keep checkpoints 3..12."""
  whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
  train.train_and_evaluate(make_config(), whole)
  forget_after(whole, resumed, 6)
  train.train_and_evaluate(make_config(), resumed)
  _assert_identical_runs(whole, resumed)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("uninterrupted"))
  # On one device slot per island, as `main` places a CPU run, so the runs
  # below compare bit for bit.
  summary = train.train_and_evaluate(_config(), workdir)
  return workdir, summary


def _main_args(workdir):
  return [sys.executable, "-m", "diloco_jax.main", "--config=configs/tiny.py",
          f"--workdir={workdir}", "--config.total_steps=12",
          "--config.diloco.inner_steps=3", "--config.checkpoint.every_steps=2",
          "--config.checkpoint.max_to_keep=20"]


@pytest.mark.slow
@pytest.mark.parametrize("kill_after_step", [4, 8])
def test_sigkill_and_resume_equals_uninterrupted(uninterrupted, tmp_path,
                                                 kill_after_step):
  workdir = str(tmp_path / "killed")
  env = {**os.environ, "PYTHONPATH": REPO}
  process = subprocess.Popen(_main_args(workdir), cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + 240
  while time.time() < deadline and process.poll() is None:
    if os.path.exists(metrics_path):
      with open(metrics_path) as f:
        if sum(1 for _ in f) >= kill_after_step:
          break
    time.sleep(0.01)
  assert process.poll() is None, "the run ended before it could be killed"
  process.send_signal(signal.SIGKILL)
  process.wait()
  assert not os.path.exists(os.path.join(workdir, "summary.json"))

  result = subprocess.run(_main_args(workdir), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "resuming from the checkpoint at step" in result.stderr
  _assert_identical_runs(uninterrupted[0], workdir)
  # Nothing half-written is left behind by the killed save, if any.
  assert all(name.isdigit() for name in os.listdir(
      os.path.join(workdir, "checkpoints")))


def test_rerunning_a_finished_run_returns_its_summary(uninterrupted):
  workdir, summary = uninterrupted
  before = open(os.path.join(workdir, "metrics.jsonl")).read()
  again = train.train_and_evaluate(_config(), workdir)
  assert again == summary  # read back from summary.json
  assert open(os.path.join(workdir, "metrics.jsonl")).read() == before


def test_corrupted_latest_checkpoint_falls_back_to_previous(
    uninterrupted, tmp_path, caplog):
  workdir = str(tmp_path / "corrupt")
  train.train_and_evaluate(_config(), workdir)
  os.remove(os.path.join(workdir, "summary.json"))
  latest = os.path.join(workdir, "checkpoints", "12", "state")
  for root, _, files in os.walk(latest):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(_config(), workdir)
  warnings = [r for r in caplog.records if "unreadable" in r.getMessage()]
  assert len(warnings) == 1 and "step 12" in warnings[0].getMessage()
  _assert_identical_runs(uninterrupted[0], workdir)


def test_checkpoint_of_another_model_shape_stops_before_touching_anything(
    uninterrupted, tmp_path):
  workdir = str(tmp_path / "mismatch")
  train.train_and_evaluate(_config(**{"total_steps": 6}), workdir)
  before = {name: open(os.path.join(workdir, name), "rb").read()
            for name in ("metrics.jsonl", "summary.json")}
  checkpoints_before = sorted(os.listdir(os.path.join(workdir, "checkpoints")))
  with pytest.raises(checkpointing.IncompatibleCheckpointError,
                     match=r"has shape \[.*\] in the checkpoint but"):
    # Even when the config change is allowed, the shapes must match.
    train.train_and_evaluate(_config(**{
        "model.mlp_dim": 48, "resume.allow_changes": "model,total_steps"}),
                             workdir)
  for name, content in before.items():
    assert open(os.path.join(workdir, name), "rb").read() == content
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == (
      checkpoints_before)


@pytest.mark.slow
@pytest.mark.parametrize("new_islands", [4, 1])
def test_resume_with_a_different_number_of_islands(tmp_path, caplog,
                                                   new_islands):
  workdir = str(tmp_path / "elastic")
  # Stop mid-round (step 4 of rounds of 3) so islands carry pending progress.
  train.train_and_evaluate(_config(**{"total_steps": 4}), workdir)
  os.remove(os.path.join(workdir, "summary.json"))
  with caplog.at_level(logging.WARNING):
    summary = train.train_and_evaluate(
        _config(**{"diloco.islands": new_islands,
                   "resume.allow_changes": "total_steps"}), workdir)
  message = " ".join(r.getMessage() for r in caplog.records)
  assert f"resuming with {new_islands} islands from a checkpoint of 2" in (
      message)
  assert ("dropped" if new_islands < 2 else "fresh inner optimizer") in message
  assert summary["islands"] == new_islands
  assert [r["step"] for r in _metrics(workdir)] == list(range(1, 13))
  assert np.isfinite(summary["final_eval_loss"])


def test_resize_islands_keeps_survivors_and_starts_new_islands_from_x():
  params, loss_fn = helpers.tiny_problem()
  inner_opt, outer_opt = optax.adam(1e-2), optax.sgd(1.0)
  state = outer_settings.init_state(params, inner_opt, outer_opt, 2)
  # Make island params and optimizer states differ from x and from fresh.
  state = state.replace(
      island_params=jax.tree.map(lambda y: y + 1.0, state.island_params),
      inner_opt_state=jax.tree.map(lambda s: s + 1, state.inner_opt_state))
  grown = state_lib.resize_islands(state, 3, inner_opt)
  fresh = inner_opt.init(params)
  for i in range(2):
    helpers.assert_trees_close(jax.tree.map(lambda y: y[i], grown.island_params),
                               jax.tree.map(lambda y: y[i], state.island_params))
  helpers.assert_trees_close(jax.tree.map(lambda y: y[2], grown.island_params),
                             params)
  helpers.assert_trees_close(
      jax.tree.map(lambda s: s[2], grown.inner_opt_state), fresh)
  shrunk = state_lib.resize_islands(state, 1, inner_opt)
  assert jax.tree.leaves(shrunk.island_params)[0].shape[0] == 1


def test_truncate_metrics_drops_later_and_torn_records(tmp_path):
  path = tmp_path / "metrics.jsonl"
  lines = [json.dumps({"step": s}) + "\n" for s in range(1, 9)]
  path.write_text("".join(lines) + '{"step": 9, "train_lo')
  assert metrics_lib.truncate_metrics(str(tmp_path), 5) == 4
  assert [json.loads(l)["step"] for l in path.read_text().splitlines()] == [
      1, 2, 3, 4, 5]
