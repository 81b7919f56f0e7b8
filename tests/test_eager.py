"""Eager updates (config.diloco.overlap='eager' and 'eager_share').

The rule (algorithm/overlap.py): island m sends d_m(r) = x_m(r-1) - y_m
against its own outer point and steps that point with its own outer state
at once on D~_m(r) = D(r-1) - u_m(r-1) + u_m(r), u_m(r) = c d_m(r) ('eager',
c = config.diloco.eager_own_weight, 1 unless set) or w_m d_m(r) / sum_j w_j
('eager_share'); it starts round r + 1 from x_m(r). At the end of the run the
last mean lands, each island steps on its rest D(R) - u_m(R), and x is the
islands' average point (their outer states averaged too).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_jax.algorithm import outer_settings
from diloco_jax.algorithm import state as state_lib
from diloco_jax.config import validation
from diloco_jax.run import train
from diloco_jax.storage import warm_start
from tests import helpers
from tests import test_checkpoint
from tests import test_overlap

_nesterov_tree = test_overlap._nesterov_tree  # pylint: disable=protected-access


def _per_island(tree, m):
  return jax.tree.map(lambda v: v[m], tree)


def _stack(trees):
  return jax.tree.map(lambda *v: np.stack(v), *trees)


@pytest.mark.parametrize("islands,data,fsdp,overlap,own_weight", [
    (2, 1, False, "eager_share", None),  # one island per device slot
    (4, 1, False, "eager_share", None),  # folded: several per device
    (2, 2, True, "eager", None),  # sharded: params split over 2 devices
    (4, 1, False, "eager", 0.5),  # config.diloco.eager_own_weight
])
def test_eager_follows_the_hand_written_rule(islands, data, fsdp, overlap,
                                             own_weight):
  """3 rounds in plain numpy: every island's outer point, outer state and
  share, and x, with an island left out of round 1 (weight 0) and one
  diverged in round 2. Float32 sums in another order: rtol 1e-5."""
  params, mesh, shardings, state, outer, flush = test_overlap._delayed_setup(  # pylint: disable=protected-access
      islands, data, fsdp, overlap=overlap, eager_own_weight=own_weight)
  x = jax.tree.map(np.float32, params)
  momentum = jax.tree.map(np.zeros_like, x)
  points = [x] * islands  # x_m
  momenta = [momentum] * islands
  shares = [jax.tree.map(np.zeros_like, x)] * islands  # u_m
  landed = None  # D(r - 1)
  key = jax.random.key(0)
  for r in range(3):
    weights = np.array([1.0, 3.0, 2.0, 2.0][:islands])
    if r == 1:
      weights[1] = 0.0  # island 1's round is not synced
    deltas = jax.tree.map(np.asarray, test_overlap._random_deltas(  # pylint: disable=protected-access
        jax.random.fold_in(key, r), params, islands))
    # Each island trains from its own outer point.
    y = jax.tree.map(lambda *v: np.stack(v), *[
        jax.tree.map(np.subtract, points[m], _per_island(deltas, m))
        for m in range(islands)])
    if r == 2:  # island 0 diverged
      y = jax.tree.map(lambda v: v.copy(), y)
      jax.tree.map(lambda v: v.__setitem__(0, np.nan), y)
    state = test_overlap._set_islands(state, y, shardings)  # pylint: disable=protected-access
    state = outer(state, test_overlap._weights(weights, mesh))  # pylint: disable=protected-access
    sends = weights > 0
    if r == 2:
      sends[0] = False
    # The shares use the weights every island knows before the
    # collective (or the own weight); the mean is over the islands that
    # took part.
    own = (weights / weights.sum() if overlap == "eager_share"
           else np.full(islands, 1.0 if own_weight is None else own_weight))
    new_shares = [jax.tree.map(
        lambda d, m=m: (own[m] * d[m] if sends[m]
                        else np.zeros_like(d[m])), deltas)
                  for m in range(islands)]
    w = np.where(sends, weights, 0.0)
    mean = jax.tree.map(lambda d: np.tensordot(
        w / w.sum(), np.where(sends.reshape((-1,) + (1,) * (d.ndim - 1)),
                              d, 0.0), axes=1), deltas)
    for m in range(islands):
      update = new_shares[m]
      if landed is not None:
        update = jax.tree.map(lambda a, b, c: a - b + c, landed, shares[m],
                              update)
      # Nothing to apply (exactly zero): no step, momentum alone would
      # move the point (island 0 in round 2: diverged, and in round 1 it
      # was the mean alone).
      if any(np.any(u != 0) for u in jax.tree.leaves(update)):
        points[m], momenta[m] = _nesterov_tree(points[m], momenta[m], update)
    shares, landed = new_shares, mean
    # x is not formed in a round.
    helpers.assert_trees_close(state.global_params, x, rtol=0, atol=0)
    # The islands send their points less their y, in float32: each point's
    # own rounding (below, to 1e-6 of |x| <= ~1) reaches the mean and the
    # shares.
    helpers.assert_trees_close(state.outer.in_flight, mean, rtol=1e-5,
                               atol=1e-6)
    helpers.assert_trees_close(state.outer.anchors, _stack(points), rtol=1e-5,
                               atol=1e-6)
    helpers.assert_trees_close(state.outer.own_shares, _stack(shares),
                               rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(state.outer.outer_opt_state[0].trace,
                               _stack(momenta), rtol=1e-5, atol=1e-6)
    # Every island starts the next round from its own point.
    jax.tree.map(np.testing.assert_array_equal,
                 jax.device_get(state.outer.anchors),
                 jax.device_get(state.island_params))
  state = flush(state)
  # The rest of the last mean, then the islands' average.
  for m in range(islands):
    rest = jax.tree.map(np.subtract, landed, shares[m])
    if any(np.any(u != 0) for u in jax.tree.leaves(rest)):
      points[m], momenta[m] = _nesterov_tree(points[m], momenta[m], rest)
  x = jax.tree.map(lambda v: v.mean(0), _stack(points))
  momentum = jax.tree.map(lambda v: v.mean(0), _stack(momenta))
  helpers.assert_trees_close(state.global_params, x, rtol=1e-5, atol=1e-6)
  stacked = jax.tree.map(lambda v: np.broadcast_to(v, (islands,) + v.shape),
                         jax.device_get(state.global_params))
  for tree in (state.island_params, state.outer.anchors):
    helpers.assert_trees_close(tree, stacked, rtol=0, atol=0)
  helpers.assert_trees_close(
      state.outer.outer_opt_state[0].trace,
      jax.tree.map(lambda v: np.broadcast_to(v, (islands,) + v.shape),
                   momentum), rtol=1e-5, atol=1e-6)
  assert not bool(state.outer.in_flight_valid)
  assert not any(np.any(leaf) for leaf in jax.tree.leaves(
      jax.device_get(state.outer.own_shares)))
  assert all(np.isfinite(leaf).all()
             for leaf in jax.tree.leaves(jax.device_get(state)))


def test_islands_that_join_start_from_the_islands_average():
  """Resizing an eager state: islands that stay keep their points, outer
  states and shares; new ones start from the kept islands' average point
  and outer state, with nothing in flight."""
  params, _ = helpers.tiny_problem()
  inner_opt = optax.adam(1e-2)
  outer_opt = optax.sgd(0.7, momentum=0.9, nesterov=True)
  state = outer_settings.init_state(params, inner_opt, outer_opt, 2,
                                    overlap="eager")
  moved = jax.tree.map(lambda a: a + jnp.arange(2.0).reshape(
      (2,) + (1,) * (a.ndim - 1)), state.outer.anchors)
  state = state.replace(island_params=moved, outer=state.outer.replace(
      anchors=moved,
      own_shares=jax.tree.map(jnp.ones_like, state.outer.own_shares)))
  more = state_lib.resize_islands(state, 3, inner_opt)
  average = jax.tree.map(lambda a: a.mean(0), moved)
  helpers.assert_trees_close(_per_island(more.outer.anchors, 2), average,
                             rtol=1e-6, atol=1e-6)
  helpers.assert_trees_close(_per_island(more.island_params, 2), average,
                             rtol=1e-6, atol=1e-6)
  helpers.assert_trees_close(
      jax.tree.map(lambda a: a[:2], more.outer.anchors), moved, rtol=0, atol=0)
  assert not any(np.any(np.asarray(leaf)[2]) for leaf in
                 jax.tree.leaves(more.outer.own_shares))
  assert all(np.all(np.asarray(leaf)[:2] == 1) for leaf in
             jax.tree.leaves(more.outer.own_shares))
  # Evaluated mid-run, x is the islands' average point.
  helpers.assert_trees_close(
      state_lib.evaluation_params(state, "diloco"), average, rtol=1e-6,
      atol=1e-6)


# Runs.


def _config(**overrides):
  # The rule from the first round: the warm-up has a test of its own.
  return test_overlap._config(**{  # pylint: disable=protected-access
      "diloco.overlap": "eager", "diloco.overlap_warmup_rounds": 0,
      **overrides})


@pytest.mark.slow
def test_one_island_eager_is_diloco_without_overlap(tmp_path):
  """With one island D(r-1) - u(r-1) is exactly 0 and u(r) is exactly the
  mean DiLoCo applies at once (checked bit for bit each round): the island
  trains through DiLoCo's points, and the last mean lands in x at the end.

  The two outer steps are different XLA programs, which fuse the
  optimizer's multiply-adds differently (one rounding or two): x and the
  momentum drift by an ulp per round (measured 6e-8 after 3 rounds), so
  the run is compared to 1e-6 in its losses and 1e-5 in its state."""
  # The same outer step for both (each overlap has its own default).
  one = {"diloco.islands": 1, "diloco.outer_optimizer.learning_rate": 0.7,
         "diloco.outer_optimizer.momentum": 0.9}
  eager = train.train_and_evaluate(_config(**one), str(tmp_path / "eager"))
  plain = train.train_and_evaluate(
      _config(**one, **{"diloco.overlap": "none"}), str(tmp_path / "plain"))
  np.testing.assert_allclose(eager["final_eval_loss"],
                             plain["final_eval_loss"], rtol=1e-6)
  eager_state = test_checkpoint._final_state(str(tmp_path / "eager"))  # pylint: disable=protected-access
  plain_state = test_checkpoint._final_state(str(tmp_path / "plain"))  # pylint: disable=protected-access
  for field in ("global_params", "island_params", "inner_opt_state"):
    helpers.assert_trees_close(eager_state[field], plain_state[field],
                               rtol=1e-5, atol=1e-6)
  # Eager updates keep the one island's outer state, [1, ...].
  helpers.assert_trees_close(
      jax.tree.map(lambda a: a[0], eager_state["outer"]["outer_opt_state"]),
      plain_state["outer"]["outer_opt_state"], rtol=1e-5, atol=1e-6)
  losses = lambda run: [record["train_loss"] for record in
                        test_checkpoint._metrics(str(tmp_path / run))]  # pylint: disable=protected-access
  np.testing.assert_allclose(losses("eager"), losses("plain"), rtol=1e-6)


@pytest.mark.slow
def test_eager_at_averaging_is_the_rebasing_delay(tmp_path):
  """Eager (an own weight of 1 by default) under outer averaging (lr 1,
  momentum 0): island m starts round r + 1 from x_m(r) = x(r-1) - d_m(r),
  where the rebasing delay starts it (x_r plus its own progress), and both
  end at x(R).

  The same sums in another order in two programs, over 4 rounds of
  training that carry each rounding on: compared to 1e-5."""
  averaging = {"diloco.outer_optimizer.learning_rate": 1.0,
               "diloco.outer_optimizer.momentum": 0.0}
  eager = train.train_and_evaluate(_config(**averaging),
                                   str(tmp_path / "eager"))
  rebase = train.train_and_evaluate(
      _config(**averaging, **{"diloco.overlap": "one_step_delay_rebase"}),
      str(tmp_path / "rebase"))
  np.testing.assert_allclose(eager["final_eval_loss"],
                             rebase["final_eval_loss"], rtol=1e-5)
  losses = lambda run: [record["train_loss"] for record in
                        test_checkpoint._metrics(str(tmp_path / run))]  # pylint: disable=protected-access
  np.testing.assert_allclose(losses("eager"), losses("rebase"), rtol=1e-5)
  helpers.assert_trees_close(
      test_checkpoint._final_state(str(tmp_path / "eager"))["global_params"],  # pylint: disable=protected-access
      test_checkpoint._final_state(str(tmp_path / "rebase"))["global_params"],  # pylint: disable=protected-access
      rtol=1e-5, atol=1e-6)


def test_the_single_worker_pretraining_of_an_eager_run_is_valid():
  config = _config(**{"diloco.eager_own_weight": 0.5, "pretrain_steps": 3})
  pretrain = warm_start.pretrain_config(config)
  assert pretrain.diloco.eager_own_weight is None
  validation.validate_config(pretrain, num_devices=8)


def test_one_island_s_eager_update_is_its_mean_bit_for_bit():
  """Each round, the one island's update D~ = D(r-1) - u(r-1) + u(r) is
  the mean of its round to the last bit (what DiLoCo applies at once)."""
  params, mesh, shardings, state, outer, _ = test_overlap._delayed_setup(  # pylint: disable=protected-access
      1, overlap="eager")
  weights = test_overlap._weights([3.0], mesh)  # pylint: disable=protected-access
  for r in range(3):
    start = jax.tree.map(lambda a: a[0], jax.device_get(state.outer.anchors))
    y = jax.tree.map(np.asarray, test_overlap._islands_moved(  # pylint: disable=protected-access
        start, test_overlap._random_deltas(jax.random.key(r), params, 1)))  # pylint: disable=protected-access
    state = outer(test_overlap._set_islands(state, y, shardings), weights)  # pylint: disable=protected-access
    jax.tree.map(np.testing.assert_array_equal,
                 jax.tree.map(lambda v: v[None], jax.device_get(
                     state.outer.in_flight)),
                 jax.device_get(state.outer.own_shares))


@pytest.mark.slow
@pytest.mark.parametrize("warmup,killed_at", [
    (0, 8),  # mid-round 3: round 2's mean in flight
    (2, 5),  # mid-round 2, which still waits for its mean when resumed
])
def test_resume_with_a_mean_in_flight_is_exact(tmp_path, warmup, killed_at):
  """Killed mid-round with a mean in flight, the islands' own points,
  outer states and shares saved; the resumed run ends where the whole one
  does, bit for bit (in the warm-up too: it is counted by the saved
  round)."""
  config = lambda: _config(**{"diloco.overlap_warmup_rounds": warmup})
  whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
  summary = train.train_and_evaluate(config(), whole)
  assert summary["overlap"] == "eager"
  test_checkpoint.forget_after(whole, resumed, killed_at)
  saved = test_checkpoint._final_state(resumed)  # pylint: disable=protected-access
  assert saved["outer"]["in_flight_valid"]
  train.train_and_evaluate(config(), resumed)
  test_checkpoint._assert_identical_runs(whole, resumed)  # pylint: disable=protected-access


@pytest.mark.slow
def test_warmup_rounds_run_as_diloco_without_overlap(tmp_path):
  """config.diloco.overlap_warmup_rounds: the run's first rounds wait for
  their own mean. With all 4 rounds waiting, eager is DiLoCo without
  overlap at the same outer step; with 2, the first 2 rounds' losses are
  DiLoCo's and the rounds after them eager's.

  The same arithmetic in different XLA programs (the outer step's
  multiply-adds fused differently, an ulp a round), carried through
  training: losses to 1e-6, the state to 1e-5."""
  step = {"diloco.outer_optimizer.learning_rate": 0.7,
          "diloco.outer_optimizer.momentum": 0.9}
  runs = {"plain": {"diloco.overlap": "none"},
          "all": {"diloco.overlap_warmup_rounds": 4},
          "half": {"diloco.overlap_warmup_rounds": 2}}
  summaries = {name: train.train_and_evaluate(
      _config(**step, **overrides), str(tmp_path / name))
               for name, overrides in runs.items()}
  np.testing.assert_allclose(summaries["all"]["final_eval_loss"],
                             summaries["plain"]["final_eval_loss"], rtol=1e-6)
  helpers.assert_trees_close(
      test_checkpoint._final_state(str(tmp_path / "all"))["global_params"],  # pylint: disable=protected-access
      test_checkpoint._final_state(str(tmp_path / "plain"))["global_params"],  # pylint: disable=protected-access
      rtol=1e-5, atol=1e-6)
  losses = {name: np.array([record["train_loss"] for record in
                            test_checkpoint._metrics(str(tmp_path / name))])  # pylint: disable=protected-access
            for name in runs}
  np.testing.assert_allclose(losses["all"], losses["plain"], rtol=1e-6)
  # 3 inner steps a round: round 3 (steps 7-9) still starts from the
  # waited-for mean of round 2, and round 4 is the first to start from the
  # islands' own points (without warm-up round 2 would: its losses would
  # leave plain DiLoCo's from step 4).
  np.testing.assert_allclose(losses["half"][:9], losses["plain"][:9],
                             rtol=1e-6)
  assert np.max(np.abs(losses["half"][9:] - losses["plain"][9:])) > 1e-4


@pytest.mark.parametrize("overrides,message", [
    ({"diloco.overlap": "one_step_delay"}, "is not 'eager' or 'eager_share'"),
    ({"diloco.overlap_warmup_rounds": -1}, "must be a whole number"),
])
def test_warmup_rounds_are_refused_where_they_do_not_apply(overrides,
                                                           message):
  config = _config(**{"diloco.overlap_warmup_rounds": 2, **overrides})
  with pytest.raises(validation.ConfigError, match=message):
    validation.validate_config(config, num_devices=8)
