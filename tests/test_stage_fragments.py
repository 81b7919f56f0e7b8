"""Streaming DiLoCo on pipelined islands: fragment s is pipeline stage s.

A stage's send is the unpipelined fragment send (the codec, error
feedback and outer step) of what that stage holds, run on the stage's
devices alone; its merge blends that share only. The programs are checked
against that definition, and whole runs against their unsharded and
on-device counterparts and against themselves resumed.
"""

import os

import jax
import numpy as np
import pytest

from configs import tiny
from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.algorithm import island_sync as island_sync_lib
from diloco_jax.analysis import link_bytes
from diloco_jax.compiled import stage_sends
from diloco_jax.config import validation
from diloco_jax.model import transformer as model_lib
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel import stage_parts
from diloco_jax.run import setup as setup_lib
from diloco_jax.storage import resume as resume_lib
from tests import helpers
from tests import test_checkpoint
from tests import test_multihost

STAGED_STREAMING = {
    "model.num_layers": 2, "data.batch_size": 8, "mesh.stage": 2,
    "diloco.islands": 2, "diloco.fragments": 2, "diloco.fragment_delay": 1,
    "diloco.fragment_alpha": 0.5}


def _config(**overrides):
  return helpers.with_overrides(tiny.get_config(),
                                {**STAGED_STREAMING, **overrides})


# The stage's part of staged arrays.


def test_a_stage_s_part_is_its_devices_own_buffers():
  mesh = mesh_lib.build_mesh(2, 2, 2, jax.devices())
  spec = jax.sharding.PartitionSpec(mesh_lib.ISLAND, mesh_lib.STAGE,
                                    mesh_lib.DATA)
  values = np.arange(2 * 2 * 4 * 3, dtype=np.float32).reshape(2, 2, 4, 3)
  whole = jax.device_put(values, jax.sharding.NamedSharding(mesh, spec))
  part, rest = stage_parts.take_stage_part(whole, 1)
  np.testing.assert_array_equal(part, values[:, 1:2])
  stage_devices = set(stage_parts.stage_mesh(mesh, 1).devices.flat)
  assert part.sharding.device_set == stage_devices
  pointers = lambda a: {s.device: s.data.unsafe_buffer_pointer()
                        for s in a.addressable_shards}
  assert pointers(part).items() <= pointers(whole).items()  # no copy
  # A program on the stage's devices that donates the part; the whole
  # comes back around its result.
  new = jax.jit(lambda a: a * 10, donate_argnums=0)(part)
  back = stage_parts.put_stage_part(rest, new)
  expected = values.copy()
  expected[:, 1] *= 10
  np.testing.assert_array_equal(back, expected)
  assert back.sharding == whole.sharding


# The programs against their definition.


def _setup(config):
  return setup_lib.build(validation.validate_config(config, 8),
                         jax.devices())


def _logical_state(setup, seed=0):
  """The logical state at fresh params, the islands moved apart and (with
  error feedback) residuals left from earlier rounds."""
  spec, model = setup.spec, setup.config.model
  state = spec.init(model_lib.new_params(model, seed))
  keys = iter(jax.random.split(jax.random.key(seed + 1), 1000))
  nudge = lambda tree, scale: jax.tree.map(
      lambda a: a + scale * jax.random.normal(next(keys), a.shape, a.dtype),
      tree)
  state = state.replace(island_params=nudge(state.island_params, 0.02))
  if state.outer.residuals is not None:
    state = state.replace(outer=state.outer.replace(
        residuals=nudge(state.outer.residuals, 0.01)))
  return state


def _share(tree, layout, stage: int, per_island: bool = False):
  """What stage `stage` holds of a logical params-shaped tree (or None)."""
  if tree is None:
    return None
  split = jax.vmap(layout.split_params) if per_island else layout.split_params
  return jax.tree.map(lambda a: a[:, stage] if per_island else a[stage],
                      split(tree))


# The parts of every outer field: low rank's codec state (bases per stage)
# with outer Adam's step count per stage; SparseLoCo's residuals (error
# feedback as its momentum), on FSDP islands (chunks per device piece).
# Tolerances: the stage's program and the reference compute the same
# operations, compiled apart; XLA may fuse and reorder them (within
# float32 rounding of values of order 1).
@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    {"diloco.codec": "lowrank", "diloco.outer_optimizer.name": "adam"},
    # A model whose matrices FSDP splits (the tiny one's stay whole).
    {"diloco.outer_optimizer.name": "sparseloco", "mesh.data": 2,
     "mesh.fsdp": True, "model.d_model": 64, "model.num_heads": 4,
     "model.head_dim": 16, "model.mlp_dim": 256}],
                         ids=["lowrank-adam", "sparseloco-fsdp"])
