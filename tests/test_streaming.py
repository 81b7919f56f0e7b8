"""Streaming DiLoCo: fragments, their staggered schedule, send and merge."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import tiny
from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import fragments
from diloco_jax.algorithm import library
from diloco_jax.algorithm import outer_settings
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import schedule
from diloco_jax.algorithm import state as state_lib
from diloco_jax.config import run_config
from diloco_jax.config import schema as config_schema
from diloco_jax.config import validation
from diloco_jax.model import transformer as model_lib
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.run import train
from tests import helpers
from tests import test_checkpoint


def _model_params(num_layers=4):
  config = helpers.tiny_model_config()
  config.num_layers = num_layers
  return model_lib.param_shapes(config)


def test_fragments_are_consecutive_blocks_of_equal_count():
  params = _model_params(num_layers=6)
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(params)[0]]
  for num_fragments in (1, 2, 3, 6):
    assignment = fragments.leaf_fragments(params, num_fragments)
    blocks = {}
    for path, fragment in zip(paths, assignment):
      if path.startswith("['blocks']"):
        blocks.setdefault(int(path.split("[")[2].rstrip("]")), set()).add(
            fragment)
      elif "embed" in path:
        assert fragment == 0, path
      else:
        assert fragment == num_fragments - 1, path
    # A block never straddles fragments; fragments hold 6 / P blocks each,
    # in order.
    owner = [blocks[i].pop() for i in range(6) if len(blocks[i]) == 1]
    assert len(owner) == 6
    assert owner == sorted(owner)
    assert [owner.count(f) for f in range(num_fragments)] == (
        [6 // num_fragments] * num_fragments)
  with pytest.raises(ValueError, match="7 fragments need 1 to 6"):
    fragments.leaf_fragments(params, 7)


@pytest.mark.parametrize("inner_steps,num_fragments,delay,total", [
    (4, 2, 0, 16), (4, 2, 1, 18), (6, 3, 4, 25), (5, 5, 2, 20),
    (8, 1, 3, 19)])
def test_every_fragment_syncs_once_per_round_at_its_offset(
    inner_steps, num_fragments, delay, total):
  plan = schedule.Schedule("diloco", inner_steps, total,
                           fragments=num_fragments, fragment_delay=delay,
                           streaming=True)
  sends = {p: [] for p in range(num_fragments)}
  merges = {p: [] for p in range(num_fragments)}
  for step in range(1, total + 1):
    for action in plan.after(step):
      {schedule.SEND: sends, schedule.MERGE: merges}[action.kind][
          action.fragment].append(step)
  for p in range(num_fragments):
    offset = p * inner_steps // num_fragments
    regular = [t for t in sends[p] if t != total]
    # Once per H steps, at the fragment's own offset, staggered by H / P.
    assert regular == list(range(offset or inner_steps, total, inner_steps))
    assert sends[p][-1] == total  # the last step syncs every fragment
    # Every send is merged exactly once, tau steps later (at once at the
    # end), before the fragment's next send.
    assert len(merges[p]) == len(sends[p])
    for sent, merged in zip(sends[p], merges[p]):
      assert merged == min(sent + delay, total)
    for merged, next_send in zip(merges[p], sends[p][1:]):
      assert merged <= next_send
  # Offsets are distinct: one fragment's bytes cross the link at a time.
  regular_steps = [t for p in sends for t in sends[p] if t != total]
  assert len(regular_steps) == len(set(regular_steps))


def _state(islands, compression=None, error_feedback=False, num_fragments=1,
           num_layers=2):
  params = jax.tree.map(np.array, model_lib.new_params(
      _model_config(num_layers), 0))
  inner_opt = optax.adam(1e-2)
  outer_opt = optax.sgd(0.7, momentum=0.9, nesterov=True)
  state = outer_settings.init_state(params, inner_opt, outer_opt, islands,
                                    error_feedback, compression)
  return params, inner_opt, outer_opt, state


def _streaming(state, params, inner_opt, outer_opt, compression,
               num_fragments, seed=0):
  """`state`'s islands and x under a streaming outer object of
  `num_fragments` (its outer state one per fragment), as a run makes it."""
  outer = library.diloco(outer_opt, compression,
                         library.streaming(num_fragments),
                         error_feedback=state.outer.residuals is not None)
  return state.replace(outer=state_lib.init_state(
      params, inner_opt, outer, state_lib.num_islands(state),
      seed=seed).outer), outer


def _model_config(num_layers):
  config = helpers.tiny_model_config()
  config.num_layers = num_layers
  return config


def moved_islands(state, key, shardings):
  """The islands moved away from x by random amounts."""
  leaves, treedef = jax.tree.flatten(state.island_params)
  keys = jax.random.split(key, len(leaves))
  moved = [y - 0.01 * jax.random.normal(k, y.shape)
           for k, y in zip(keys, leaves)]
  return jax.device_put(
      state.replace(island_params=jax.tree.unflatten(treedef, moved)),
      shardings)


def _compression(codec):
  settings = config_schema.base_config().diloco
  settings.codec, settings.codec_block_size = codec, 32
  settings.lowrank.min_rank, settings.lowrank.max_rank = 2, 4
  if codec == "sparseloco":  # its own codec, chosen with its outer mode
    settings.codec, settings.outer_optimizer.name = "fp32", codec
    settings.sparseloco.chunk_size = 64
  return run_config.compression(settings)


@pytest.mark.slow
@pytest.mark.parametrize("codec,error_feedback", [
    ("fp32", False), ("int8", True), ("adaptive_lowrank", True)])
def test_one_fragment_without_delay_or_blend_is_diloco(codec, error_feedback):
  islands = 4
  compression = _compression(codec)
  params, inner_opt, outer_opt, plain = _state(islands, compression,
                                               error_feedback)
  plain = jax.tree.map(np.array, jax.device_get(plain))  # own buffers each
  mesh = mesh_lib.build_mesh(islands)
  streaming, streaming_outer = _streaming(plain, params, inner_opt,
                                          outer_opt, compression, 1)
  plain_shardings = state_lib.state_shardings(plain, mesh)
  streaming_shardings = state_lib.state_shardings(streaming, mesh)
  plain = jax.device_put(plain, plain_shardings)
  streaming = jax.device_put(streaming, streaming_shardings)
  outer = outer_step_lib.make_outer_step(outer_opt, mesh, compression,
                                         inner_opt=inner_opt)
  send = fragments.make_fragment_send(streaming_outer, mesh, 0)
  merge = fragments.make_fragment_merge(mesh, 1, 0, alpha=0.0,
                                        inner_opt=inner_opt)
  weights = jax.device_put(jnp.array([1.0, 2.0, 1.0, 3.0]),
                           NamedSharding(mesh, P("island")))
  for r in range(3):
    key = jax.random.key(r)
    plain = outer(moved_islands(plain, key, plain_shardings), weights)
    streaming = merge(send(moved_islands(streaming, key, streaming_shardings),
                           weights))
    for name in ("global_params", "island_params", "residuals",
                 "codec_state", "outer_opt_state", "inner_opt_state"):
      a, b = (jax.tree.leaves(jax.device_get(
          getattr(s.outer if hasattr(s.outer, name) else s, name)))
              for s in (plain, streaming))
      assert len(a) == len(b), name
      # The same arithmetic in two programs: XLA may fuse (and round) the
      # optimizers' multiply-adds differently between them (the tests
      # compile at its fastest settings, tests/conftest.py), a few ulps
      # of params ~0.1-0.5 after 3 rounds.
      for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7,
                                   err_msg=name)


@pytest.mark.slow
def test_a_send_touches_only_its_fragment_and_a_merge_blends():
  islands, num_fragments, alpha = 2, 2, 0.25
  params, inner_opt, outer_opt, state = _state(
      islands, _compression("int8"), error_feedback=True, num_layers=4)
  state, outer = _streaming(state, params, inner_opt, outer_opt,
                            _compression("int8"), num_fragments)
  mesh = mesh_lib.build_mesh(islands)
  shardings = state_lib.state_shardings(state, mesh)
  state = moved_islands(jax.device_put(state, shardings), jax.random.key(0),
                        shardings)
  assignment = fragments.leaf_fragments(params, num_fragments)
  before = jax.device_get(state)
  send = fragments.make_fragment_send(outer, mesh, 1)
  merge = fragments.make_fragment_merge(mesh, num_fragments, 1, alpha,
                                        inner_opt=inner_opt)
  weights = jax.device_put(jnp.ones(islands), NamedSharding(mesh, P("island")))
  sent = jax.device_get(send(state, weights))
  changed = lambda a, b: [not np.array_equal(x, y) for x, y in zip(
      jax.tree.leaves(a), jax.tree.leaves(b))]
  in_fragment = [f == 1 for f in assignment]
  assert changed(sent.global_params, before.global_params) == in_fragment
  assert changed(sent.outer.residuals, before.outer.residuals) == in_fragment
  assert not any(changed(sent.island_params, before.island_params))
  np.testing.assert_equal(jax.device_get(sent.outer.outer_opt_state[0]),
                          before.outer.outer_opt_state[0])
  merged = jax.device_get(merge(jax.device_put(sent, shardings)))
  for x, y, new_y, f in zip(jax.tree.leaves(sent.global_params),
                            jax.tree.leaves(sent.island_params),
                            jax.tree.leaves(merged.island_params),
                            assignment):
    expected = alpha * y + (1 - alpha) * x[None] if f == 1 else y
    np.testing.assert_allclose(new_y, expected, rtol=1e-6, atol=1e-7)


# Runs.


def _config(**overrides):
  return helpers.with_overrides(tiny.get_config(), {
      "model.num_layers": 2, "diloco.islands": 4, "total_steps": 12,
      "diloco.inner_steps": 4, "diloco.fragments": 2,
      "diloco.fragment_delay": 1, "diloco.fragment_alpha": 0.5,
      "checkpoint.every_steps": 1, "checkpoint.max_to_keep": 20,
      **overrides})


@pytest.mark.slow
def test_a_streaming_run_counts_each_fragments_bytes(tmp_path):
  summary = train.train_and_evaluate(_config(), str(tmp_path / "run"))
  assert summary["fragments"] == 2 and np.isfinite(summary["final_eval_loss"])
  records = test_checkpoint._metrics(str(tmp_path / "run"))  # pylint: disable=protected-access
  params = model_lib.param_shapes(_config().model)
  assignment = fragments.leaf_fragments(params, 2)
  fp32 = compression_lib.as_compression(None)
  fragment_bytes = [compression_lib.mean_bytes(
      fragments.select(params, assignment, p), 4, fp32) for p in (0, 1)]
  # Fragment 1 at steps 2, 6, 10; fragment 0 at 4, 8; both at 12.
  expected, total = {}, 0
  for step in range(1, 13):
    total += sum(fragment_bytes[p] for p in (
        [0, 1] if step == 12 else [1] if step % 4 == 2 else
        [0] if step % 4 == 0 else []))
    expected[step] = total
  assert {r["step"]: r["comm_bytes"] for r in records} == expected
  # The peak: one fragment's bytes, not the model's.
  assert max(fragment_bytes) < 0.75 * sum(fragment_bytes)


@pytest.mark.slow
def test_resume_with_a_fragment_in_flight_is_exact(tmp_path):
  stop_after = 6  # fragment 1 was sent at step 6 and merges at step 7
  whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
  config = lambda: _config(**{"diloco.codec": "int8",
                              "diloco.error_feedback": True})
  train.train_and_evaluate(config(), whole)
  test_checkpoint.forget_after(whole, resumed, stop_after)
  train.train_and_evaluate(config(), resumed)
  test_checkpoint._assert_identical_runs(whole, resumed)  # pylint: disable=protected-access


@pytest.mark.parametrize("overrides,message", [
    ({"diloco.fragments": 3}, "fragments=3 exceeds config.model.num_layers"),
    ({"diloco.fragments": 2, "diloco.inner_steps": 1, "total_steps": 4},
     "exceeds config.diloco.inner_steps=1"),
    ({"diloco.fragment_delay": 4}, "fragment_delay=4 must be an integer in"),
    ({"diloco.fragment_alpha": 1.0}, "fragment_alpha=1.0 must be in"),
    ({"diloco.overlap": "one_step_delay"}, "two ways to overlap"),
    ({"mode": "ddp"}, "are Streaming DiLoCo's"),
    ({"diloco.dropped_islands": "idle"}, "Streaming DiLoCo has none"),
])
def test_bad_streaming_settings_are_one_error(overrides, message):
  with pytest.raises(validation.ConfigError, match=message):
    validation.validate_config(_config(**overrides), num_devices=8)
