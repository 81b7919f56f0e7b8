"""Structured codecs on FSDP islands: each device codes the shards it holds.

Top-k, sign pruning and SparseLoCo select within each device's pieces
(compression.py, placement.stripe_pieces): the same as a replicated island
whose codec cuts the same pieces, so that is the counterpart they must
equal. Low rank and adaptive low rank factor whole matrices from their
pieces (sharded_lowrank.py): they must equal the whole-matrix codec of a
replicated island. Tolerances: the same sums in another order (products
reduced over the shard axis, the orthonormal basis of a row permutation of
P, whose column signs may flip and cancel in P^ C^T), float32 rounding
only: rtol 1e-5 and atol 1e-6 on values of order 1e-2.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import island_sync as island_sync_lib
from diloco_jax.algorithm import outer_settings
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.codecs import dense as codecs
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel import placement
from tests import helpers
from tests import test_fsdp

ISLANDS = 2
FP32 = codecs.DenseCodec("fp32")
SELECTING = {
    "topk": compression_lib.Compression("topk", FP32, topk_fraction=0.05),
    "sign_prune": compression_lib.Compression("sign_prune", FP32,
                                              prune_rate=0.5),
    "sparseloco": compression_lib.Compression(
        "sparseloco", FP32, chunk_size=256, density=0.05, value_bits=2,
        feedback_decay=0.95),
}
FACTORING = {
    "lowrank": compression_lib.Compression("lowrank", FP32, ranks=(4,)),
    # Factors in float32 so the comparison is of the sharded algebra; the
    # ladder and the energies that choose the next rank are exercised.
    "adaptive_lowrank": compression_lib.Compression(
        "adaptive_lowrank", FP32, ranks=(2, 4, 8), energy_fraction=0.5),
}


def _sync_inputs(compression, mesh, fsdp: bool):
  """x, islands' params a step of noise away, zero residuals and the codec
  state, placed on `mesh` (split over 'data' with `fsdp`)."""
  params, _ = test_fsdp._problem()  # pylint: disable=protected-access
  state = outer_settings.init_state(params, optax.adam(1e-3), optax.sgd(1.0),
                                    ISLANDS, error_feedback=True,
                                    compression=compression)
  keys = jax.random.split(jax.random.key(0), len(jax.tree.leaves(params)))
  noise = jax.tree.unflatten(jax.tree.structure(params), [
      0.01 * jax.random.normal(k, (ISLANDS,) + x.shape)
      for k, x in zip(keys, jax.tree.leaves(params))])
  state = state.replace(island_params=jax.tree.map(
      jnp.add, state.island_params, noise))
  state = jax.device_put(state, state_lib.state_shardings(state, mesh, fsdp))
  weights = jax.device_put(jnp.array([1.0, 3.0]),
                           NamedSharding(mesh, P(mesh_lib.ISLAND)))
  return state, weights


def _sync(compression, data: int, fsdp: bool, stripes=None):
  """The island sync's (mean, residuals, codec state) on islands of `data`
  devices, twice (the second round from the first's codec state)."""
  mesh = test_fsdp._mesh(data)  # pylint: disable=protected-access
  state, weights = _sync_inputs(compression, mesh, fsdp)
  sync = jax.jit(island_sync_lib.make_island_sync(
      mesh, compression, fsdp=fsdp, stripes=stripes))
  with jax.set_mesh(mesh):
    codec_state = state.outer.codec_state
    for round_index in range(2):
      mean, residuals, codec_state, included, _ = sync(
          state.global_params, state.island_params, state.outer.residuals,
          codec_state, weights, round_index)
  assert bool(np.all(included))
  return jax.device_get((mean, residuals, codec_state))


def _assert_close(a, b):
  """Means and residuals to float rounding; a low-rank codec state's next
  basis (the left singular vectors of C) as the same subspace, column by
  column up to sign: an SVD turns C's rounding into ~1e-5 of its vectors
  (more where singular values are close), and it is only a warm start."""
  (mean_a, residuals_a, state_a), (mean_b, residuals_b, state_b) = a, b
  helpers.assert_trees_close((mean_a, residuals_a), (mean_b, residuals_b),
                             rtol=1e-5, atol=1e-6)
  for leaf_a, leaf_b in zip(state_a or (), state_b or (), strict=True):
    assert int(leaf_a["rank_index"]) == int(leaf_b["rank_index"])
    overlap = np.abs(np.asarray(leaf_a["basis"]).T
                     @ np.asarray(leaf_b["basis"]))
    np.testing.assert_allclose(np.diag(overlap), 1.0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SELECTING))