def test_a_stage_s_send_and_merge_are_the_unpipelined_ones_on_its_share(
    overrides):
  config = _config(**overrides)
  setup = _setup(config)
  spec, mesh, stages = setup.spec, setup.mesh, 2
  logical = _logical_state(setup)
  weights = np.array([1.0, 3.0], np.float32)
  sends = stage_sends.compile_sends(
      mesh, setup.steps_state, setup.weights_shape, outer=spec.outer,
      rounding_seed=None,
      stripes=config.mesh.data if config.mesh.fsdp else 1)
  merges = stage_sends.compile_merges(
      mesh, setup.steps_state, alpha=config.diloco.fragment_alpha,
      inner_opt=spec.inner_opt)
  to_steps = jax.jit(spec.staged, out_shardings=jax.tree.map(
      lambda a: a.sharding, setup.steps_state))
  to_logical = jax.jit(lambda s: spec.logical(s, setup.abstract_state))
  plain_mesh = mesh_lib.build_mesh(2, config.mesh.data, 1,
                                   jax.devices()[:2 * config.mesh.data])
  reference_send = jax.jit(fragments_lib.make_send_parts(
      spec.outer, island_sync_lib.make_island_sync(
          plain_mesh, spec.compression, None, config.mesh.fsdp)))
  for stage in range(stages):
    # Each program runs on the stage's devices only: its collective
    # reaches the same stage of the other island, nothing else.
    stage_devices = set(stage_parts.stage_mesh(mesh, stage).devices.flat)
    for program in (sends[stage], merges[stage]):
      compiled = program.args[0]
      assert {d for s in jax.tree.leaves(compiled.input_shardings)
              for d in s.device_set} == stage_devices
    state = to_steps(logical)
    state = sends[stage](state, jax.device_put(
        weights, setup.weights_shape.sharding))
    sent = to_logical(state)
    expected = reference_send(
        fragments_lib.FragmentParts(
            _share(logical.global_params, spec.layout, stage),
            logical.outer.outer_opt_state[stage],
            _share(logical.outer.residuals, spec.layout, stage,
                   per_island=True),
            jax.tree.map(lambda a: a[stage], logical.outer.codec_state)),
        _share(logical.island_params, spec.layout, stage, per_island=True),
        weights, fragments_lib.send_index(logical.step, stages, stage))
    helpers.assert_trees_close(
        (_share(sent.global_params, spec.layout, stage),
         sent.outer.outer_opt_state[stage],
         _share(sent.outer.residuals, spec.layout, stage, per_island=True),
         jax.tree.map(lambda a: a[stage], sent.outer.codec_state)),
        tuple(expected), rtol=1e-5, atol=1e-6)
    # The other stage's x, outer state, residuals and codec state are as
    # they were, bit for bit.
    other = 1 - stage
    for field, per_island in (("global_params", False), ("residuals", True)):
      part = lambda state, field=field: (
          state.global_params if field == "global_params"
          else getattr(state.outer, field))
      jax.tree.map(np.testing.assert_array_equal,
                   _share(part(sent), spec.layout, other, per_island),
                   _share(part(logical), spec.layout, other, per_island))
    jax.tree.map(np.testing.assert_array_equal,
                 sent.outer.outer_opt_state[other],
                 logical.outer.outer_opt_state[other])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[other],
                                                            b[other]),
                 sent.outer.codec_state, logical.outer.codec_state)
    if spec.compression.is_lowrank:  # the stage's bases moved
      assert not np.array_equal(
          jax.tree.leaves(sent.outer.codec_state)[0][stage],
          jax.tree.leaves(logical.outer.codec_state)[0][stage])
    # The merge: the stage's share of every island becomes
    # alpha * y + (1 - alpha) * x; the other stage's stays.
    merged = to_logical(merges[stage](state))
    alpha = config.diloco.fragment_alpha
    x_share = _share(sent.global_params, spec.layout, stage)
    helpers.assert_trees_close(
        _share(merged.island_params, spec.layout, stage, per_island=True),
        jax.tree.map(lambda y, x: alpha * y + (1 - alpha) * x[None],
                     _share(logical.island_params, spec.layout, stage,
                            per_island=True), x_share),
        rtol=1e-6, atol=1e-7)
    jax.tree.map(np.testing.assert_array_equal,
                 _share(merged.island_params, spec.layout, other, True),
                 _share(logical.island_params, spec.layout, other, True))


