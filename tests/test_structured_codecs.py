"""Sparse and low-rank codecs over pytrees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_jax.config import run_config

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.codecs import dense as codecs
from diloco_jax.codecs import lowrank
from diloco_jax.codecs import sparse
from diloco_jax.parallel import communication
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel import placement
from diloco_jax.parallel.placement import PER_ISLAND, REPLICATED
from tests import helpers

FP32 = codecs.DenseCodec("fp32")
INT8 = codecs.DenseCodec("int8", 256)


def _compression(name, **settings):
  fallback = settings.pop("dense", FP32)
  return compression_lib.Compression(name, fallback, **settings)


def _run_mean(compression, tree, weights, codec_state=None, seed=None):
  """compression.island_mean on every island: (mean, sent, codec_state)."""
  islands = len(weights)
  mesh = mesh_lib.build_mesh(islands)

  def per_island(t, w, state):
    key = None if seed is None else jax.random.fold_in(
        jax.random.key(seed), communication.island_index())
    return compression_lib.island_mean(t, w, compression, state, key)

  return jax.jit(placement.island_map(
      per_island, mesh, in_specs=(PER_ISLAND, PER_ISLAND, REPLICATED),
      out_specs=(PER_ISLAND, PER_ISLAND, REPLICATED),
      check_vma=False))(tree, jnp.asarray(weights, jnp.float32), codec_state)


def _shares(weights):
  weights = np.asarray(weights, np.float64)
  return weights / weights.sum()


def _projection(basis):
  q, _ = np.linalg.qr(np.asarray(basis, np.float64))
  return q @ q.T


# ---------------------------------------------------------------- low-rank


@pytest.mark.parametrize("name", ["lowrank", "adaptive_lowrank"])
def test_lowrank_is_exact_when_the_islands_share_a_rank_r_subspace(name):
  islands, rows, cols, r = 4, 48, 40, 3
  rng = np.random.default_rng(0)
  u, v = rng.standard_normal((rows, r)), rng.standard_normal((cols, r))
  m = np.stack([u @ np.diag(rng.standard_normal(r)) @ v.T
                for _ in range(islands)]).astype(np.float32)
  compression = _compression(name, ranks=(4,))  # fp32 factors
  params = {"w": jax.ShapeDtypeStruct((rows, cols), jnp.float32)}
  state = compression_lib.init_codec_state(params, compression)
  weights = [1.0, 2.0, 0.5, 3.0]
  mean, sent, _ = _run_mean(compression, {"w": m}, weights, state)
  exact = np.tensordot(_shares(weights), m, 1)
  for i in range(islands):
    np.testing.assert_allclose(mean["w"][i], exact, rtol=1e-4, atol=1e-4)
    # Each island's own matrix lies in the shared subspace: sent in full.
    np.testing.assert_allclose(sent["w"][i], m[i], rtol=1e-4, atol=1e-4)


def test_lowrank_mean_equals_a_power_iteration_reference():
  islands, rows, cols, r = 4, 64, 32, 4
  rng = np.random.default_rng(1)
  m = rng.standard_normal((islands, rows, cols)).astype(np.float32)
  compression = _compression("lowrank", ranks=(r,))
  params = {"w": jax.ShapeDtypeStruct((rows, cols), jnp.float32)}
  state = compression_lib.init_codec_state(params, compression)
  weights = [1.0, 0.0, 2.0, 1.0]  # an island with no weight sends nothing
  mean, sent, new_state = _run_mean(compression, {"w": m}, weights, state)

  shares = _shares(weights)
  basis = np.asarray(state[0]["basis"], np.float64)
  p = sum(s * mi @ basis for s, mi in zip(shares, m))
  p_hat, _ = np.linalg.qr(p)
  mean_matrix = np.tensordot(shares, m, 1)
  expected = p_hat @ p_hat.T @ mean_matrix
  for i in range(islands):
    np.testing.assert_allclose(mean["w"][i], expected, rtol=1e-3, atol=1e-4)
  np.testing.assert_allclose(sent["w"][0], p_hat @ p_hat.T @ m[0],
                             rtol=1e-3, atol=1e-4)
  np.testing.assert_array_equal(sent["w"][1], 0.0)
  # The warm start for the next round spans the power iterate M^T P^.
  np.testing.assert_allclose(
      _projection(np.asarray(new_state[0]["basis"])[:, :r]),
      _projection(mean_matrix.T @ p_hat), atol=1e-4)
  assert np.allclose(np.asarray(new_state[0]["basis"]).T
                     @ np.asarray(new_state[0]["basis"]), np.eye(r), atol=1e-5)


def test_warm_started_power_iteration_converges_over_rounds():
  """Rounds on the same matrix refine the basis: the error falls to the
  best rank-r error (singular values past r), which one round misses."""
  rows, cols, r = 64, 48, 4
  rng = np.random.default_rng(2)
  u, _ = np.linalg.qr(rng.standard_normal((rows, cols)))
  v, _ = np.linalg.qr(rng.standard_normal((cols, cols)))
  spectrum = 0.7 ** np.arange(cols)
  m = (u * spectrum) @ v.T
  tree = {"w": np.stack([m, m]).astype(np.float32)}
  compression = _compression("lowrank", ranks=(r,))
  state = compression_lib.init_codec_state(
      {"w": jax.ShapeDtypeStruct((rows, cols), jnp.float32)}, compression)
  best = np.sqrt(np.sum(spectrum[r:] ** 2))
  errors = []
  for _ in range(6):
    mean, _, state = _run_mean(compression, tree, [1.0, 1.0], state)
    errors.append(np.linalg.norm(np.asarray(mean["w"][0]) - m))
  assert errors[0] > 1.2 * best
  assert errors[-1] < 1.02 * best
  assert all(b <= a * (1 + 1e-4) for a, b in zip(errors, errors[1:]))


def test_rank_ladder():
  assert lowrank.rank_ladder(2, 16) == (2, 4, 8, 16)
  assert lowrank.rank_ladder(3, 20) == (3, 6, 12, 20)
  assert lowrank.rank_ladder(8, 8) == (8,)


def test_choose_rank_index_by_hand():
  ranks = (2, 4, 8)
  energy = jnp.array([5.0, 3.0, 1.0, 0.5, 0.2, 0.1, 0.1, 0.1])  # sum 10
  choose = lambda e, total, index, fraction: int(lowrank.choose_rank_index(
      e, jnp.float32(total), ranks, index, fraction))
  assert choose(energy, 10.0, 2, 0.75) == 0  # 5 + 3 = 80% at rank 2
  assert choose(energy, 10.0, 2, 0.9) == 1  # 9.5 at rank 4
  assert choose(energy, 10.0, 2, 0.99) == 2  # only rank 8 keeps 100%
  # Directions are ranked by energy whatever their order.
  assert choose(energy[::-1], 10.0, 2, 0.75) == 0
  # At rank 2 with a total the basis misses: one step up the ladder.
  assert choose(energy[:2], 20.0, 0, 0.9) == 1
  assert choose(energy[:8], 100.0, 2, 0.9) == 2  # the top stays


def _matrix_with_spectrum(rng, size, singular_values):
  u, _ = np.linalg.qr(rng.standard_normal((size, size)))
  v, _ = np.linalg.qr(rng.standard_normal((size, size)))
  s = np.zeros(size)
  s[:len(singular_values)] = singular_values
  return ((u * s) @ v.T).astype(np.float32)


@pytest.mark.slow
def test_adaptive_codec_picks_the_rank_of_a_known_spectrum():
  rng = np.random.default_rng(3)
  size = 64
  spectra = {
      "rank1": [10.0] + [0.01] * 20,
      "rank4": [10.0] * 4,
      "rank8": [10.0] * 8,
      "flat": [1.0] * 64,
  }
  matrices = {name: _matrix_with_spectrum(rng, size, s)
              for name, s in spectra.items()}
  tree = {name: np.stack([m, m]) for name, m in matrices.items()}
  compression = _compression("adaptive_lowrank", ranks=(2, 4, 8, 16),
                             energy_fraction=0.9, factor_codec=INT8)
  shapes = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype),
                        matrices)
  state = compression_lib.init_codec_state(shapes, compression)
  assert compression_lib.rank_indices(state) == [3, 3, 3, 3]  # the top
  _, _, state = _run_mean(compression, tree, [1.0, 1.0], state)
  chosen = dict(zip(sorted(matrices), compression_lib.rank_indices(state)))
  ranks = {name: compression.ranks[i] for name, i in chosen.items()}
  assert ranks == {"flat": 16, "rank1": 2, "rank4": 4, "rank8": 8}

  # Starting too low, the rank climbs one rung per round and then stays.
  low = tuple({**s, "rank_index": jnp.array(0, jnp.int32)} for s in state)
  seen = []
  for _ in range(3):
    _, _, low = _run_mean(compression, tree, [1.0, 1.0], low)
    seen.append(compression_lib.rank_indices(low)[sorted(matrices).index(
        "rank8")])
  assert seen == [1, 2, 2]


# ------------------------------------------------------------------ sparse


def test_sparse_positions_round_trip_as_indices_or_bitmask():
  rng = np.random.default_rng(4)
  for length, keep, bitmask in ((100, 50, True), (100, 3, False),
                                (70000, 700, False), (20, 10, True)):
    x = jnp.asarray(rng.standard_normal(length), jnp.float32)
    positions = sparse.select_largest(x, keep)
    payload = sparse.encode(x, keep)
    assert sparse.uses_bitmask(length, keep) == bitmask
    decoded = np.asarray(sparse.decode(payload, length))
    np.testing.assert_array_equal(np.flatnonzero(decoded), positions)
    np.testing.assert_array_equal(decoded[positions], np.asarray(x)[positions])
    assert (payload["positions"].nbytes + payload["values"].nbytes
            == sparse.payload_bytes(length, keep))
    top = np.sort(np.argsort(-np.abs(np.asarray(x)))[:keep])
    np.testing.assert_array_equal(positions, top)


def _tree(islands, seed=5):
  rng = np.random.default_rng(seed)
  return {"w": rng.standard_normal((islands, 24, 10)).astype(np.float32),
          "b": rng.standard_normal((islands, 10)).astype(np.float32)}


def _top_positions(x, keep):
  return np.argsort(-np.abs(x), kind="stable")[:keep]


def _keep_largest(x, keep):
  """x with all but its `keep` largest magnitudes zeroed (a 1-D array)."""
  kept = np.zeros_like(x)
  top = _top_positions(x, keep)
  kept[top] = x[top]
  return kept


def _check_reduce_scatter_reference(mean, sent, expected_mean, kept,
                                    dropped, owner, weights, adds_up):
  """mean = the reference on every island; each island's attributed `sent`
  is its own kept values less the cut of the chunk it merged; and, for a
  merge that is a weighted sum, the attributed contributions add up to the
  mean."""
  shares = _shares(weights)
  for i in range(len(weights)):
    np.testing.assert_allclose(mean[i], expected_mean, rtol=1e-5, atol=1e-6)
    charged = np.where(owner == i, dropped / shares[i], 0.0)
    np.testing.assert_allclose(sent[i], kept[i] - charged, rtol=1e-5,
                               atol=1e-5)
  if adds_up:
    np.testing.assert_allclose(np.tensordot(shares, sent, 1), expected_mean,
                               rtol=1e-5, atol=1e-5)


def test_topk_mean_equals_the_host_reference():
  """Top-k per island chunk, summed, cut back to k per chunk."""
  islands, fraction = 4, 0.1
  tree = _tree(islands)
  weights = [1.0, 3.0, 2.0, 2.0]
  mean, sent, _ = _run_mean(_compression("topk", topk_fraction=fraction),
                            tree, weights)
  n = 240
  chunk = n // islands
  keep = sparse.keep_count(chunk, fraction)
  flat = tree["w"].reshape(islands, islands, chunk)  # [island, chunk j, :]
  kept = np.stack([[_keep_largest(flat[i, j], keep) for j in range(islands)]
                   for i in range(islands)])
  reduced = np.tensordot(_shares(weights), kept, 1)  # [chunk j, :]
  merged = np.stack([_keep_largest(r, keep) for r in reduced])
  owner = np.repeat(np.arange(islands), chunk).reshape(tree["w"].shape[1:])
  as_matrix = lambda x: x.reshape(x.shape[:-2] + tree["w"].shape[1:])
  _check_reduce_scatter_reference(
      mean["w"], sent["w"], as_matrix(merged), as_matrix(kept),
      as_matrix(reduced - merged), owner, weights, adds_up=True)
  exact_b = np.tensordot(_shares(weights), tree["b"], 1)  # fp32 fallback
  for i in range(islands):
    np.testing.assert_allclose(mean["b"][i], exact_b, rtol=1e-5, atol=1e-6)


def _ties_reference(values, shares):
  """Sign election and disjoint mean, coordinate by coordinate."""
  elected = np.sign(np.tensordot(shares, values, 1))
  agrees = (np.sign(values) == elected) & (values != 0)
  mass = np.tensordot(shares, np.where(agrees, values, 0), 1)
  weight = np.tensordot(shares, agrees.astype(np.float64), 1)
  return np.where(weight > 0, mass / np.where(weight > 0, weight, 1), 0)


def test_sign_prune_keeps_each_neuron_and_merges_like_ties():
  """Per-neuron pruning, TIES merge by the neuron's owner, pruned again."""
  islands, rate = 4, 0.5
  tree = _tree(islands, seed=6)
  weights = [1.0, 2.0, 1.0, 0.5]
  mean, sent, _ = _run_mean(_compression("sign_prune", prune_rate=rate),
                            tree, weights)
  rows, cols = tree["w"].shape[1:]
  keep = sparse.keep_count(rows, 1 - rate)
  prune = lambda m: np.stack([_keep_largest(m[:, c], keep)
                              for c in range(cols)], axis=1)
  kept = np.stack([prune(tree["w"][i]) for i in range(islands)])
  assert np.all((kept != 0).sum(axis=1) == keep)  # per neuron
  merged = _ties_reference(kept, _shares(weights))
  pruned = prune(merged)
  per_island = -(-cols // islands)  # neurons 3j..3j+2 are island j's
  owner = np.broadcast_to(np.arange(cols) // per_island, (rows, cols))
  _check_reduce_scatter_reference(mean["w"], sent["w"], pruned, kept,
                                  merged - pruned, owner, weights,
                                  adds_up=False)


def test_sparse_codec_charges_nothing_to_an_island_without_weight():
  tree = _tree(4)
  weights = [1.0, 0.0, 2.0, 1.0]
  for name in ("topk", "sign_prune"):
    mean, sent, _ = _run_mean(_compression(name, topk_fraction=0.1),
                              tree, weights)
    np.testing.assert_array_equal(sent["w"][1], 0.0)
    assert np.all(np.isfinite(mean["w"]))


# ------------------------------------------------------- bytes and feedback


def test_structured_byte_counts_by_hand():
  tree = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32),
          "b": jax.ShapeDtypeStruct((32,), jnp.float32)}
  k = 4
  weight_psum = 2 * (k - 1) * 4
  # b through int8: 32 values -> blocks of 8 (one island's chunk), 8 int8
  # values + one f32 scale per chunk, out in the all_to_all and all_gather.
  fallback = 2 * (k - 1) * (8 + 4)
  base = weight_psum + fallback
  count = lambda c, **kw: compression_lib.mean_bytes(tree, k, c, **kw)

  # Sparse codecs: (k-1) chunk payloads out in each of the two phases.
  topk = _compression("topk", dense=INT8, topk_fraction=0.01)
  # Chunks of 512 values keep 5: uint16 indices (10 B) beat a bitmask (64 B).
  assert count(topk) == base + 2 * (k - 1) * (5 * 4 + 5 * 2)

  prune = _compression("sign_prune", dense=INT8, prune_rate=0.5)
  # Chunks of 8 neurons (columns), each 32 of 64 values + an 8-byte bitmask;
  # plus every island's weight.
  assert count(prune) == (base + (k - 1) * 4
                          + 2 * (k - 1) * 8 * (32 * 4 + 8))

  low = _compression("lowrank", dense=INT8, ranks=(4,))
  # fp32 ring all-reduces of P (64 x 4) and C (32 x 4).
  assert count(low) == base + 2 * (k - 1) * (64 + 32) * 4

  adaptive = _compression("adaptive_lowrank", dense=INT8, ranks=(2, 4),
                          factor_codec=INT8)
  # rank 2: P has 128 values (chunks of 32 int8 + 1 scale), C has 64
  # (chunks of 16 + 1 scale); the 3 energies are an fp32 all-reduce.
  rank2 = 2 * (k - 1) * ((32 + 4) + (16 + 4) + 1 * 4)
  assert count(adaptive, rank_indices=[0]) == base + rank2
  rank4 = 2 * (k - 1) * ((64 + 4) + (32 + 4) + 2 * 4)
  assert count(adaptive, rank_indices=[1]) == base + rank4
  assert count(adaptive) == base + rank4  # the top by default
  assert compression_lib.mean_bytes(tree, 1, adaptive) == 0


