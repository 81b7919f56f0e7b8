"""The outer step on devices of its own (config.diloco.outer_placement)."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import tiny
from diloco_jax import diloco
from diloco_jax import mesh as mesh_lib
from diloco_jax import outer_placement
from diloco_jax import placement
from diloco_jax import train
from diloco_jax import validation
from tests import helpers
from tests import test_multihost
from tests import test_streaming


@pytest.mark.parametrize("overlap", ["none", "one_step_delay"])
@pytest.mark.parametrize("codec,error_feedback", [("fp32", False),
                                                  ("int8", True)])
def test_the_host_outer_step_equals_the_on_device_one(overlap, codec,
                                                      error_feedback):
  islands = 4
  compute, outer_devices = outer_placement.split_devices(jax.devices())
  assert outer_devices == [jax.devices()[-1]]
  compression = test_streaming._compression(codec)  # pylint: disable=protected-access
  params = jax.tree.map(np.array, helpers.tiny_problem()[0])
  inner_opt = optax.adam(1e-2)
  outer_opt = optax.sgd(0.7, momentum=0.9, nesterov=True)
  mesh = mesh_lib.build_mesh(islands, devices=compute)
  host_state = diloco.init_state(params, inner_opt, outer_opt, islands,
                                 error_feedback, compression, overlap=overlap)
  host_state = jax.tree.map(np.array, jax.device_get(host_state))
  shardings = diloco.state_shardings(host_state, mesh)
  on_device = jax.device_put(host_state, shardings)
  outer = diloco.make_outer_step(outer_opt, mesh, compression,
                                 inner_opt=inner_opt, overlap=overlap)
  host = outer_placement.HostOuter(outer_devices, islands, mesh, outer_opt,
                                   compression, inner_opt, overlap=overlap)
  precompiled = codec == "int8"  # as runs do; fp32 compiles at first use
  if precompiled:
    host.compile_in_background(placement.with_shardings(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                     host_state), shardings))
  on_host = host.load(jax.device_put(host_state, shardings))
  stripped = outer_placement.strip(on_device)
  stripped_shardings = diloco.state_shardings(stripped, mesh)
  weights = jax.device_put(jnp.array([1.0, 0.0, 2.0, 1.0]),
                           NamedSharding(mesh, P("island")))
  for r in range(3):
    key = jax.random.key(r)
    moved = test_streaming.moved_islands
    on_device = outer(moved(on_device, key, shardings), weights)
    on_host = host.outer_step(moved(on_host, key, stripped_shardings),
                              weights)
  if overlap == "one_step_delay":
    on_device = diloco.make_flush(outer_opt, mesh)(on_device)
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


# Runs.


def _config(**overrides):
  return helpers.with_overrides(tiny.get_config(), {
      "diloco.islands": 4, "total_steps": 12, "diloco.inner_steps": 3,
      "checkpoint.every_steps": 2, "checkpoint.max_to_keep": 20,
      **overrides})


@pytest.mark.parametrize("overlap", ["none", "one_step_delay"])
def test_a_run_with_the_outer_step_on_its_own_device_equals_on_device(
    tmp_path, overlap):
  host, device = str(tmp_path / "host"), str(tmp_path / "device")
  summary = train.train_and_evaluate(_config(**{
      "diloco.overlap": overlap, "diloco.outer_placement": "host"}), host)
  assert summary["outer_placement"] == "host"
  train.train_and_evaluate(_config(**{"diloco.overlap": overlap}), device)
  test_multihost._assert_close_runs(device, host)  # pylint: disable=protected-access


def test_resume_moves_the_outer_state_either_way(tmp_path):
  """Checkpoints are the same pytree whatever the placement: a run saved
  on the device resumes with the outer step on the host, mid-round and
  with a mean in flight, and ends as the uninterrupted run."""
  delayed = {"diloco.overlap": "one_step_delay"}
  whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
  train.train_and_evaluate(_config(**delayed), whole)
  train.train_and_evaluate(_config(**delayed), resumed)
  checkpoints = os.path.join(resumed, "checkpoints")
  for step in os.listdir(checkpoints):
    if int(step) > 8:
      shutil.rmtree(os.path.join(checkpoints, step))
  os.remove(os.path.join(resumed, "summary.json"))
  train.train_and_evaluate(_config(**delayed, **{
      "diloco.outer_placement": "host"}), resumed)
  test_multihost._assert_close_runs(whole, resumed)  # pylint: disable=protected-access


@pytest.mark.parametrize("overrides,message", [
    ({"diloco.outer_placement": "cpu"}, "outer_placement='cpu' is not one"),
    ({"diloco.outer_placement": "host", "mode": "ddp"},
     "config.mode='ddp' has none"),
    ({"diloco.outer_placement": "host", "diloco.fragments": 1,
      "diloco.fragment_delay": 1}, "not built for Streaming DiLoCo"),
    ({"diloco.outer_placement": "host", "mesh.fsdp": True, "mesh.data": 2},
     "with config.mesh.fsdp use 'device'"),
])
def test_bad_placements_are_one_error(overrides, message):
  with pytest.raises(validation.ConfigError, match=message):
    validation.validate_config(_config(**overrides), num_devices=8)


def test_a_cpu_host_without_a_spare_device_is_one_error(tmp_path):
  with pytest.raises(validation.ConfigError, match="sets a CPU device aside"):
    train.train_and_evaluate(
        _config(**{"diloco.outer_placement": "host"}), str(tmp_path / "run"),
        devices=jax.devices()[:1])
  assert not os.path.exists(str(tmp_path / "run"))
