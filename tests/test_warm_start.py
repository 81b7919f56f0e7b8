"""The DiLoCo paper's protocol: pretraining, then every island from that model.

config.pretrain_steps = N runs steps 1..N as one worker (in WORKDIR/pretrain)
and starts the configured mode from its model; config.init_from starts a run
from any run's checkpoint. The two must agree bit for bit, and either phase
must resume after a stop.
"""

import json
import os
import signal

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import tiny
from diloco_jax.algorithm import optimizers
from diloco_jax.algorithm import state as state_lib
from diloco_jax.config import run_config
from diloco_jax.config import state_spec
from diloco_jax.config import validation
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.run import stops
from diloco_jax.run import train
from diloco_jax.storage import checkpoints as checkpointing
from diloco_jax.storage import warm_start
from diloco_jax.telemetry import metrics_files as metrics_lib
from tests import helpers

TOTAL, PRETRAIN, H = 12, 4, 4


def _config(**overrides):
  config = tiny.get_config()
  config.total_steps = TOTAL
  config.diloco.inner_steps = H
  config.checkpoint.max_to_keep = 10
  return helpers.with_overrides(config, overrides)


def _summary(workdir):
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


def _state(workdir, step=None):
  path = os.path.join(workdir, "checkpoints")
  step = step or max(int(s) for s in os.listdir(path) if s.isdigit())
  return ocp.PyTreeCheckpointer().restore(os.path.join(path, str(step),
                                                       "state"))


def _assert_equal_trees(a, b):
  """Leaf by leaf (a restored checkpoint is dicts where the state has nnx
  States; both flatten in the same key order)."""
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b)
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """'protocol': pretrain then DiLoCo in one run; 'single' + 'init_from':
  the same by hand (a single run of N steps on the full schedule, then
  DiLoCo from its checkpoint)."""
  root = tmp_path_factory.mktemp("warm")
  workdirs = {name: str(root / name)
              for name in ("protocol", "single", "init_from")}
  train.train_and_evaluate(_config(pretrain_steps=PRETRAIN),
                           workdirs["protocol"])
  train.train_and_evaluate(
      _config(mode="single", total_steps=PRETRAIN,
              **{"inner_optimizer.schedule_steps": TOTAL}),
      workdirs["single"])
  train.train_and_evaluate(_config(init_from=workdirs["single"]),
                           workdirs["init_from"])
  return workdirs


@pytest.mark.slow
def test_pretraining_then_diloco_equals_single_then_init_from_bit_for_bit(
    runs):
  _assert_equal_trees(_state(runs["protocol"]), _state(runs["init_from"]))
  _assert_equal_trees(_state(os.path.join(runs["protocol"], "pretrain")),
                      _state(runs["single"]))
  main_phase = [r for r in metrics_lib.read_metrics(runs["protocol"]) if r["step"] > PRETRAIN]
  by_hand = metrics_lib.read_metrics(runs["init_from"])
  assert [r["step"] for r in by_hand] == list(range(PRETRAIN + 1, TOTAL + 1))
  for a, b in zip(main_phase, by_hand, strict=True):
    for key in ("step", "train_loss", "grad_norm", "learning_rate",
                "tokens_seen", "comm_bytes", "eval_loss"):
      assert a.get(key) == b.get(key), (key, a, b)
  assert (_summary(runs["protocol"])["final_eval_loss"]
          == _summary(runs["init_from"])["final_eval_loss"])


def test_metrics_mark_the_phase_and_total_steps_counts_both(runs):
  records = metrics_lib.read_metrics(runs["protocol"])
  assert [r["step"] for r in records] == list(range(1, TOTAL + 1))
  assert [r["phase"] for r in records] == (["pretrain"] * PRETRAIN
                                           + ["diloco"] * (TOTAL - PRETRAIN))
  config = _config()
  tokens = config.data.batch_size * config.data.sequence_length
  summary = _summary(runs["protocol"])
  assert summary["tokens_seen"] == (PRETRAIN * tokens + (TOTAL - PRETRAIN)
                                    * config.diloco.islands * tokens)
  assert summary["pretrain_steps"] == PRETRAIN
  assert summary["initialized_from"] == {
      "path": os.path.join(runs["protocol"], "pretrain", "checkpoints"),
      "step": PRETRAIN, "mode": "single", "inner_opt_state": "carried"}
  # One learning rate schedule spans both phases.
  np.testing.assert_allclose(
      [r["learning_rate"] for r in records],
      optimizers.learning_rate_table(
          run_config.inner_optimizer(config.inner_optimizer), TOTAL),
      rtol=1e-6)


def _load(source, config):
  spec = state_spec.for_config(config)
  mesh = mesh_lib.build_mesh(spec.islands)
  shardings = state_lib.state_shardings(spec.abstract(config.model), mesh)
  return warm_start.load(warm_start.parse_source(source), spec, config, mesh,
                         shardings)


