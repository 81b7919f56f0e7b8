"""Elastic islands of unequal speeds (elastic/speeds.py): time-budgeted
rounds, the merge weighted by the tokens each island trained, data
positions that count the steps taken, and the speed knob."""

import jax
import numpy as np
import pytest

from diloco_jax.config import problems
from diloco_jax.config import validation
from diloco_jax.elastic import coordinator as coordinator_lib
from diloco_jax.elastic import island as island_lib
from diloco_jax.elastic import settings as settings_lib
from diloco_jax.elastic import speeds
from tests import test_elastic

_config = test_elastic._config  # pylint: disable=protected-access
_run_config = test_elastic._run_config  # pylint: disable=protected-access
namespace = test_elastic.namespace


@pytest.mark.parametrize("spec,message", [
    ("1,0.5,1", "'1,0.5,1' gives 3 speeds for 2 islands"),
    ("1,fast", "'fast' in '1,fast' is not a number"),
    ("1,0", "'0' in '1,0' must be in \\(0, 1\\]"),
    ("1,2", "'2' in '1,2' must be in \\(0, 1\\]"),
    ("1,nan", "'nan' in '1,nan' must be in \\(0, 1\\]"),
])
def test_bad_speeds_are_one_line(spec, message):
  with pytest.raises(problems.ConfigError,
                     match="config.testing.island_speeds: " + message):
    settings_lib.check(_run_config(_config(
        **{"testing.island_speeds": spec})))


def test_speeds_and_budgets_are_checked_and_parsed():
  settings = settings_lib.check(_run_config(_config(**{
      "testing.island_speeds": "1, 0.25", "elastic.round_budget": "time"})))
  assert settings.speeds == (1.0, 0.25)
  assert settings.round_budget == "time"
  assert settings_lib.check(_run_config(_config())).speeds == (1.0, 1.0)
  with pytest.raises(problems.ConfigError,
                     match="round_budget='hours' is not one of"):
    settings_lib.check(_run_config(_config(**{
        "elastic.round_budget": "hours"})))
  with pytest.raises(problems.ConfigError,
                     match="round_budget='time' with config.diloco.fragments"):
    settings_lib.check(_run_config(_config(**{
        "elastic.round_budget": "time", "diloco.fragments": 2,
        "model.num_layers": 2})))
  # An SPMD run's islands are one program: the knob would do nothing.
  config = _config(**{"testing.island_speeds": "1,0.5"})
  with pytest.raises(problems.ConfigError,
                     match="config.testing.island_speeds='1,0.5' is for "
                     "elastic"):
    validation.validate_config(config, config.diloco.islands)


def test_a_round_gives_each_island_the_steps_of_the_fastest_s_time():
  assert not speeds.island_steps({}, 10)
  # H for the fastest; the others as many as fit in its H steps, rounded
  # down, at least one; within 5% of the fastest (measurement noise): H.
  assert speeds.island_steps({0: 0.1, 1: 0.102, 2: 0.2, 3: 0.4, 4: 5.0},
                             10) == {0: 10, 1: 10, 2: 5, 3: 2, 4: 1}
  assert speeds.typical_step_seconds([0.1, 0.3, 0.2]) == 0.2
  assert speeds.typical_step_seconds([]) is None


def test_an_island_s_speed_is_the_median_of_its_last_three_rounds():
  """One slowed round (another island's compile beside it) does not cut
  an island's steps; a lasting change does, from the second round on."""
  steps = speeds.RoundSteps("time")
  for seconds in (0.1, 0.1, 0.5, 0.1, 0.1):  # island 1: one slow round
    steps.measured({0: {"step_seconds": 0.1},
                    1: {"step_seconds": seconds}})
    assert steps.plan(None, {}, 10) == {0: 10, 1: 10}
  steps.measured({0: {"step_seconds": 0.1}, 1: {"step_seconds": 0.4}})
  assert steps.plan(None, {}, 10) == {0: 10, 1: 10}
  steps.measured({0: {"step_seconds": 0.1}, 1: {"step_seconds": 0.4}})
  assert steps.plan(None, {}, 10) == {0: 10, 1: 2}
  assert speeds.RoundSteps("steps").plan(None, {}, 10) is None


def test_the_speed_knob_slows_every_step_by_its_factor():
  import time  # pylint: disable=g-import-not-at-top
  started = time.monotonic()
  speeds.slow_down(0.25, 0.02)  # a 20 ms step made 80 ms: 60 ms more
  assert 0.055 <= time.monotonic() - started < 0.5
  started = time.monotonic()
  speeds.slow_down(1.0, 0.02)
  assert time.monotonic() - started < 0.01


def test_the_speed_knob_scales_the_typical_step_not_a_held_up_one(
    monkeypatch):
  """After the first step (the compile), the knob sleeps by the median of
  the raw steps so far: a step another process held up (0.5 s among
  0.1 s ones) is not slowed 1/speed times its delay."""
  slept = []
  monkeypatch.setattr(speeds, "slow_down",
                      lambda speed, seconds: slept.append((speed, seconds)))
  knob = speeds.SpeedKnob(0.1)
  for seconds in (3.0, 0.1, 0.1, 0.5, 0.1):
    knob.after_step(seconds)
  assert slept == [(0.1, 0.1)] * 4
  full_speed = speeds.SpeedKnob(1.0)
  for seconds in (3.0, 0.1):
    full_speed.after_step(seconds)
  assert len(slept) == 4


