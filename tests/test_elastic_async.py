"""Asynchronous elastic rounds (config.elastic.asynchronous,
elastic/arrivals.py): each result applied the moment it arrives, scaled
by its share of a window's tokens, weighed down when overtaken; data
positions that count the steps of applied results only."""

import jax
import numpy as np
import pytest

from diloco_jax.codecs import dense as dense_codecs
from diloco_jax.config import problems
from diloco_jax.elastic import arrivals
from diloco_jax.elastic import coordinator as coordinator_lib
from diloco_jax.elastic import payloads
from diloco_jax.elastic import settings as settings_lib
from tests import test_elastic

_config = test_elastic._config  # pylint: disable=protected-access
_run_config = test_elastic._run_config  # pylint: disable=protected-access
_elastic = test_elastic._elastic  # pylint: disable=protected-access
_records = test_elastic._records  # pylint: disable=protected-access
_summary = test_elastic._summary  # pylint: disable=protected-access
namespace = test_elastic.namespace

_ASYNC = "--config.elastic.asynchronous=true"


@pytest.mark.parametrize("overrides,message", [
    ({"diloco.overlap": "one_step_delay"},
     "config.diloco.overlap='one_step_delay' with "
     "config.elastic.asynchronous=True: asynchronous islands never wait"),
    ({"diloco.overlap": "eager"}, "config.diloco.overlap='eager' with"),
    ({**test_elastic._STREAMING},  # pylint: disable=protected-access
     "config.diloco.fragments=2 with config.elastic.asynchronous=True"),
    ({"elastic.min_islands": 1},
     "config.elastic.min_islands=1 with config.elastic.asynchronous=True: "
     "no round closes on a quorum"),
    ({"elastic.grace_seconds": 2.0}, "config.elastic.grace_seconds=2.0 with"),
    ({"elastic.stale_rounds": 1}, "config.elastic.stale_rounds=1 with"),
])
def test_what_asynchronous_rounds_cannot_go_with_is_one_line(overrides,
                                                             message):
  overrides = {"elastic.asynchronous": True, **overrides}
  with pytest.raises(problems.ConfigError, match=message) as error:
    settings_lib.check(_run_config(_config(**overrides)))
  assert "\n" not in str(error.value)
  assert settings_lib.check(_run_config(_config(**{
      "elastic.asynchronous": True}))).asynchronous


def _moved(tree, rng):
  return jax.tree.map(
      lambda a: a + rng.normal(0, 0.01, a.shape).astype(a.dtype), tree)


@pytest.mark.parametrize("codec,outer", [("fp32", "sgd"), ("int8", "sgd"),
                                         ("fp32", "nesterov"),
                                         ("int8", "adam")])
def test_windows_of_results_applied_one_by_one_equal_rounds(codec, outer,
                                                            tmp_path):
  """Two windows, each of a result per island applied one by one (scaled
  by its share of the window's tokens, 3/4 and 1/4: island 0 trained 3
  times the tokens), move x where two synchronous rounds of the
  token-weighted mean of the same results move it: the second result of a
  window is applied to the x the first made (against the x its call
  started from), and the outer optimizer's state (Nesterov's momentum,
  Adam's moments) moves once a window, as a round's does. Sent as params
  (fp32) or as the pseudo-gradient the island encoded (int8). Sums in
  another order: 1e-6 (Adam's step divides by its second moment's root:
  1e-5)."""
  config = _config(**{"diloco.outer_optimizer.name": outer,
                      "diloco.outer_optimizer.learning_rate": (
                          1.0 if outer == "sgd" else 0.1),
                      "diloco.codec": codec})
  rng = np.random.default_rng(0)
  dense = dense_codecs.make_codec(codec, config.diloco.codec_block_size)
  one_by_one = coordinator_lib.Coordinator(_run_config(config),
                                           str(tmp_path / "async"))
  round_ = coordinator_lib.Coordinator(_run_config(config),
                                       str(tmp_path / "round"))
  for window in (1, 2):
    x = round_.x
    results = {}
    for i, (tokens, steps) in enumerate(((384, 3), (128, 1))):
      y = _moved(x, rng)
      sent = ({"params": y} if codec == "fp32" else
              {"payload": jax.device_get(
                  payloads.island_payload(x, y, None, dense)[0])})
      results[i] = {"round": window, "share": 1.0, "tokens": tokens,
                    "data_state": {"step": steps * window}, **sent}
    assert one_by_one.apply_arrival(0, results[0], x, 0.75,
                                    arrival=(window, 0))
    assert one_by_one.apply_arrival(1, results[1], x, 0.25,
                                    arrival=(window, 1))
    round_.close_round(results, window)
    assert one_by_one.rounds_done == window - 1  # a window: counted apart
    one_by_one.count_round()
    tolerance = 1e-5 if outer == "adam" else 1e-6
    for got, want in zip(jax.tree.leaves(one_by_one.x),
                         jax.tree.leaves(round_.x)):
      np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
  assert one_by_one.data_states == round_.data_states == [{"step": 6},
                                                          {"step": 2}]
  assert one_by_one.rounds_done == round_.rounds_done == 2
  one_by_one.close()
  round_.close()