def test_every_island_and_x_start_from_the_pretrained_model(runs):
  pretrained = _state(os.path.join(runs["protocol"], "pretrain"))
  start = _load(os.path.join(runs["protocol"], "pretrain"), _config())
  state = jax.device_get(start.state)
  model = jax.tree.map(lambda y: y[0], pretrained["island_params"])
  inner = jax.tree.map(lambda s: s[0], pretrained["inner_opt_state"])
  islands = _config().diloco.islands
  for island in range(islands):
    _assert_equal_trees(jax.tree.map(lambda y: y[island], state.island_params),
                        model)
    _assert_equal_trees(
        jax.tree.map(lambda s: s[island], state.inner_opt_state), inner)
  _assert_equal_trees(state.global_params, model)
  assert int(state.step) == PRETRAIN and start.inner_state_carried
  # The outer optimizer starts fresh: no momentum from before.
  assert all(not np.any(leaf) for leaf in
             jax.tree.leaves(state.outer.outer_opt_state)
             if np.asarray(leaf).dtype == np.float32)


def test_init_from_one_step_of_a_diloco_run_starts_from_its_x(runs):
  source = os.path.join(runs["protocol"], "checkpoints", "8")
  start = _load(source, _config(**{"diloco.islands": 3}))
  _assert_equal_trees(jax.device_get(start.state.global_params),
                      _state(runs["protocol"], step=8)["global_params"])
  assert start.step == 8
  assert jax.tree.leaves(start.state.island_params)[0].shape[0] == 3


def test_an_inner_state_that_does_not_fit_starts_fresh_on_the_schedule(runs):
  config = _config(**{"inner_optimizer.grad_clip_norm": 0.0})
  start = _load(runs["single"], config)
  assert not start.inner_state_carried
  counts, moments = [], []
  def collect(path, leaf):
    (counts if getattr(path[-1], "name", None) == "count" else
     moments).append(np.asarray(leaf))
  jax.tree_util.tree_map_with_path(collect,
                                   jax.device_get(start.state.inner_opt_state))
  assert counts and all(np.all(c == PRETRAIN) for c in counts)
  assert all(not np.any(m) for m in moments)
  assert start.record(warm_start.Source(runs["single"]))[
      "inner_opt_state"] == "fresh"


def _stop_at_inner_call(monkeypatch, at_call: int):
  """Sends this process SIGTERM during the inner step's `at_call`-th call
  (counted over both phases), as a scheduler's preemption would."""
  calls = []

  def stopping(inner_step, state, batch):
    calls.append(1)
    if len(calls) == at_call:
      os.kill(os.getpid(), signal.SIGTERM)
    return inner_step(state, batch)

  helpers.wrap_inner_step(monkeypatch, stopping)


@pytest.mark.slow
@pytest.mark.parametrize("stop_at", [2, PRETRAIN + 3],
                         ids=["in_pretraining", "after_the_switch"])
def test_a_stop_in_either_phase_resumes_to_the_same_run(runs, tmp_path,
                                                        monkeypatch, stop_at):
  workdir = str(tmp_path / "stopped")
  _stop_at_inner_call(monkeypatch, stop_at)
  with pytest.raises(stops.StopRequested, match=f"at step {stop_at};"):
    train.train_and_evaluate(_config(pretrain_steps=PRETRAIN), workdir)
  monkeypatch.undo()
  train.train_and_evaluate(_config(pretrain_steps=PRETRAIN), workdir)
  _assert_equal_trees(_state(runs["protocol"]), _state(workdir))
  # Every record but its wall-clock (elapsed_s) is the uninterrupted run's.
  untimed = lambda records: [{k: v for k, v in r.items() if k != "elapsed_s"}
                             for r in records]
  assert untimed(metrics_lib.read_metrics(workdir)) == untimed(
      metrics_lib.read_metrics(runs["protocol"]))


@pytest.mark.parametrize("overrides, error, message", [
    ({"init_from": "/nonexistent/run"}, validation.ConfigError,
     "no checkpoint there"),
    ({"init_from": "RUN", "pretrain_steps": 2}, validation.ConfigError,
     "both choose the starting model"),
    ({"pretrain_steps": TOTAL}, validation.ConfigError,
     r"pretrain_steps=12 must be an integer in \[0, config.total_steps=12\)"),
    ({"init_from": "RUN", "total_steps": PRETRAIN}, validation.ConfigError,
     "leaves nothing to train after step 4"),
    ({"init_from": "RUN", "model.d_model": 48},
     checkpointing.IncompatibleCheckpointError, "holds another model"),
])
def test_a_bad_start_is_one_clear_error_before_anything_is_written(
    runs, tmp_path, overrides, error, message):
  if overrides.get("init_from") == "RUN":
    overrides["init_from"] = runs["single"]
  workdir = tmp_path / "run"
  with pytest.raises(error, match=message):
    train.train_and_evaluate(_config(**overrides), str(workdir))
  assert not os.path.exists(workdir / "checkpoints")
  assert not os.path.exists(workdir / "metrics.jsonl")


def test_init_from_its_own_workdir_is_refused(runs):
  with pytest.raises(validation.ConfigError, match="own workdir"):
    train.train_and_evaluate(_config(init_from=runs["init_from"]),
                             runs["init_from"])
