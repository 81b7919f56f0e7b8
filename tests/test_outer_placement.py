"""The outer step on devices of its own (config.diloco.outer_placement)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import tiny
from diloco_jax.algorithm import fragments
from diloco_jax.algorithm import library
from diloco_jax.algorithm import outer_settings
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.compiled import host_outer
from diloco_jax.config import validation
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel import outer_devices as outer_devices_lib
from diloco_jax.parallel import placement
from diloco_jax.run import train
from tests import helpers
from tests import test_checkpoint
from tests import test_multihost
from tests import test_streaming


@pytest.mark.parametrize("overlap,codec,error_feedback,warmup", [
    ("none", "fp32", False, 0), ("none", "int8", True, 0),
    ("one_step_delay", "fp32", False, 0), ("one_step_delay", "int8", True, 0),
    # SparseLoCo's payloads are all-gathered on the outer device.
    ("none", "sparseloco", True, 0),
    # The anchors cross to the outer device; the islands rebase at home.
    ("one_step_delay_rebase", "int8", True, 0),
    # The landed mean comes back; the islands step their own points (here
    # with an own weight: the share is the same code's other branch).
    ("eager", "int8", True, 0),
    # The first 2 of the 3 rounds wait for their own mean to come back.
    ("eager", "fp32", False, 2)])
def test_the_host_outer_step_equals_the_on_device_one(overlap, codec,
                                                      error_feedback, warmup):
  own_weight = 0.75 if overlap == "eager" else None
  islands = 4
  compute, outer_devices = outer_devices_lib.split_devices(jax.devices())
  assert outer_devices == [jax.devices()[-1]]
  compression = test_streaming._compression(codec)  # pylint: disable=protected-access
  params = jax.tree.map(np.array, helpers.tiny_problem()[0])
  inner_opt = optax.adam(1e-2)
  outer_opt = optax.sgd(0.7, momentum=0.9, nesterov=True)
  mesh = mesh_lib.build_mesh(islands, devices=compute)
  host_state = outer_settings.init_state(
      params, inner_opt, outer_opt, islands, error_feedback, compression,
      overlap=overlap, eager_own_weight=own_weight, warmup_rounds=warmup)
  host_state = jax.tree.map(np.array, jax.device_get(host_state))
  shardings = state_lib.state_shardings(host_state, mesh)
  on_device = jax.device_put(host_state, shardings)
  outer = outer_step_lib.make_outer_step(outer_opt, mesh, compression,
                                         inner_opt=inner_opt, overlap=overlap,
                                         eager_own_weight=own_weight,
                                         warmup_rounds=warmup)
  host = host_outer.build(outer_devices, islands, mesh,
                          outer_settings.outer_of(
                              outer_opt, compression, overlap, own_weight,
                              warmup, error_feedback), inner_opt)
  precompiled = codec == "int8"  # as runs do; fp32 compiles at first use
  if precompiled:
    host.compile_in_background(placement.with_shardings(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                     host_state), shardings))
  on_host = host.load(jax.device_put(host_state, shardings))
  stripped = host_outer.strip(on_device)
  stripped_shardings = state_lib.state_shardings(stripped, mesh)
  weights = jax.device_put(jnp.array([1.0, 0.0, 2.0, 1.0]),
                           NamedSharding(mesh, P("island")))
  for r in range(3):
    key = jax.random.key(r)
    moved = test_streaming.moved_islands
    on_device = outer(moved(on_device, key, shardings), weights)
    on_host = host.outer_step(moved(on_host, key, stripped_shardings),
                              weights)
  if overlap != "none":
    on_device = outer_step_lib.make_flush(outer_opt, mesh)(on_device)
    on_host = host.flush(on_host)
  whole = host.assemble(on_host)
  assert jax.tree.structure(whole) == jax.tree.structure(on_device)
  # The 4 islands sit on 4 compute devices but fold onto the 1 outer
  # device: the codec's reduction adds them in another order (1 ulp).
  for a, b in zip(jax.tree.leaves(jax.device_get(on_device)),
                  jax.tree.leaves(jax.device_get(whole))):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  # The programs compiled from shapes took the arrays the loop passes.
  assert isinstance(host._send, jax.stages.Compiled) == precompiled  # pylint: disable=protected-access
  # The outer side lives on the outer device only.
  for leaf in jax.tree.leaves(host.outer_state):
    assert leaf.sharding.device_set == {outer_devices[0]}


@pytest.mark.slow
def test_streaming_sends_on_the_host_equal_the_on_device_ones():
  """Two fragments, each sent on the outer device while the other is in
  flight, merged later with x_p from there: as the compiled programs on
  the compute devices. Low rank with error feedback: each fragment's
  codec state sits at its own positions (adaptive ranks are left out: a
  last-bit difference can tip an energy threshold to another rank). Runs
  check int8 with the sends compiled from shapes."""
  islands, num_fragments, alpha = 4, 2, 0.5
  compute, outer_devices = outer_devices_lib.split_devices(jax.devices())
  compression = test_streaming._compression("lowrank")  # pylint: disable=protected-access
  params, inner_opt, outer_opt, state = test_streaming._state(  # pylint: disable=protected-access
      islands, compression, True, num_layers=4)
  state, outer = test_streaming._streaming(  # pylint: disable=protected-access
      state, params, inner_opt, outer_opt, compression, num_fragments)
  state = jax.tree.map(np.array, jax.device_get(state))
  mesh = mesh_lib.build_mesh(islands, devices=compute)
  shardings = state_lib.state_shardings(state, mesh)
  on_device = jax.device_put(state, shardings)
  host = host_outer.build(outer_devices, islands, mesh, outer, inner_opt)
  on_host = host.load(jax.device_put(state, shardings))
  stripped_shardings = state_lib.state_shardings(on_host, mesh)
  sends = [fragments.make_fragment_send(outer, mesh, p)
           for p in range(num_fragments)]
  merges = [fragments.make_fragment_merge(mesh, num_fragments, p, alpha,
                                          inner_opt=inner_opt)
            for p in range(num_fragments)]
  weights = jax.device_put(jnp.array([1.0, 0.0, 2.0, 1.0]),
                           NamedSharding(mesh, P("island")))
  moved = test_streaming.moved_islands
  for r in range(3):
    # Send 0; the islands move on; send 1 with 0 in flight; merge 0, 1.
    on_device = sends[0](moved(on_device, jax.random.key(2 * r), shardings),
                         weights)
    on_host = host.sends[0](moved(on_host, jax.random.key(2 * r),
                                  stripped_shardings), weights)
    on_device = sends[1](moved(on_device, jax.random.key(2 * r + 1),
                               shardings), weights)
    on_host = host.sends[1](moved(on_host, jax.random.key(2 * r + 1),
                                  stripped_shardings), weights)
    for p in range(num_fragments):
      on_device = merges[p](on_device)
      on_host = merges[p](on_host, host.fragment_x(p))
  whole = host.assemble(on_host)
  assert jax.tree.structure(whole) == jax.tree.structure(on_device)
  # Summation order (4 islands folded onto 1 outer device) moves the last
  # bit; the low-rank codec's orthogonalization amplifies it.
  for a, b in zip(jax.tree.leaves(jax.device_get(on_device)),
                  jax.tree.leaves(jax.device_get(whole))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  for leaf in jax.tree.leaves(host.outer_state):
    assert leaf.sharding.device_set == {outer_devices[0]}


# Runs.


def _config(**overrides):
  return helpers.with_overrides(tiny.get_config(), {
      "diloco.islands": 4, "total_steps": 12, "diloco.inner_steps": 3,
      "checkpoint.every_steps": 2, "checkpoint.max_to_keep": 20,
      **overrides})


# FSDP islands: 2 islands x 2 'data' devices, a model whose matrices are
# all split (MIN_FSDP_ELEMENTS), and a dense codec, encoded in the stripes
# of the island's devices on the outer device too; 2 rounds (the delay's
# mean is in flight across the second and flushed at the end).
FSDP = {"diloco.islands": 2, "mesh.data": 2, "mesh.fsdp": True,
        "total_steps": 6,
        "model.d_model": 64, "model.num_heads": 4, "model.head_dim": 16,
        "model.mlp_dim": 256, "diloco.codec": "int8",
        "diloco.error_feedback": True}


def _assert_host_equals_device(tmp_path, overrides):
  """The run with the outer step on its own device(s) equals the run with
  it on the compute devices, to float summation order, sending the same
  bytes."""
  host, device = str(tmp_path / "host"), str(tmp_path / "device")
  summary = train.train_and_evaluate(_config(**{
      **overrides, "diloco.outer_placement": "host"}), host)
  assert summary["outer_placement"] == "host"
  on_device = train.train_and_evaluate(_config(**overrides), device)
  assert summary["comm_bytes"] == on_device["comm_bytes"]
  test_multihost._assert_close_runs(device, host)  # pylint: disable=protected-access


# The outer step's host path is checked on its own for every overlap
# (test_the_host_outer_step_equals_the_on_device_one); runs with the plain
# delay and with streaming, FSDP islands on 2 processes, in test_multihost;
# a resume onto the host with the rebasing delay below; and here FSDP
# islands with the rebasing delay (the anchors cross in the FSDP stripes).
@pytest.mark.slow
def test_a_run_with_the_outer_step_on_its_own_device_equals_on_device(
    tmp_path):
  overrides = {"diloco.overlap": "one_step_delay_rebase", **FSDP}
  _assert_host_equals_device(tmp_path, overrides)


# Pipeline stages: each stage's x, outer state and collective on an outer
# device of its own (2 stages, 2 outer devices); eager updates with int8
# and error feedback, whose anchors, landed means and residuals cross per
# stage.
STAGED = {"model.num_layers": 2, "data.batch_size": 8, "mesh.stage": 2,
          "diloco.islands": 2, "total_steps": 8, "diloco.inner_steps": 4,
          "diloco.overlap": "eager", "diloco.codec": "int8",
          "diloco.error_feedback": True}


@pytest.mark.slow
def test_each_stage_s_outer_side_is_on_a_device_of_its_own(tmp_path,
                                                           monkeypatch):
  """The run equals the staged run with its outer step on the compute
  devices (to float summation order); the outer side holds each stage on
  its own outer device, about half of x and the outer state on each, and
  what the islands send there (their params, anchors) arrives the same
  way, each stage's part on its stage's outer device."""
  from diloco_jax.run import setup as setup_lib  # pylint: disable=g-import-not-at-top
  from diloco_jax.run import start as start_lib  # pylint: disable=g-import-not-at-top
  from diloco_jax.parallel import stages as stages_lib  # pylint: disable=g-import-not-at-top
  compute, outer_devices = outer_devices_lib.split_devices(jax.devices(), 2)
  arrived = []  # what the run's outer side moved onto the outer devices
  real_move = host_outer.move

  def recording_move(tree, shardings):
    moved = real_move(tree, shardings)
    leaves = jax.tree.leaves(moved)
    if leaves and all(leaf.sharding.device_set <= set(outer_devices)
                      for leaf in leaves):
      arrived.append(moved)
    return moved

  monkeypatch.setattr(host_outer, "move", recording_move)
  _assert_host_equals_device(tmp_path, STAGED)
  big = [tree for tree in arrived
         if sum(leaf.nbytes for leaf in jax.tree.leaves(tree)) > 2 ** 16]
  assert big  # the islands' params and anchors, each round
  for tree in big:
    whole = sum(leaf.nbytes for leaf in jax.tree.leaves(tree))
    assert stages_lib.bytes_per_device(tree) <= 0.6 * whole
  config = _config(**{**STAGED, "diloco.outer_placement": "host"})
  setup = setup_lib.build(validation.validate_config(config, len(compute)),
                          compute, outer_devices)
  setup.islands_side(start_lib.first_start(setup, None).state)
  outer = setup.host_outer.outer_state
  held = [outer.global_params, outer.outer.outer_opt_state]
  assert {d for leaf in jax.tree.leaves(held)
          for d in leaf.sharding.device_set} == set(outer_devices)
  whole = sum(leaf.nbytes for leaf in jax.tree.leaves(held))
  assert stages_lib.bytes_per_device(held) <= 0.6 * whole


def test_moves_assemble_each_target_from_the_blocks_a_process_holds():
  """outer_devices.move between shardings without a collective: a
  target shard is cut and joined from the grid of blocks held (island
  rows, FSDP columns), and a part held nowhere is one error."""
  array = np.arange(4 * 6 * 3, dtype=np.float32).reshape(4, 6, 3)
  rows, columns = [(0, 2), (2, 4)], [(0, 3), (3, 6)]
  blocks = {(r, c, (0, 3)): jnp.asarray(array[r[0]:r[1], c[0]:c[1]])
            for r in rows for c in columns}
  for target in [((0, 4), (0, 6), (0, 3)), ((1, 3), (2, 5), (1, 3)),
                 ((2, 3), (0, 6), (0, 3)), ((0, 2), (3, 6), (0, 3))]:
    held = {b: d for b, d in blocks.items()
            if outer_devices_lib._overlaps(b, target)}  # pylint: disable=protected-access
    np.testing.assert_array_equal(
        outer_devices_lib._assemble(held, target, array.shape),  # pylint: disable=protected-access
        array[tuple(slice(*t) for t in target)])
  del blocks[((2, 4), (3, 6), (0, 3))]
  with pytest.raises(ValueError, match="is not all on process"):
    outer_devices_lib._assemble(blocks, ((0, 4), (0, 6), (0, 3)), array.shape)  # pylint: disable=protected-access


def _streaming(**overrides):
  return {"model.num_layers": 2, "diloco.inner_steps": 4,
          "diloco.fragments": 2, "diloco.fragment_delay": 2,
          "diloco.fragment_alpha": 0.5, "diloco.codec": "int8",
          "diloco.error_feedback": True, "checkpoint.every_steps": 5,
          **overrides}


@pytest.mark.slow
def test_a_streaming_run_with_its_sends_on_their_own_device_equals_on_device(
    tmp_path):
  """Resumed at step 5, with fragment 0 (sent at step 4) in flight until
  its merge at step 6: the checkpoint holds its new x from the outer
  device, and the run ends as one on the compute devices throughout."""
  host, device = str(tmp_path / "host"), str(tmp_path / "device")
  train.train_and_evaluate(_config(**_streaming()), device)
  on_host = _config(**_streaming(**{"diloco.outer_placement": "host"}))
  summary = train.train_and_evaluate(on_host, host)
  assert summary["outer_placement"] == "host" and summary["fragments"] == 2
  test_multihost._assert_close_runs(device, host)  # pylint: disable=protected-access
  resumed = str(tmp_path / "resumed")
  test_checkpoint.forget_after(host, resumed, 5)
  train.train_and_evaluate(on_host, resumed)
  test_checkpoint._assert_identical_runs(host, resumed)  # pylint: disable=protected-access


@pytest.mark.slow
@pytest.mark.parametrize("overlap", ["one_step_delay_rebase", "eager"])
def test_resume_moves_the_outer_state_either_way(tmp_path, overlap):
  """Checkpoints are the same pytree whatever the placement: a run saved
  on the device resumes with the outer step on the host, mid-round, with a
  mean in flight and the islands' anchors (the rebasing delay; eager: the
  islands' own outer points, states and shares), and ends as the
  uninterrupted run."""
  delayed = {"diloco.overlap": overlap}
  whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
  train.train_and_evaluate(_config(**delayed), whole)
  test_checkpoint.forget_after(whole, resumed, 8)
  train.train_and_evaluate(_config(**delayed, **{
      "diloco.outer_placement": "host"}), resumed)
  test_multihost._assert_close_runs(whole, resumed)  # pylint: disable=protected-access


@pytest.mark.parametrize("overrides,message", [
    ({"diloco.outer_placement": "cpu"}, "outer_placement='cpu' is not one"),
    ({"diloco.outer_placement": "host", "mode": "ddp"},
     "config.mode='ddp' has none"),
])
def test_bad_placements_are_one_error(overrides, message):
  with pytest.raises(validation.ConfigError, match=message):
    validation.validate_config(_config(**overrides), num_devices=8)


def test_a_cpu_host_without_a_spare_device_is_one_error(tmp_path):
  with pytest.raises(validation.ConfigError,
                     match=r"sets 1 CPU device\(s\) aside per process"):
    train.train_and_evaluate(
        _config(**{"diloco.outer_placement": "host"}), str(tmp_path / "run"),
        devices=jax.devices()[:1])
  assert not os.path.exists(str(tmp_path / "run"))
