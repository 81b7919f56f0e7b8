"""One-step-delay overlap (config.diloco.overlap='one_step_delay').

The schedule: s_0 = s_1 = x_0; at the end of round r every island sends
d_i(r) = s_r - y_i, the outer step applies the mean that was in flight,
x_r = OuterOpt(x_{r-1}, D(r - 1)), and round r + 1 starts from s_{r+1} = x_r;
the last mean is applied when the run ends.

The rebasing variant ('one_step_delay_rebase') sends d_i(r) = a_i - y_i
against each island's anchor a_i and starts round r + 1 from
x_r + (y_i - a_i), its new anchor; an island left out of the mean starts
from x_r.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import tiny
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.algorithm import outer_settings
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import overlap as overlap_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.config import overlap_defaults
from diloco_jax.config import run_config
from diloco_jax.config import schema as config_schema
from diloco_jax.config import validation
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.run import train
from diloco_jax.telemetry import rising_loss
from tests import helpers
from tests import test_checkpoint

LR, MOMENTUM = 0.7, 0.9


def _nesterov(x, momentum, update):
  """optax.sgd(LR, MOMENTUM, nesterov=True), by hand."""
  momentum = update + MOMENTUM * momentum
  return x - LR * (update + MOMENTUM * momentum), momentum


def _islands_moved(start, deltas):
  """Island params as if each island trained to start - delta_i."""
  return jax.tree.map(lambda s, d: s[None] - d, start, deltas)


def _random_deltas(key, params, islands):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [
      0.01 * jax.random.normal(k, (islands,) + leaf.shape)
      for k, leaf in zip(keys, leaves)])


def _delayed_setup(islands, data=1, fsdp=False, compression=None,
                   error_feedback=False, overlap="one_step_delay",
                   eager_own_weight=None):
  params, _ = helpers.tiny_problem()
  params = jax.tree.map(np.array, params)
  inner_opt = optax.adam(1e-2)
  outer_opt = optax.sgd(LR, momentum=MOMENTUM, nesterov=True)
  mesh = mesh_lib.build_mesh(islands, data)
  state = outer_settings.init_state(params, inner_opt, outer_opt, islands,
                                    error_feedback, compression,
                                    overlap=overlap,
                                    eager_own_weight=eager_own_weight)
  shardings = state_lib.state_shardings(state, mesh, fsdp)
  state = jax.device_put(state, shardings)
  outer = outer_step_lib.make_outer_step(outer_opt, mesh, compression, fsdp=fsdp,
                                         inner_opt=inner_opt, overlap=overlap,
                                         eager_own_weight=eager_own_weight)
  flush = outer_step_lib.make_flush(outer_opt, mesh, fsdp)
  return params, mesh, shardings, state, outer, flush


def _weights(values, mesh):
  return jax.device_put(jnp.asarray(values, jnp.float32),
                        NamedSharding(mesh, P("island")))


def _set_islands(state, island_params, shardings):
  return jax.device_put(state.replace(island_params=island_params),
                        shardings)


@pytest.mark.parametrize("islands,data,fsdp", [
    (2, 1, False),  # one island per device slot
    (4, 1, False),  # folded: several islands per device (8 forced CPUs)
    (2, 2, True),   # sharded: each island's params split over 2 devices
])
def test_x_follows_the_hand_written_delayed_schedule(islands, data, fsdp):
  params, mesh, shardings, state, outer, flush = _delayed_setup(
      islands, data, fsdp)
  weights = np.array([1.0, 3.0, 2.0, 2.0][:islands])
  x = jax.tree.map(np.float32, params)
  momentum = jax.tree.map(np.zeros_like, x)
  in_flight = None  # s_0 = x_0; nothing in flight yet
  key = jax.random.key(0)
  for r in range(3):
    deltas = jax.tree.map(np.asarray, _random_deltas(
        jax.random.fold_in(key, r), params, islands))
    state = _set_islands(state, _islands_moved(
        jax.device_get(state.global_params), deltas), shardings)
    state = outer(state, _weights(weights, mesh))
    # By hand: d_i = s_r - y_i = delta_i, weighted by tokens.
    mean = jax.tree.map(
        lambda d: np.tensordot(weights / weights.sum(), d, axes=1), deltas)
    if in_flight is not None:  # D(r - 1) lands now
      pairs = jax.tree.map(lambda a, m, u: _nesterov(a, m, u), x, momentum,
                           in_flight)
      x = jax.tree.map(lambda p: p[0], pairs,
                       is_leaf=lambda t: isinstance(t, tuple))
      momentum = jax.tree.map(lambda p: p[1], pairs,
                              is_leaf=lambda t: isinstance(t, tuple))
    in_flight = mean
    helpers.assert_trees_close(state.global_params, x, rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(state.outer.in_flight, mean, rtol=1e-5,
                               atol=1e-7)
    # Round r + 1 starts from s_{r+1} = x_r on every island.
    helpers.assert_trees_close(
        state.island_params,
        jax.tree.map(lambda s: np.broadcast_to(s, (islands,) + s.shape),
                     jax.device_get(state.global_params)), rtol=0, atol=0)
    assert bool(state.outer.in_flight_valid)
    if r == 0:  # s_1 = x_0: the first round applies nothing
      helpers.assert_trees_close(state.global_params, params, rtol=0, atol=0)
  state = flush(state)
  x, _ = jax.tree.map(lambda a, m, u: _nesterov(a, m, u), x, momentum,
                      in_flight), None
  x = jax.tree.map(lambda p: p[0], x, is_leaf=lambda t: isinstance(t, tuple))
  helpers.assert_trees_close(state.global_params, x, rtol=1e-5, atol=1e-6)
  assert not bool(state.outer.in_flight_valid)
  helpers.assert_trees_close(
      state.outer.in_flight, jax.tree.map(np.zeros_like, x), rtol=0, atol=0)


def _nesterov_tree(x, momentum, update):
  pairs = jax.tree.map(_nesterov, x, momentum, update)
  first = lambda i: jax.tree.map(lambda p: p[i], pairs,
                                 is_leaf=lambda t: isinstance(t, tuple))
  return first(0), first(1)


@pytest.mark.parametrize("islands,data,fsdp", [
    (4, 1, False),  # folded: several islands per device
    (2, 2, True),   # sharded: each island's params split over 2 devices
])
def test_rebasing_keeps_each_islands_progress_by_hand(islands, data, fsdp):
  """3 rounds by hand: the islands' y, anchors and x, with an island left
  out of round 1 (weight 0) and one diverged in round 2."""
  params, mesh, shardings, state, outer, flush = _delayed_setup(
      islands, data, fsdp, overlap="one_step_delay_rebase")
  x = jax.tree.map(np.float32, params)
  momentum = jax.tree.map(np.zeros_like, x)
  anchors = jax.tree.map(
      lambda p: np.broadcast_to(p, (islands,) + p.shape), x)
  in_flight = None
  key = jax.random.key(0)
  for r in range(3):
    weights = np.array([1.0, 3.0, 2.0, 2.0][:islands])
    if r == 1:
      weights[1] = 0.0  # island 1's round is not synced
    deltas = jax.tree.map(np.asarray, _random_deltas(
        jax.random.fold_in(key, r), params, islands))
    # The islands train from where they are (their anchors).
    y = jax.tree.map(np.subtract, anchors, deltas)
    if r == 2:  # island 0 diverged
      y = jax.tree.map(lambda v: v.copy(), y)
      jax.tree.map(lambda v: v.__setitem__(0, np.nan), y)
    state = _set_islands(state, y, shardings)
    state = outer(state, _weights(weights, mesh))
    included = weights > 0
    if r == 2:
      included[0] = False
    w = np.where(included, weights, 0.0)
    # d_i = a_i - y_i = delta_i, weighted by tokens, left-out islands not.
    mean = jax.tree.map(lambda d: np.tensordot(
        w / w.sum(), np.where(included.reshape((-1,) + (1,) * (d.ndim - 1)),
                              d, 0.0), axes=1), deltas)
    if in_flight is not None:  # D(r - 1) lands now
      x, momentum = _nesterov_tree(x, momentum, in_flight)
    in_flight = mean
    # Each included island goes on from x_r plus its own progress; the
    # others from x_r alone.
    anchors = jax.tree.map(
        lambda x_, d: np.where(
            included.reshape((-1,) + (1,) * x_.ndim), x_[None] - d,
            np.broadcast_to(x_, d.shape)), x, deltas)
    helpers.assert_trees_close(state.global_params, x, rtol=1e-5, atol=1e-6)
    helpers.assert_trees_close(state.outer.in_flight, mean, rtol=1e-5,
                               atol=1e-7)
    helpers.assert_trees_close(state.island_params, anchors, rtol=1e-5,
                               atol=1e-6)
    jax.tree.map(np.testing.assert_array_equal,
                 jax.device_get(state.outer.anchors),
                 jax.device_get(state.island_params))
    if r == 0:  # s_1 = x_0: nothing lands in round 0, nothing is lost
      helpers.assert_trees_close(state.global_params, params, rtol=0, atol=0)
      helpers.assert_trees_close(state.island_params, y, rtol=0, atol=1e-7)
  state = flush(state)
  x, _ = _nesterov_tree(x, momentum, in_flight)
  helpers.assert_trees_close(state.global_params, x, rtol=1e-5, atol=1e-6)
  stacked = jax.tree.map(lambda v: np.broadcast_to(v, (islands,) + v.shape),
                         jax.device_get(state.global_params))
  for tree in (state.island_params, state.outer.anchors):
    helpers.assert_trees_close(tree, stacked, rtol=0, atol=0)
  assert not bool(state.outer.in_flight_valid)


def test_resizing_keeps_the_anchors_of_the_islands_that_stay():
  params, _ = helpers.tiny_problem()
  inner_opt = optax.adam(1e-2)
  state = outer_settings.init_state(params, inner_opt, optax.sgd(LR), 3,
                                    overlap="one_step_delay_rebase")
  moved = jax.tree.map(lambda a: a - 0.5, state.outer.anchors)
  state = state.replace(island_params=moved,
                        outer=state.outer.replace(anchors=moved))
  fewer = state_lib.resize_islands(state, 2, inner_opt)
  helpers.assert_trees_close(
      fewer.outer.anchors, jax.tree.map(lambda a: a[:2], moved), rtol=0, atol=0)
  more = state_lib.resize_islands(state, 5, inner_opt)
  helpers.assert_trees_close(
      more.outer.anchors, jax.tree.map(
          lambda a, x: jnp.concatenate([a, jnp.stack([x, x])]), moved,
          params), rtol=0, atol=0)
  # A new island's anchor is where it starts: its progress is zero.
  helpers.assert_trees_close(more.outer.anchors, more.island_params, rtol=0,
                             atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("codec,error_feedback", [
    ("int8", True), ("topk", True), ("adaptive_lowrank", True),
    ("int4", False)])
def test_every_codec_sends_the_same_mean_delayed_or_not(codec,
                                                        error_feedback):
  """The in-flight mean is what the codec's outer step averages at once,
  with the same residuals and codec state: the delay only moves when it is
  applied."""
  islands = 4
  settings = config_schema.base_config().diloco
  settings.codec, settings.codec_block_size = codec, 32
  settings.lowrank.min_rank, settings.lowrank.max_rank = 2, 4
  settings.topk_fraction = 0.1
  compression = run_config.compression(settings)
  params, mesh, shardings, delayed, outer, _ = _delayed_setup(
      islands, compression=compression, error_feedback=error_feedback)
  # The undelayed step with outer SGD lr 1 applies x - D: D is its mean.
  plain_opt = optax.sgd(1.0)
  plain = outer_settings.init_state(params, optax.adam(1e-2), plain_opt,
                                    islands, error_feedback, compression)
  plain_shardings = state_lib.state_shardings(plain, mesh)
  plain = jax.device_put(plain, plain_shardings)
  plain_outer = outer_step_lib.make_outer_step(plain_opt, mesh, compression)
  weights = _weights(np.ones(islands), mesh)
  for r in range(2):
    start = jax.device_get(delayed.global_params)
    moved = _islands_moved(start, _random_deltas(jax.random.key(r), params,
                                                 islands))
    delayed = _set_islands(delayed, moved, shardings)
    plain = jax.device_put(plain.replace(
        global_params=start, island_params=moved), plain_shardings)
    delayed = outer(delayed, weights)
    plain = plain_outer(plain, weights)
    sent = jax.tree.map(jnp.subtract, start,
                        jax.device_get(plain.global_params))
    helpers.assert_trees_close(delayed.outer.in_flight, sent, rtol=1e-5,
                               atol=1e-7)
    for name in ("residuals", "codec_state"):
      jax.tree.map(np.testing.assert_array_equal,
                   jax.device_get(getattr(delayed.outer, name)),
                   jax.device_get(getattr(plain.outer, name)))


def test_a_round_without_islands_sends_nothing_to_apply_next_round():
  islands = 2
  params, mesh, shardings, state, outer, flush = _delayed_setup(islands)
  state = _set_islands(state, _islands_moved(
      params, _random_deltas(jax.random.key(0), params, islands)), shardings)
  state = outer(state, _weights([0.0, 0.0], mesh))  # nobody synced round 0
  assert not bool(state.outer.in_flight_valid)
  deltas = _random_deltas(jax.random.key(1), params, islands)
  state = _set_islands(state, _islands_moved(params, deltas), shardings)
  outer_before = jax.device_get(state.outer.outer_opt_state)
  state = outer(state, _weights([1.0, 1.0], mesh))
  # Round 1 applies round 0's (empty) mean: x and the momentum stay.
  helpers.assert_trees_close(state.global_params, params, rtol=0, atol=0)
  jax.tree.map(np.testing.assert_array_equal,
               jax.device_get(state.outer.outer_opt_state), outer_before)
  assert bool(state.outer.in_flight_valid)
  state = flush(state)  # round 1's mean does land
  # x's first Nesterov step, on round 1's mean alone (the islands started
  # round 1 from x_0, and the momentum is still zero).
  x = jax.tree.map(lambda p, d: _nesterov(
      np.float32(p), np.zeros_like(p), np.asarray(d).mean(axis=0))[0],
                   params, deltas)
  helpers.assert_trees_close(state.global_params, x, rtol=1e-5, atol=1e-6)


def test_a_diverged_island_is_left_out_of_the_mean_in_flight():
  islands = 2
  params, mesh, shardings, state, outer, _ = _delayed_setup(islands)
  deltas = _random_deltas(jax.random.key(0), params, islands)
  moved = _islands_moved(params, deltas)
  moved = jax.tree.map(lambda y: y.at[1].set(jnp.nan), moved)
  state = outer(_set_islands(state, moved, shardings),
                _weights([1.0, 1.0], mesh))
  helpers.assert_trees_close(state.outer.in_flight,
                             jax.tree.map(lambda d: d[0], deltas),
                             rtol=1e-5, atol=1e-7)
  assert all(np.isfinite(leaf).all()
             for leaf in jax.tree.leaves(jax.device_get(state)))


# Runs.


def _config(**overrides):
  return helpers.with_overrides(tiny.get_config(), {
      "diloco.islands": 4, "total_steps": 12, "diloco.inner_steps": 3,
      "diloco.overlap": "one_step_delay", "checkpoint.every_steps": 2,
      "checkpoint.max_to_keep": 20, **overrides})


@pytest.mark.slow
def test_one_round_delayed_ends_where_plain_diloco_does(tmp_path):
  """With a single round the only update is applied at the end: the same
  x as plain DiLoCo's one outer step."""
  # The same outer step for both (each overlap has its own default).
  one_round = {"total_steps": 3, "diloco.outer_optimizer.learning_rate": 0.7,
               "diloco.outer_optimizer.momentum": 0.9}
  delayed = train.train_and_evaluate(_config(**one_round),
                                     str(tmp_path / "delayed"))
  plain = train.train_and_evaluate(
      _config(**one_round, **{"diloco.overlap": "none"}),
      str(tmp_path / "plain"))
  # The same arithmetic in two programs: XLA may fuse (and round) the
  # outer step's multiply-adds differently between them (the tests compile
  # at its fastest settings, tests/conftest.py): a few ulps.
  assert delayed["final_eval_loss"] == pytest.approx(
      plain["final_eval_loss"], rel=1e-6)
  helpers.assert_trees_close(
      test_checkpoint._final_state(str(tmp_path / "delayed"))[
          "global_params"],
      test_checkpoint._final_state(str(tmp_path / "plain"))["global_params"],
      rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_resume_with_an_update_in_flight_is_exact(tmp_path):
  """Killed at step 8, mid-round 3, while round 2's mean is in flight."""
  whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
  summary = train.train_and_evaluate(_config(), whole)
  assert summary["overlap"] == "one_step_delay"
  saved = test_checkpoint._final_state(whole)  # pylint: disable=protected-access
  assert not saved["outer"]["in_flight_valid"]  # the last mean was applied
  test_checkpoint.forget_after(whole, resumed, 8)
  train.train_and_evaluate(_config(), resumed)
  test_checkpoint._assert_identical_runs(whole, resumed)  # pylint: disable=protected-access


@pytest.mark.parametrize("overrides,message", [
    ({"diloco.overlap": "async"}, "config.diloco.overlap='async' is not one"),
    ({"mode": "ddp"}, "config.diloco.overlap='one_step_delay' overlaps"),
    ({"diloco.overlap": "eager", "diloco.fragments": 1,
      "diloco.fragment_delay": 1},
     "config.diloco.overlap='eager' and Streaming DiLoCo"),
    ({"diloco.eager_own_weight": 0.5},
     "eager_own_weight=0.5 weighs eager updates' own pseudo-gradient; "
     "config.diloco.overlap='one_step_delay' has none"),
    ({"diloco.overlap": "eager", "diloco.eager_own_weight": 1.5},
     r"eager_own_weight=1.5 must be in \(0, 1\]"),
    # The share rule has no weight of its own to set.
    ({"diloco.overlap": "eager_share", "diloco.eager_own_weight": 1.0},
     "config.diloco.overlap='eager_share' has none"),
])
def test_bad_overlap_settings_are_one_error(overrides, message):
  with pytest.raises(validation.ConfigError, match=message):
    validation.validate_config(_config(**overrides), num_devices=8)


# Outer-optimizer defaults per overlap mode.


@pytest.mark.parametrize("overlap", overlap_lib.OVERLAPS)
def test_unset_outer_settings_take_the_overlap_s_defaults(overlap):
  config = _config(**{"diloco.overlap": overlap})
  assert config.diloco.outer_optimizer.learning_rate is None
  resolved = validation.validate_config(config, num_devices=8).config
  outer = resolved.diloco.outer_optimizer
  assert (outer.learning_rate, outer.momentum) == (
      overlap_defaults.NESTEROV_DEFAULTS[overlap])
  # The caller's config is left as it was.
  assert config.diloco.outer_optimizer.learning_rate is None


def test_eager_takes_its_step_whatever_its_own_weight():
  config = _config(**{"diloco.overlap": "eager",
                      "diloco.eager_own_weight": 0.5})
  outer = validation.validate_config(config, num_devices=8).config.diloco \
      .outer_optimizer
  assert (outer.learning_rate, outer.momentum) == (
      overlap_defaults.NESTEROV_DEFAULTS["eager"])


def test_eager_waits_two_rounds_unless_set_and_the_share_none():
  warmup = lambda overlap, **set_: overlap_defaults.warmup_rounds(_config(**{
      "diloco.overlap": overlap, **set_}).diloco)
  assert warmup("eager") == overlap_defaults.WARMUP_ROUNDS_DEFAULTS["eager"]
  assert warmup("eager", **{"diloco.overlap_warmup_rounds": 0}) == 0
  assert warmup("eager_share") == 0
  assert warmup("eager_share", **{"diloco.overlap_warmup_rounds": 3}) == 3
  assert warmup("one_step_delay") == 0
  # A config written before the field (a saved config.json) ran without.
  old = _config(**{"diloco.overlap": "eager"}).diloco
  with old.unlocked():
    del old["overlap_warmup_rounds"]
  assert overlap_defaults.warmup_rounds(old) == 0


def test_eager_s_own_weight_is_one_unless_set_and_the_share_has_none():
  own_weight = lambda mode, weight: getattr(
      outer_overlaps.from_mode(mode, weight), "own_weight", None)
  assert own_weight("eager", None) == 1.0
  assert own_weight("eager", 0.5) == 0.5
  assert own_weight("eager_share", None) is None
  assert own_weight("one_step_delay", None) is None


def test_outer_settings_a_config_sets_are_kept():
  config = _config(**{"diloco.outer_optimizer.learning_rate": 0.3})
  outer = validation.validate_config(config, num_devices=8).config.diloco \
      .outer_optimizer
  # The set lr stays; the unset momentum takes the delay's default.
  assert (outer.learning_rate, outer.momentum) == (
      0.3, overlap_defaults.NESTEROV_DEFAULTS["one_step_delay"][1])


def test_a_rising_eval_loss_under_an_overlap_warns_once(caplog):
  outer = config_schema.base_config().diloco.outer_optimizer
  outer.learning_rate, outer.momentum = 0.7, 0.9
  losses = [3.0, 2.8, 2.9, 3.0, 3.1, 3.2, 3.3]
  with caplog.at_level("WARNING"):
    watch = rising_loss.RisingLossWatch("one_step_delay", outer)
    for step, loss in enumerate(losses):
      watch.observe(step, loss)
    quiet = rising_loss.RisingLossWatch("none", outer)
    for step, loss in enumerate(losses):
      quiet.observe(step, loss)
  warnings = [r.getMessage() for r in caplog.records
              if "rose 3 evaluations in a row" in r.getMessage()]
  assert len(warnings) == 1
  assert "overlap='one_step_delay'" in warnings[0]
  assert "momentum 0.9" in warnings[0]
  assert watch.warned and not quiet.warned


def test_a_falling_then_flat_eval_loss_does_not_warn():
  outer = config_schema.base_config().diloco.outer_optimizer
  watch = rising_loss.RisingLossWatch("eager", outer)
  for step, loss in enumerate([3.0, 3.1, 3.2, 3.1, 3.2, 3.3, 3.3]):
    watch.observe(step, loss)
  assert not watch.warned