def test_the_speed_knob_leaves_the_compiling_step_alone(tmp_path,
                                                       monkeypatch):
  """An island at speed 0.25 slows every inner step but its process's
  first, which compiles (a slower accelerator compiles no slower): timed
  in 3 steps, 2 are slowed; a round of 2 steps after that, both."""
  slowed = []
  monkeypatch.setattr(speeds, "slow_down",
                      lambda speed, seconds: slowed.append(speed))
  run_config = _run_config(_config())
  program = island_lib.IslandProgram(run_config, 0, str(tmp_path),
                                     speed=0.25)
  x = coordinator_lib.Coordinator(run_config, str(tmp_path)).x
  assert program.measure_step_seconds(x, steps=3) > 0
  assert slowed == [0.25, 0.25]
  program.train_round(x, 1, None, 2)
  assert slowed == [0.25] * 4


def test_the_merge_weighs_each_island_by_the_tokens_it_trained(tmp_path):
  """With outer SGD at lr 1, x becomes the weighted mean of the islands'
  params: an island that trained 3 times the tokens counts 3 times. Sums
  in another order than numpy's: 1e-6."""
  config = _config(**{"diloco.outer_optimizer.name": "sgd",
                      "diloco.outer_optimizer.learning_rate": 1.0})
  coordinator = coordinator_lib.Coordinator(_run_config(config),
                                            str(tmp_path))
  rng = np.random.default_rng(0)
  x = coordinator.x
  ys = [jax.tree.map(lambda a: a + rng.normal(0, 0.01, a.shape).astype(
      a.dtype), x) for _ in range(2)]
  results = {i: {"round": 1, "share": 1.0, "tokens": tokens, "params": y,
                 "data_state": {"step": steps}}
             for i, (y, tokens, steps) in enumerate(
                 zip(ys, (384, 128), (3, 1)))}
  coordinator.close_round(results, 1)
  expected = jax.tree.map(lambda a, b: (3 * a + b) / 4, *ys)
  for got, want in zip(jax.tree.leaves(coordinator.x),
                       jax.tree.leaves(expected)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  # Each island's data position is where its own steps left it.
  assert coordinator.data_states == [{"step": 3}, {"step": 1}]
  coordinator.close()


@pytest.mark.slow
def test_slow_islands_take_fewer_steps_and_keep_exact_positions(namespace,
                                                                tmp_path):
  """Island 1 at a quarter of island 0's speed, rounds budgeted in time:
  it takes fewer of each round's H steps, its tokens weigh its update,
  and its data stream has moved by exactly the steps it took."""
  workdir = str(tmp_path / "run")
  test_elastic._elastic(  # pylint: disable=protected-access
      namespace, workdir, "--config.elastic.round_budget=time",
      "--config.testing.island_speeds=1,0.25")
  records = test_elastic._records(workdir)  # pylint: disable=protected-access
  taken = [{int(i): n for i, n in r["steps_taken"].items()}
           for r in records]
  assert all(r["seconds_per_step"] for r in records)
  assert all(r["included"] == [1, 1] for r in records)
  assert sum(t[1] for t in taken) < sum(t[0] for t in taken)
  assert all(t[0] <= 4 and t[1] >= 1 for t in taken)
  summary = test_elastic._summary(workdir)  # pylint: disable=protected-access
  assert summary["rounds"] == 3
  assert summary["data_states"] == [
      {"step": sum(t[i] for t in taken)} for i in range(2)]


@pytest.mark.slow
def test_pinned_islands_run_on_the_nodes_offering_their_slot(namespace,
                                                             tmp_path):
  """config.elastic.pin_islands: on the run's own Ray this node offers
  every slot's resource, and the run trains; on a cluster where no node
  offers island 1's, the command is one line naming the resource and
  the `ray start` flag, and writes no config.json (no island started)."""
  workdir = tmp_path / "pinned"
  test_elastic._elastic(  # pylint: disable=protected-access
      namespace, str(workdir), "--config.elastic.pin_islands=true")
  assert test_elastic._summary(str(workdir))["rounds"] == 3  # pylint: disable=protected-access


@pytest.mark.slow
def test_a_pinned_island_no_node_offers_is_one_line(tmp_path):
  import ray  # pylint: disable=g-import-not-at-top
  from diloco_jax.elastic import driver  # pylint: disable=g-import-not-at-top
  config = _config(**{"elastic.pin_islands": True})
  # A cluster of this test's own on 127.0.0.1, whose one node offers
  # island 0's slot and not island 1's.
  ray.init(address="local", num_cpus=1, include_dashboard=False,
           configure_logging=False, _node_ip_address="127.0.0.1",
           resources={"diloco_island_0": 1})
  try:
    with pytest.raises(problems.ConfigError,
                       match=r"no node of the Ray cluster offers "
                       r"diloco_island_1 \(islands \[1\]") as error:
      driver.run(_run_config(config), str(tmp_path / "run"))
  finally:
    ray.shutdown()
  assert "\n" not in str(error.value)
  assert "ray start --resources='{\"diloco_island_1\": 1}'" in str(
      error.value)
  assert not (tmp_path / "run" / "config.json").exists()
