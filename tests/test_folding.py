"""Islands folded onto fewer devices: the same algorithm on any placement.

k islands on d devices (d divides k) run k / d islands per device under a
vmap. Given the same inputs, one outer step's codec gives the same mean on
1, 2 and k devices up to the last bit (a float32 psum adds the islands in
another order: a vmapped sum per device, then an all-reduce).

Whole runs are not bit-identical: XLA rounds a batched (vmapped) matmul
slightly differently from a single one (~1e-7 relative), Adam divides each
gradient component by its own RMS, which turns that into ~1e-6 parameter
differences after a few steps, and a lossy codec can then round a value
that sits on a quantization boundary to the neighbouring level: one int8
step of a block, spread over a whole matrix when it is a low-rank factor
(measured: up to 4.5e-4 after two rounds). The tolerances below come from
that; the per-step losses must agree to 1e-5.
"""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import tiny
from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import inner_step as inner_step_lib
from diloco_jax.algorithm import outer_settings
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.codecs import dense as codecs
from diloco_jax.parallel import communication
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel import placement
from diloco_jax.parallel.placement import PER_ISLAND, REPLICATED
from diloco_jax.run import train
from tests import helpers
from tests import test_checkpoint

INT8 = codecs.DenseCodec("int8", 64)
VARIANTS = {
    "fp32": dict(compression=None),
    "int8": dict(compression=compression_lib.Compression("int8", INT8)),
    "topk": dict(compression=compression_lib.Compression(
        "topk", INT8, topk_fraction=0.25)),
    "adaptive_lowrank+ef": dict(
        compression=compression_lib.Compression(
            "adaptive_lowrank", INT8, ranks=(2, 4), energy_fraction=0.9,
            factor_codec=INT8),
        error_feedback=True),
    "ddp": dict(compression=None, ddp=True),
}
# (losses rtol, gradient norms rtol, final params atol), each a few times
# the largest difference measured over k = 4, 8 and 1, 2 devices: float32
# and ddp only accumulate rounding (losses 3e-7, norms 9e-6, params 2.4e-5);
# the lossy codecs add a flipped quantization level (losses 2.1e-5, norms
# 1.4e-3, params 4.5e-4). An outer update here is ~3e-2 per parameter.
EXACT, LOSSY = (1e-4, 1e-4, 1e-4), (1e-4, 5e-3, 1e-3)
TOLERANCE = {"fp32": EXACT, "ddp": EXACT, "int8": LOSSY}
COLLECTIVES = re.compile(
    r"all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter")


def _placed(islands: int, num_devices: int):
  mesh = mesh_lib.build_mesh(islands, devices=jax.devices()[:num_devices])
  assert mesh.shape[mesh_lib.ISLAND] == num_devices
  return mesh


def _run(islands: int, num_devices: int, variant: str, rounds: int = 2,
         inner_steps: int = 2):
  """A short DiLoCo (or ddp) run; returns per-step metrics and the state."""
  settings = VARIANTS[variant]
  params, loss_fn = helpers.tiny_problem()
  params = jax.tree.map(np.array, params)
  inner_opt = optax.adamw(1e-2, weight_decay=0.1)
  outer_opt = optax.sgd(0.7, momentum=0.9, nesterov=True)
  mesh = _placed(islands, num_devices)
  state = outer_settings.init_state(params, inner_opt, outer_opt, islands,
                                    settings.get("error_feedback", False),
                                    settings["compression"])
  state = jax.device_put(state, state_lib.state_shardings(state, mesh))
  ddp = settings.get("ddp", False)
  inner = inner_step_lib.make_inner_step(loss_fn, inner_opt, mesh,
                                         sync_gradients_across_islands=ddp)
  outer = outer_step_lib.make_outer_step(outer_opt, mesh, settings["compression"],
                                         rounding_seed=None)
  weights = jax.device_put(np.arange(1, islands + 1, dtype=np.float32),
                           NamedSharding(mesh, P(mesh_lib.ISLAND)))
  batches = helpers.random_batches(rounds * inner_steps, islands, 2)
  state, losses, grad_norms = helpers.run_rounds(
      state, inner, None if ddp else outer, weights, batches, mesh,
      inner_steps)
  return losses, grad_norms, jax.device_get(state)


# k = 4 on 1, 2 and 4 devices: 4, 2 and 1 islands per device. Whole runs
# take float32, a rounding codec (int8) and ddp; every codec's mean, top-k's
# and the adaptive low-rank codec's included, is the same on every
# placement at the collective (test_codec_mean_is_the_same_on_every_placement).
@pytest.mark.slow
@pytest.mark.parametrize("islands,variant",
                         [(4, v) for v in ("fp32", "int8", "ddp")])