def test_a_stage_s_sync_counts_one_stage_s_bytes():
  """Fragment s's send is stage s's collective only: in float32 the two
  stages' sends add up to one sync of the whole pipelined model."""
  config = _config()
  setup = _setup(config)
  count = link_bytes.LinkBytes(config, setup.abstract_state.global_params,
                               2, setup.spec.compression, setup.spec.layout)
  assert count.sync(None, 0) == count.sync(None, 1) > 0
  assert count.sync(None, 0) + count.sync(None, 1) == count.sync(None)
  assert count.fp32_sync(0) == count.fp32_sync(None) // 2


# Whole runs: float32 sends, so that the FSDP islands' run is the same
# computation as the replicated one (a rounding codec cuts its blocks in
# the FSDP stripes); the codecs' parts are checked above. The model is
# large enough for FSDP to split its matrices (the tiny one's stay whole).
RUN = {"total_steps": 8, "diloco.inner_steps": 4,
       "checkpoint.every_steps": 2, "checkpoint.max_to_keep": 10,
       "model.d_model": 64, "model.num_heads": 4, "model.head_dim": 16,
       "model.mlp_dim": 256}


def _run(name: str, **overrides):
  return helpers.shared_run(f"stage_fragments_{name}",
                            _config(**RUN, **overrides))


@pytest.mark.slow
def test_fsdp_islands_and_the_outer_device_equal_the_staged_run():
  """The run whose sends go to each stage's outer device, and the FSDP
  islands' run (each stage over 2 devices), equal the staged run on its
  compute devices to float summation order (test_multihost's comparison);
  the outer device's sends the same bytes, FSDP's within 2% more (each
  device sends its own shards, and whole the norms' scales FSDP keeps
  whole: 1.8% here)."""
  reference, summary = _run("device")
  host, on_host = _run("host", **{"diloco.outer_placement": "host"})
  assert (summary["outer_placement"], on_host["outer_placement"]) == (
      "device", "host")
  test_multihost._assert_close_runs(reference, host)  # pylint: disable=protected-access
  fsdp, sharded = _run("fsdp", **{"mesh.data": 2, "mesh.fsdp": True})
  helpers.assert_trees_close(test_checkpoint._final_state(fsdp),  # pylint: disable=protected-access
                             test_checkpoint._final_state(reference),  # pylint: disable=protected-access
                             rtol=1e-5, atol=1e-6)
  assert sharded["final_eval_loss"] == pytest.approx(
      summary["final_eval_loss"], rel=1e-5)
  assert (summary["comm_bytes"] < sharded["comm_bytes"]
          < 1.02 * summary["comm_bytes"])


@pytest.mark.slow
def test_a_staged_streaming_run_resumes_exactly(tmp_path):
  """Killed after step 6 (stage 1 sent at step 6, its merge at step 7 in
  flight), the rerun ends bit for bit as the run that went through."""
  from diloco_jax.run import train  # pylint: disable=g-import-not-at-top
  whole, _ = _run("device")
  resumed = str(tmp_path / "resumed")
  test_checkpoint.forget_after(whole, resumed, 6)
  train.train_and_evaluate(_config(**RUN), resumed)
  test_checkpoint._assert_identical_runs(whole, resumed)  # pylint: disable=protected-access
  # Another stage count is another split into fragments: refused in one
  # line, the checkpoints left as they were.
  other = str(tmp_path / "other_stages")
  test_checkpoint.forget_after(whole, other, 6)
  saved = sorted(os.listdir(os.path.join(other, "checkpoints")))
  with pytest.raises(resume_lib.ConfigChangedError,
                     match=r"Streaming DiLoCo with config.mesh.stage=2; .*"
                     r"resume with --config.mesh.stage=2"):
    train.train_and_evaluate(_config(**{**RUN, "mesh.stage": 1}), other)
  assert sorted(os.listdir(os.path.join(other, "checkpoints"))) == saved