@pytest.mark.parametrize("islands", [2, 4, 8])
def test_adaptive_codec_sends_over_ten_times_less_than_fp32(islands):
  from configs import default  # pylint: disable=g-import-not-at-top
  from diloco_jax.model import transformer as model_lib  # pylint: disable=g-import-not-at-top
  from diloco_jax.parallel import communication  # pylint: disable=g-import-not-at-top
  config = default.get_config()
  config.diloco.codec = "adaptive_lowrank"
  shapes = model_lib.param_shapes(config.model)
  fp32 = communication.island_mean_bytes(shapes, islands)
  top = compression_lib.mean_bytes(
      shapes, islands, run_config.compression(config.diloco))
  assert fp32 / top > 10  # even at the largest rank


@pytest.mark.parametrize("name", ["topk", "sign_prune"])
def test_sparse_codecs_keep_their_ratio_at_any_island_count(name):
  """The reduce-scatter + all-gather sends 2(k-1)/k of a payload, as the
  fp32 ring does: the ratio does not fall as k grows (an all-gather of
  whole payloads would lose a factor k/2)."""
  from configs import default  # pylint: disable=g-import-not-at-top
  from diloco_jax.model import transformer as model_lib  # pylint: disable=g-import-not-at-top
  from diloco_jax.parallel import communication  # pylint: disable=g-import-not-at-top
  config = default.get_config()
  config.diloco.codec = name
  shapes = model_lib.param_shapes(config.model)
  compression = run_config.compression(config.diloco)
  ratios = [communication.island_mean_bytes(shapes, k)
            / compression_lib.mean_bytes(shapes, k, compression)
            for k in (2, 4, 8)]
  assert max(ratios) / min(ratios) < 1.1, ratios
  assert min(ratios) > (1.8 if name == "sign_prune" else 8.0), ratios