def test_a_selecting_codec_on_fsdp_devices_equals_the_same_pieces_whole(name):
  """Each of 2 FSDP devices selects within its own shards: the mean and
  the residuals equal those of a replicated island coding the same
  pieces (the outer device of outer_placement='host' codes them so)."""
  compression = SELECTING[name]
  sharded = _sync(compression, 2, True)
  whole = _sync(compression, 1, False, stripes=2)
  _assert_close(sharded, whole)
  # And the pieces matter: one piece per island selects otherwise (on the
  # leaves split by columns at least; SparseLoCo's chunks of a leaf split
  # by rows fall on the same values either way).
  one_piece = _sync(compression, 1, False)
  assert not all(np.allclose(a, b, rtol=1e-3) for a, b in zip(
      jax.tree.leaves(sharded[0]), jax.tree.leaves(one_piece[0])))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FACTORING))
@pytest.mark.parametrize("data", [2, 4])
def test_low_rank_on_fsdp_devices_equals_the_whole_matrix_codec(name, data):
  """Matrices split by rows and by columns (and the small ones kept whole,
  cut into row blocks) factor as the whole matrix does: mean, residuals,
  next basis and rank, over two rounds."""
  compression = FACTORING[name]
  _assert_close(_sync(compression, data, True), _sync(compression, 1, False))


def test_the_pieces_cover_split_and_whole_leaves():
  params, _ = test_fsdp._problem()  # pylint: disable=protected-access
  axes = {placement.stripe_axis(x.shape, 4) for x in jax.tree.leaves(params)}
  # Leaves split along their rows, along their columns, and kept whole.
  assert {0, 1, None} <= axes, axes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["topk", "sparseloco", "lowrank",
                                  "adaptive_lowrank"])
def test_an_fsdp_outer_step_gathers_no_matrix(name):
  """On 4 devices per island: no float32 collective as large as a
  twentieth of the model (a matrix gathered), and the outer step's
  temporaries per device under half the replicated island's."""
  compression = {**SELECTING, **FACTORING}[name]
  data = 4
  params, _ = test_fsdp._problem()  # pylint: disable=protected-access
  model_floats = sum(x.size for x in jax.tree.leaves(params))
  temps = {}
  for fsdp in (False, True):
    mesh = test_fsdp._mesh(data)  # pylint: disable=protected-access
    state, weights = _sync_inputs(compression, mesh, fsdp)
    compiled = outer_step_lib.make_outer_step(
        optax.sgd(1.0), mesh, compression, fsdp=fsdp).lower(
            state, weights).compile()
    temps[fsdp] = compiled.memory_analysis().temp_size_in_bytes
  for types in helpers.collective_types(compiled.as_text()):
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", types):
      size = int(np.prod([int(d) for d in dims.split(",") if d]))
      assert dtype != "f32" or size < model_floats / 20, types
  assert temps[True] < 0.5 * temps[False], temps


@pytest.mark.parametrize("name", ["topk", "sparseloco", "lowrank",
                                  "adaptive_lowrank"])
def test_an_fsdp_island_sends_what_it_would_send_whole(name):
  """Bytes: each device sends its pieces' payloads (or its part of each
  factor); together within 5% of one replicated island's (each piece
  rounds its kept count and pads its factor part)."""
  compression = {**SELECTING, **FACTORING}[name]
  params, _ = test_fsdp._problem()  # pylint: disable=protected-access
  whole = compression_lib.mean_bytes(params, 4, compression)
  for stripes in (2, 4):
    sharded = compression_lib.mean_bytes(params, 4, compression,
                                         stripes=stripes)
    assert sharded == pytest.approx(whole, rel=0.05), (stripes, sharded,
                                                       whole)