def test_a_result_that_does_not_reach_x_keeps_its_island_s_position(
    tmp_path):
  """A non-finite result is left out: x and the island's data position
  stay where they were."""
  coordinator = coordinator_lib.Coordinator(_run_config(_config()),
                                            str(tmp_path))
  x = coordinator.x
  bad = jax.tree.map(lambda a: np.full_like(a, np.nan), x)
  assert not coordinator.apply_arrival(
      0, {"round": 1, "share": 1.0, "tokens": 128, "params": bad,
          "data_state": {"step": 4}}, x, 0.5, arrival=(1, 0))
  assert coordinator.data_states == [None, None]
  jax.tree.map(np.testing.assert_array_equal, coordinator.x, x)
  coordinator.close()


def _applied_steps(records) -> dict[int, int]:
  """island -> the inner steps of its results that reached x."""
  steps = {}
  for record in records:
    for arrival in record["arrivals"]:
      if arrival["applied"]:
        steps[arrival["island"]] = (steps.get(arrival["island"], 0)
                                    + arrival["steps"])
  return steps


@pytest.mark.slow
def test_unequal_islands_send_as_they_finish_and_keep_exact_positions(
    namespace, tmp_path):
  """Island 1 at a quarter of island 0's speed, calls budgeted in time,
  each result applied as it arrives: every window holds results (which
  ones depends on the machine's timing: a window closes on a round's
  island-steps, not on a result per member), island 1's calls take fewer
  steps and its results weigh less (their tokens), nothing is lost
  (goodput 1: the last window waits for the calls still running), and
  each island's data stream has moved by exactly the steps of its applied
  results."""
  workdir = str(tmp_path / "async")
  _elastic(namespace, workdir, _ASYNC, "--config.elastic.round_budget=time",
           "--config.testing.island_speeds=1,0.25")
  records = _records(workdir)
  assert [r["round"] for r in records] == [1, 2, 3]
  assert all(r["asynchronous"] for r in records)
  assert all(any(a["applied"] for a in r["arrivals"]) for r in records)
  arrivals = [a for r in records for a in r["arrivals"]]
  by_island = {i: [a for a in arrivals if a["island"] == i] for i in (0, 1)}
  assert by_island[0] and by_island[1]
  assert max(a["steps"] for a in by_island[1]) < 4
  assert all(a["steps"] <= 4 for a in arrivals)
  assert (np.mean([a["scale"] for a in by_island[0]])
          > np.mean([a["scale"] for a in by_island[1]]))
  summary = _summary(workdir)
  assert summary["rounds"] == 3 and summary["goodput"] == 1.0
  steps = _applied_steps(records)
  assert summary["data_states"] == [{"step": steps[i]} for i in (0, 1)]
  # Three windows of at least island 0's H and island 1's one step.
  assert sum(r["island_steps"]["applied"] for r in records) == sum(
      steps.values()) >= 3 * (4 + 1)


@pytest.mark.slow
def test_the_last_window_waits_for_a_slow_island_s_call(namespace, tmp_path):
  """Island 1 at a fiftieth of island 0's speed under round_budget
  'time': its calls of one step take longer than island 0's of H, so
  island 0's results can fill the last window while island 1's call
  still runs. The last window waits for it and applies it: no step run is
  lost (goodput 1), and each stream stands after exactly its applied
  steps."""
  workdir = str(tmp_path / "slow")
  _elastic(namespace, workdir, _ASYNC, "--config.elastic.round_budget=time",
           "--config.testing.island_speeds=1,0.02")
  records = _records(workdir)
  assert all(r["island_steps"]["run"] == r["island_steps"]["applied"]
             for r in records)
  summary = _summary(workdir)
  assert summary["goodput"] == 1.0
  steps = _applied_steps(records)
  assert summary["data_states"] == [{"step": steps[i]} for i in (0, 1)]
  assert steps[1] > 0


@pytest.mark.slow
def test_an_asynchronous_island_killed_mid_call_restarts_and_goes_on(
    namespace, tmp_path):
  """Island 1's process SIGKILLs itself during its first call (the one
  every member starts window 1 with): that call fails (recorded once, in
  whichever window it is seen), Ray restarts the process, whose next call
  starts from x on the batches after its last applied result (none); the
  run finishes its windows, the lost call's steps are the only ones that
  did not reach x, and each stream stands after exactly the applied
  steps."""
  workdir = str(tmp_path / "killed")
  _elastic(namespace, workdir, _ASYNC, "--config.testing.kill_island=1@1")
  records = _records(workdir)
  assert [r["round"] for r in records] == [1, 2, 3]
  assert [list(r["failed"]) for r in records if r["failed"]] == [["1"]]
  summary = _summary(workdir)
  # The lost call's H steps are the only ones run and not applied: the
  # last window waits for the calls still running.
  assert sum(r["island_steps"]["run"] - r["island_steps"]["applied"]
             for r in records) == 4
  assert summary["goodput"] < 1.0
  steps = _applied_steps(records)
  assert summary["data_states"] == [{"step": steps[i]} for i in (0, 1)]
  assert steps[1] % 4 == 0  # whole calls of H steps, none cut short
  restarts = [r["processes"]["1"]["restarts"] for r in records]
  assert restarts == sorted(restarts) and restarts[-1] == 1