@pytest.mark.parametrize("name", ["topk", "sign_prune", "lowrank",
                                  "adaptive_lowrank"])
def test_error_feedback_conserves_mass_and_catches_up(name):
  """What each round's mean takes from the islands is what they report
  sent (so x's moves plus the residuals are the inputs), and the residual
  stays bounded: what a round leaves behind is sent later."""
  islands, rounds = 2, 8
  compression = _compression(name, topk_fraction=0.2, prune_rate=0.5,
                             ranks=(2, 4), factor_codec=INT8,
                             energy_fraction=0.9)
  rng = np.random.default_rng(7)
  # Like pseudo-gradients: a shared part with a decaying spectrum, plus
  # each island's own noise.
  shared = (rng.standard_normal((32, 24)) * 0.8 ** np.arange(24)) @ np.linalg.qr(
      rng.standard_normal((24, 24)))[0]
  signal = (shared + 0.1 * rng.standard_normal((islands, 32, 24))).astype(
      np.float32)
  state = compression_lib.init_codec_state(
      {"w": jax.ShapeDtypeStruct((32, 24), jnp.float32)}, compression)
  # top-k merges by weighted sum, and low rank's mean is P^ (sum_i s_i
  # C_i)^T of the islands' own P^ C_i^T (float32 factors): the mean is the
  # islands' sends, to float32 rounding (measured: 2.4e-7 at values ~1).
  # Not so for sign_prune (its mean is a sign election, not a sum) nor
  # for adaptive_lowrank's int8 factors, whose sum is rounded once more
  # without error feedback.
  sums_sends = name in ("topk", "lowrank")
  residual = np.zeros_like(signal)
  for _ in range(rounds):
    v = signal + residual
    mean, sent, state = _run_mean(compression, {"w": v}, [1.0, 1.0], state)
    sent = np.asarray(sent["w"])
    if sums_sends:
      for i in range(islands):
        np.testing.assert_allclose(mean["w"][i], sent.mean(axis=0), rtol=0,
                                   atol=1e-6)
    residual = v - sent
  assert np.abs(residual).max() > 1e-3  # the codec really dropped something
  # Without feedback the dropped part would pile up: rounds x one round's.
  one_round_loss = np.linalg.norm(signal - np.asarray(_run_mean(
      compression, {"w": signal}, [1.0, 1.0],
      compression_lib.init_codec_state(
          {"w": jax.ShapeDtypeStruct((32, 24), jnp.float32)},
          compression))[1]["w"]))
  assert np.linalg.norm(residual) < 0.5 * rounds * one_round_loss