# Whole runs: 2 islands of 2 FSDP devices, the tiny config with matrices
# large enough to be split (placement.MIN_FSDP_ELEMENTS), 2 rounds.
FSDP_RUN = {"mesh.data": 2, "mesh.fsdp": True, "model.d_model": 64,
            "model.num_heads": 4, "model.head_dim": 16, "model.mlp_dim": 256,
            "diloco.error_feedback": True}


def _train(workdir, **overrides):
  from configs import tiny  # pylint: disable=g-import-not-at-top
  from diloco_jax.run import train  # pylint: disable=g-import-not-at-top
  return train.train_and_evaluate(
      helpers.with_overrides(tiny.get_config(), {**FSDP_RUN, **overrides}),
      str(workdir))


@pytest.mark.slow
def test_a_low_rank_run_on_fsdp_islands_equals_replicated_and_resumes(
    tmp_path):
  """Low rank (rank 2): the FSDP run trains as the replicated islands'
  run (the inner steps' gradients are reduced over the devices in another
  order, which Adam carries; the codec adds only float rounding): losses
  to 1e-5, the same bytes to padding; and a rerun killed after round 1
  ends bit for bit as the whole run."""
  from tests import test_checkpoint  # pylint: disable=g-import-not-at-top
  codec = {"diloco.codec": "lowrank", "diloco.lowrank.rank": 2,
           "diloco.error_feedback": False}
  sharded = _train(tmp_path / "fsdp", **codec)
  replicated = _train(tmp_path / "replicated", **codec,
                      **{"mesh.fsdp": False})
  assert sharded["final_eval_loss"] == pytest.approx(
      replicated["final_eval_loss"], rel=1e-5)
  assert sharded["comm_bytes"] == pytest.approx(replicated["comm_bytes"],
                                                rel=0.05)
  losses = lambda run: [r["train_loss"] for r in test_checkpoint._metrics(  # pylint: disable=protected-access
      str(tmp_path / run))]
  np.testing.assert_allclose(losses("fsdp"), losses("replicated"), rtol=1e-5)
  # x: Adam turns a gradient that cancels to its rounding level into a
  # step of up to ~lr on a few params (measured 3.5e-4 on norm scales).
  final = lambda run: test_checkpoint._final_state(str(tmp_path / run))  # pylint: disable=protected-access
  helpers.assert_trees_close(final("fsdp")["global_params"],
                             final("replicated")["global_params"],
                             rtol=0, atol=1e-3)
  test_checkpoint.forget_after(str(tmp_path / "fsdp"),
                               str(tmp_path / "resumed"), 4)
  resumed = _train(tmp_path / "resumed", **codec)
  assert resumed["resumed_from_step"] == 4
  test_checkpoint._assert_identical_runs(str(tmp_path / "fsdp"),  # pylint: disable=protected-access
                                         str(tmp_path / "resumed"))


@pytest.mark.slow
def test_sparseloco_on_fsdp_islands_equals_its_outer_device_run(tmp_path):
  """SparseLoCo on FSDP islands, coded on the islands' devices, against
  the same run with the outer step on a device of its own, which holds
  whole islands and codes the same pieces: equal to float summation
  order (test_multihost's comparison)."""
  from tests import test_multihost  # pylint: disable=g-import-not-at-top
  sparseloco = {"diloco.outer_optimizer.name": "sparseloco",
                "diloco.sparseloco.chunk_size": 256}
  device = _train(tmp_path / "device", **sparseloco)
  host = _train(tmp_path / "host", **sparseloco,
                **{"diloco.outer_placement": "host"})
  assert host["outer_placement"] == "host"
  assert host["comm_bytes"] == device["comm_bytes"]
  test_multihost._assert_close_runs(str(tmp_path / "device"),  # pylint: disable=protected-access
                                    str(tmp_path / "host"))