def test_runs_on_1_2_and_k_devices_agree(islands, variant):
  runs = {d: _run(islands, d, variant) for d in (1, 2, islands)}
  losses, grad_norms, state = runs[islands]
  loss_rtol, norm_rtol, params_atol = TOLERANCE[variant]
  for d in (1, 2):
    other_losses, other_norms, other_state = runs[d]
    np.testing.assert_allclose(other_losses, losses, rtol=loss_rtol)
    np.testing.assert_allclose(other_norms, grad_norms, rtol=norm_rtol)
    helpers.assert_trees_close(
        (other_state.global_params, other_state.island_params),
        (state.global_params, state.island_params), rtol=0, atol=params_atol)
  # The islands really trained apart and the sync really moved x.
  y = jax.tree.leaves(state.island_params)[0]
  assert not np.allclose(losses[0, 0], losses[0, 1])
  if variant == "ddp":
    assert np.array_equal(y[0], y[-1])  # ddp keeps islands identical


CODECS = {
    "fp32": None,
    "int8": VARIANTS["int8"]["compression"],
    "topk": VARIANTS["topk"]["compression"],
    "sign_prune": compression_lib.Compression("sign_prune", INT8),
    "lowrank": compression_lib.Compression("lowrank", INT8, ranks=(2,)),
    "adaptive_lowrank": VARIANTS["adaptive_lowrank+ef"]["compression"],
}


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("islands", [4])  # 1, 2 and 4 islands per device
def test_codec_mean_is_the_same_on_every_placement(islands, codec):
  compression = compression_lib.as_compression(CODECS[codec])
  rng = np.random.default_rng(1)
  tree = {"w": rng.standard_normal((islands, 32, 16)).astype(np.float32),
          "v": rng.standard_normal((islands, 40)).astype(np.float32)}
  # Integer weights sum exactly in any order, so each island's share is
  # the same float on every placement.
  weights = rng.integers(1, 5, islands).astype(np.float32)
  codec_state = compression_lib.init_codec_state(
      jax.tree.map(lambda x: x[0], tree), compression)
  outputs = {}
  for d in (1, 2, islands):
    mean = placement.island_map(
        lambda t, w, s: compression_lib.island_mean(t, w, compression, s),
        _placed(islands, d), in_specs=(PER_ISLAND, PER_ISLAND, REPLICATED),
        out_specs=(PER_ISLAND, PER_ISLAND, REPLICATED), check_vma=False)
    outputs[d] = jax.device_get(jax.jit(mean)(tree, weights, codec_state))
  # Last-bit differences only: float32 psums (fp32, low-rank factors and
  # energies) add the islands in another order on another placement, and
  # XLA may vectorize the same in-order sum of decoded chunks differently
  # for another stacked shape (seen at k = 8: 1.2e-7).
  for d in (1, 2):
    helpers.assert_trees_close(outputs[d], outputs[islands], rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("variant", ["fp32", "int8", "topk",
                                     "adaptive_lowrank+ef"])
def test_one_device_outer_step_has_no_collective(variant):
  islands = 4
  settings = VARIANTS[variant]
  params, _ = helpers.tiny_problem()
  mesh = _placed(islands, 1)
  state = outer_settings.init_state(params, optax.adam(1e-2), optax.sgd(1.0),
                                    islands,
                                    settings.get("error_feedback", False),
                                    settings["compression"])
  state = jax.device_put(state, state_lib.state_shardings(state, mesh))
  weights = jax.device_put(jnp.ones(islands),
                           NamedSharding(mesh, P(mesh_lib.ISLAND)))
  hlo = outer_step_lib.make_outer_step(optax.sgd(1.0), mesh,
                                       settings["compression"]).lower(
                                   state, weights).compile().as_text()
  assert not COLLECTIVES.search(hlo), COLLECTIVES.search(hlo)


def test_folded_int8_sends_int8_across_devices():
  """8 islands on 2 devices: what crosses devices is the int8 payload."""
  islands = 8
  params, _ = helpers.tiny_problem()
  mesh = _placed(islands, 2)
  state = outer_settings.init_state(params, optax.adam(1e-2), optax.sgd(1.0), islands)
  state = jax.device_put(state, state_lib.state_shardings(state, mesh))
  weights = jax.device_put(jnp.ones(islands),
                           NamedSharding(mesh, P(mesh_lib.ISLAND)))
  hlo = outer_step_lib.make_outer_step(optax.sgd(1.0), mesh, INT8).lower(
      state, weights).compile().as_text()
  helpers.assert_compressed_one_program(hlo)


@pytest.mark.parametrize("islands,num_devices", [(4, 1), (4, 2), (8, 2),
                                                 (8, 8), (6, 3)])
def test_island_collectives_equal_their_reference(islands, num_devices):
  mesh = _placed(islands, num_devices)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((islands, islands, 3)).astype(np.float32)

  def per_island(row):
    return (communication.island_index(),
            jnp.full((), communication.island_count()),
            communication.island_psum(row),
            communication.island_all_gather(row[0]),
            communication.island_all_to_all(row))

  index, count, total, gathered, exchanged = jax.jit(placement.island_map(
      per_island, mesh, in_specs=(PER_ISLAND,), out_specs=(PER_ISLAND,) * 5,
      check_vma=False))(x)
  np.testing.assert_array_equal(index, np.arange(islands))
  np.testing.assert_array_equal(count, np.full(islands, islands))
  for i in range(islands):
    np.testing.assert_allclose(total[i], x.sum(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(gathered[i], x[:, 0])
    # Island i receives row i of every island, stacked by source.
    np.testing.assert_array_equal(exchanged[i], x[:, i])


def test_device_islands_is_the_largest_divisor_that_fits():
  assert mesh_lib.device_islands(8, 1, 1) == 1
  assert mesh_lib.device_islands(8, 1, 6) == 4
  assert mesh_lib.device_islands(8, 2, 8) == 4
  assert mesh_lib.device_islands(6, 1, 4) == 3
  assert mesh_lib.device_islands(4, 4, 3) == 0


def _read(workdir, name):
  with open(os.path.join(workdir, name)) as f:
    if name.endswith(".jsonl"):
      return [json.loads(line) for line in f]
    return json.load(f)


def _tiny_config(**overrides):
  config = tiny.get_config()
  config.diloco.islands = 4
  config.eval.num_batches = 1
  config.update_from_flattened_dict(overrides)
  return config


@pytest.mark.slow
def test_training_on_1_and_4_devices_gives_the_same_metrics(tmp_path):
  """The whole loop: same losses, evals and bytes; bytes count 4 islands."""
  summaries, metrics = {}, {}
  for d in (1, 4):
    workdir = str(tmp_path / str(d))
    summaries[d] = train.train_and_evaluate(
        _tiny_config(**{"diloco.codec": "int8"}), workdir,
        devices=jax.devices()[:d])
    metrics[d] = _read(workdir, "metrics.jsonl")
  assert summaries[1]["comm_bytes"] == summaries[4]["comm_bytes"] > 0
  steps = list(range(1, summaries[1]["total_steps"] + 1))
  assert [a["step"] for a in metrics[1]] == [b["step"] for b in metrics[4]]
  assert [a["step"] for a in metrics[1]] == steps
  for a, b in zip(metrics[1], metrics[4], strict=True):
    assert a["comm_bytes"] == b["comm_bytes"]
    assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
    assert ("eval_loss" in a) == ("eval_loss" in b)
    assert a.get("eval_loss", 0) == pytest.approx(b.get("eval_loss", 0),
                                                  rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [((4, 4), (4, 1)), ((4, 1), (2, 2))])
def test_resume_on_another_placement(tmp_path, before, after):
  """A run killed on one placement resumes on another (and with another
  island count): it continues where the uninterrupted run goes."""
  (k_before, d_before), (k_after, d_after) = before, after
  config = lambda k: _tiny_config(**{"diloco.islands": k,
                                     "checkpoint.max_to_keep": 10})
  whole, resumed = str(tmp_path / "whole"), str(tmp_path / "resumed")
  reference = train.train_and_evaluate(config(k_before), whole,
                                       devices=jax.devices()[:d_before])
  # As if killed after the checkpoint at step 4.
  test_checkpoint.forget_after(whole, resumed, 4)
  summary = train.train_and_evaluate(config(k_after), resumed,
                                     devices=jax.devices()[:d_after])
  assert summary["islands"] == k_after
  records = _read(resumed, "metrics.jsonl")
  assert [r["step"] for r in records] == list(range(1, 9))
  if k_before != k_after:
    assert np.isfinite(summary["final_eval_loss"])
    return
  # The same islands and data on another placement: rounding differences
  # only (see the module docstring).
  for a, b in zip(records, _read(whole, "metrics.jsonl"), strict=True):
    assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-4)
    assert a["comm_bytes"] == b["comm_bytes"]
  assert summary["final_eval_loss"] == pytest.approx(
      reference["final_eval_loss"], rel=1e-4)