# ------------------------------------------------------------- outer step


@pytest.mark.parametrize("name", ["topk", "sign_prune", "lowrank",
                                  "adaptive_lowrank"])
def test_outer_step_leaves_every_island_with_the_same_params(name):
  islands = 4
  compression = _compression(name, dense=INT8, topk_fraction=0.1,
                             ranks=(2, 4) if name == "adaptive_lowrank"
                             else (2,), factor_codec=INT8)
  state, outer, weights = helpers.state_after_one_inner_step(islands, compression)
  for _ in range(2):
    state = outer(state, weights)
  y = jax.device_get(state.island_params)
  x = jax.device_get(state.global_params)
  for i in range(islands):
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[i], b), y, x)
  assert int(state.round) == 2


@pytest.mark.slow
def test_adaptive_outer_step_is_one_program_with_int8_factors():
  compression = _compression("adaptive_lowrank", dense=INT8, ranks=(2, 4),
                             factor_codec=INT8)
  state, outer, weights = helpers.state_after_one_inner_step(2, compression)
  hlo = outer.lower(state, weights).compile().as_text()
  assert "conditional" in hlo  # the rank ladder's branches
  helpers.assert_compressed_one_program(hlo)  # quantized factors, s8


@pytest.mark.parametrize("name,positions", [("topk", "u16["),
                                            ("sign_prune", "u8[")])
def test_sparse_outer_step_is_one_program_exchanging_sparse_chunks(
    name, positions):
  """Positions (uint16 indices for top-k, bitmasks for pruning) cross the
  link in the all_to_all, and no float32 tensor of any size does."""
  compression = _compression(name, dense=INT8, topk_fraction=0.01)
  state, outer, weights = helpers.state_after_one_inner_step(2, compression)
  hlo = outer.lower(state, weights).compile().as_text()
  all_to_all = " ".join(helpers.collective_types(hlo, "all-to-all"))
  assert positions in all_to_all, all_to_all
  helpers.assert_compressed_one_program(hlo, wire_type=positions)


# ------------------------------------------------------------- training


def _tiny_adaptive_config():
  from configs import tiny  # pylint: disable=g-import-not-at-top
  c = tiny.get_config()
  c.total_steps, c.diloco.inner_steps = 12, 3
  c.diloco.codec, c.diloco.error_feedback = "adaptive_lowrank", True
  c.diloco.lowrank.update(min_rank=2, max_rank=4)
  c.diloco.stochastic_rounding = True
  c.checkpoint.max_to_keep = 20
  return c


@pytest.mark.slow
def test_training_with_the_adaptive_codec_counts_its_bytes(tmp_path):
  import json  # pylint: disable=g-import-not-at-top
  from diloco_jax.model import transformer as model_lib
  from diloco_jax.run import train  # pylint: disable=g-import-not-at-top
  config = _tiny_adaptive_config()
  summary = train.train_and_evaluate(config, str(tmp_path))
  with open(tmp_path / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  ranks = [r["codec_mean_rank"] for r in records if "codec_mean_rank" in r]
  assert len(ranks) == 4 and all(2 <= r <= 4 for r in ranks)
  shapes = model_lib.param_shapes(config.model)
  compression = run_config.compression(config.diloco)
  assert compression.ranks == (2, 4)
  factored = sum(compression.is_structured_leaf(x.shape)
                 for x in jax.tree.leaves(shapes))
  assert factored >= 4
  per_round = {i: compression_lib.mean_bytes(shapes, 2, compression,
                                             [i] * factored) for i in (0, 1)}
  assert 4 * per_round[0] <= summary["comm_bytes"] <= 4 * per_round[1]
  assert summary["compression_vs_fp32"] == pytest.approx(
      4 * records[-1]["ddp_comm_bytes"] / 12 / summary["comm_bytes"])
  assert summary["codec"] == "adaptive_lowrank"


@pytest.mark.slow
def test_resume_with_the_adaptive_codec_state_is_exact(tmp_path):
  from tests import test_checkpoint  # pylint: disable=g-import-not-at-top
  test_checkpoint.check_resume_from_round_2(_tiny_adaptive_config, tmp_path)


@pytest.mark.slow
def test_changing_the_rank_range_is_an_incompatible_checkpoint(tmp_path):
  from diloco_jax.storage import checkpoints as checkpointing
  from diloco_jax.run import train  # pylint: disable=g-import-not-at-top
  config = _tiny_adaptive_config()
  config.total_steps = 3
  train.train_and_evaluate(config, str(tmp_path))
  config.total_steps = 6
  config.diloco.lowrank.max_rank = 8
  # Even when the config change is allowed, the codec state must match.
  config.resume.allow_changes = "total_steps,diloco.lowrank"
  with pytest.raises(checkpointing.IncompatibleCheckpointError,
                     match="codec_state"):
    train.train_and_evaluate(config, str(tmp_path))
