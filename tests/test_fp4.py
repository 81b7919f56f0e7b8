"""The fp4 (e2m1) dense codec: its grid, rounding, packing, collective and
bytes, checked against references written independently of codecs/dense.py."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from diloco_jax.config import run_config

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.codecs import dense as codecs
from diloco_jax.config import schema as config_schema
from diloco_jax.config import validation
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel import placement
from diloco_jax.parallel.placement import PER_ISLAND
from tests import helpers

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# Every signed grid value, -0.0 aside.
SIGNED_GRID = np.concatenate([-GRID[:0:-1], GRID])


def _round_trip(x, block_size=64, key=None):
  codec = codecs.make_codec("fp4", block_size)
  return np.asarray(codec.decode(codec.encode(jnp.asarray(x), key)))


def _neighbours(a):
  """The grid interval [lower, upper] holding each magnitude a in [0, 6]:
  the one starting at a for a grid point, and [4, 6] for 6."""
  lower = np.clip(np.searchsorted(GRID, a, side="right") - 1, 0, 6)
  return GRID[lower], GRID[lower + 1]


def _reference_round_trip(x, block_size):
  """fp4 encode + decode on the host: ml_dtypes' e2m1 cast rounds to
  nearest, ties to even, as the codec says it does."""
  blocks = np.asarray(x, np.float32).reshape(-1, block_size)
  absmax = np.abs(blocks).max(axis=1, keepdims=True)
  scale = np.where(absmax > 0, absmax / np.float32(6), np.float32(1))
  scaled = np.clip(blocks / scale, -6, 6)
  values = scaled.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
  return (values * scale).reshape(-1)


@pytest.mark.parametrize("scale", [1.0, 2.0 ** -20, 0.37, 1234.5])
def test_every_grid_value_times_a_scale_round_trips(scale):
  # The 15 signed grid values and another 6, twice over: one block of 32.
  g = np.concatenate([SIGNED_GRID, [6.0], SIGNED_GRID[::-1], [6.0]])
  x = (g * np.float32(scale)).astype(np.float32)
  codec = codecs.make_codec("fp4", block_size=32)
  payload = codec.encode(jnp.asarray(x))
  # The codes are the OCP e2m1 bit patterns of the grid values.
  expected_codes = g.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
  np.testing.assert_array_equal(
      np.asarray(codecs._unpack_codes(payload["values"])), expected_codes)
  decoded = np.asarray(codec.decode(payload))
  stochastic = _round_trip(x, 32, jax.random.key(3))
  if math.log2(scale).is_integer():  # the scale absmax / 6 is then exact
    np.testing.assert_array_equal(decoded, x)
    np.testing.assert_array_equal(stochastic, x)
  else:  # the same grid points; the scale may be one rounding off
    np.testing.assert_allclose(decoded, x, rtol=3e-7, atol=0)
    np.testing.assert_allclose(stochastic, x, rtol=3e-7, atol=0)


def test_nearest_rounding_matches_the_e2m1_cast_ties_to_even():
  rng = np.random.default_rng(0)
  x = rng.standard_normal(64 * 100).astype(np.float32).reshape(-1, 64)
  x[:, 0] = 6.0  # scale 1: the midpoints below are exact ties
  midpoints = (GRID[1:] + GRID[:-1]) / 2
  x[0, 1:15] = np.concatenate([midpoints, -midpoints])
  x = x.reshape(-1)
  decoded = _round_trip(x)
  np.testing.assert_array_equal(decoded, _reference_round_trip(x, 64))
  # Ties go to the even code (mantissa bit 0): 0.25 -> 0, 0.75 -> 1,
  # 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
  np.testing.assert_array_equal(decoded[1:8], [0, 1, 1, 2, 2, 4, 4])


def test_nearest_error_is_at_most_half_the_local_spacing_times_the_scale():
  rng = np.random.default_rng(1)
  # Blocks of very different magnitudes, and heavy tails within blocks.
  x = (rng.standard_t(2, 64 * 64)
       * np.repeat(10.0 ** rng.uniform(-6, 2, 64), 64)).astype(np.float32)
  blocks = x.reshape(-1, 64)
  scale = np.abs(blocks).max(axis=1, keepdims=True) / 6
  a = np.minimum(np.abs(blocks) / scale, 6)
  lower, upper = _neighbours(a)
  bound = ((upper - lower) / 2 * scale).reshape(-1)
  error = np.abs(_round_trip(x) - x)
  assert np.all(error <= bound * (1 + 1e-6)), np.max(error - bound)
  # And the codec's own bound (used by test_codecs) is the same spacing.
  codec_bound = np.asarray(
      codecs.make_codec("fp4", 64).max_abs_error(jnp.asarray(x)))
  np.testing.assert_allclose(codec_bound, bound, rtol=1e-6)


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
  rng = np.random.default_rng(2)
  y = rng.uniform(-6, 6, 256).astype(np.float32)
  y[0] = 6.0  # scale exactly 1
  # Values just off the range ends and next to zero.
  y[1:9] = [1.99, 2.01, 3.99, 4.01, 5.99, 0.01, -0.01, -1.99]
  codec = codecs.make_codec("fp4", block_size=256)
  num_keys = 4000
  keys = jax.random.split(jax.random.key(0), num_keys)
  decoded = np.asarray(jax.jit(jax.vmap(
      lambda k: codec.decode(codec.encode(jnp.asarray(y), k))))(keys))
  lower, upper = _neighbours(np.abs(y))
  sign = np.sign(y)
  assert np.all((decoded == sign * lower) | (decoded == sign * upper))
  p = (np.abs(y) - lower) / (upper - lower)  # the chance of the upper one
  std_of_mean = (upper - lower) * np.sqrt(p * (1 - p) / num_keys)
  bias = np.abs(decoded.mean(axis=0) - y)
  assert np.all(bias <= 5 * std_of_mean + 1e-6), np.max(bias - 5 * std_of_mean)
  # Nearest rounding of the same values errs far beyond that.
  assert np.abs(_round_trip(y, 256) - y).mean() > 20 * bias.mean()


def test_stochastic_rounding_is_unbiased_at_any_scale():
  rng = np.random.default_rng(3)
  x = (rng.standard_normal(512) * 0.037).astype(np.float32)
  codec = codecs.make_codec("fp4", block_size=128)
  num_keys = 4000
  keys = jax.random.split(jax.random.key(1), num_keys)
  decoded = np.asarray(jax.jit(jax.vmap(
      lambda k: codec.decode(codec.encode(jnp.asarray(x), k))))(keys))
  blocks = x.reshape(-1, 128)
  scale = np.abs(blocks).max(axis=1, keepdims=True) / 6
  lower, upper = _neighbours(np.minimum(np.abs(blocks) / scale, 6))
  # The standard deviation of one rounding is at most half the spacing.
  std_of_mean = ((upper - lower) / 2 * scale).reshape(-1) / math.sqrt(num_keys)
  assert np.all(np.abs(decoded.mean(axis=0) - x) <= 5 * std_of_mean + 1e-7)


def test_codes_pack_two_per_byte_low_nibble_first():
  codes = jnp.arange(16, dtype=jnp.uint8)
  codes = jnp.concatenate([codes, codes[::-1]])
  packed = codecs._pack_codes(codes)
  assert packed.dtype == jnp.uint8 and packed.shape == (16,)
  assert int(packed[0]) == 0x10 and int(packed[1]) == 0x32  # (0, 1), (2, 3)
  np.testing.assert_array_equal(codecs._unpack_codes(packed), codes)
  # int4 packs through the same layout, offset by 8.
  q = jnp.array([-7, 7], jnp.int8)
  assert int(codecs._pack_nibbles(q)[0]) == 0xF1


def test_encoding_is_jittable_and_shape_static():
  codec = codecs.make_codec("fp4", block_size=64)
  shapes = jax.eval_shape(codec.encode,
                          jax.ShapeDtypeStruct((256,), jnp.float32),
                          jax.random.key(0))
  assert shapes["values"].shape == (128,)
  assert shapes["values"].dtype == jnp.uint8
  assert shapes["scales"].shape == (4,)
  x = jnp.linspace(-3, 3, 256, dtype=jnp.float32)
  np.testing.assert_array_equal(
      jax.jit(lambda v: codec.decode(codec.encode(v)))(x),
      codec.decode(codec.encode(x)))


@pytest.mark.parametrize("seed", [4, 5])
def test_fp4_beats_int4_on_values_far_below_the_block_absmax(seed):
  """What the grids guarantee, on Gaussian and on heavy-tailed data: below
  a third of the absmax fp4's steps (absmax / 12) are finer than int4's
  (absmax / 7), and values int4 rounds to zero fp4 keeps."""
  rng = np.random.default_rng(seed)
  data = {"gaussian": rng.standard_normal(256 * 64),
          "student_t2": rng.standard_t(2, 256 * 64)}
  for name, x in data.items():
    x = x.astype(np.float32)
    absmax = np.repeat(np.abs(x.reshape(-1, 256)).max(axis=1), 256)
    fp4 = np.abs(_round_trip(x, 256) - x)
    int4_codec = codecs.make_codec("int4", 256)
    int4 = np.abs(np.asarray(int4_codec.decode(int4_codec.encode(
        jnp.asarray(x)))) - x)
    small = np.abs(x) < absmax / 3
    assert np.all(fp4[small] <= absmax[small] / 24 * (1 + 1e-6)), name
    assert np.all(int4 <= absmax / 14 * (1 + 1e-6)), name
    # int4 zeroes (absmax / 24, absmax / 14); fp4 rounds those to
    # +-absmax / 12, nearer. (Strictly inside the range, off float ties.)
    kept = ((np.abs(x) > absmax / 24 * (1 + 1e-5))
            & (np.abs(x) < absmax / 14 * (1 - 1e-5)))
    assert kept.sum() > 100, name
    assert np.all(int4[kept] == np.abs(x[kept])), name
    assert np.all(fp4[kept] < int4[kept]), name


def _fp4_island_mean(islands, stochastic=False):
  """compression.island_mean with fp4 on an islands-device mesh, jitted:
  (tree, weights, seeds) -> (mean, sent), each island rounding with
  jax.random.key(its seed) if `stochastic`, else to nearest."""
  mesh = mesh_lib.build_mesh(islands)
  compression = compression_lib.Compression(
      "fp4", codecs.make_codec("fp4", block_size=64))

  def per_island(t, w, seed):
    key = jax.random.key(seed) if stochastic else None
    mean, sent, _ = compression_lib.island_mean(t, w, compression, key=key)
    return mean, sent

  return jax.jit(placement.island_map(
      per_island, mesh, in_specs=(PER_ISLAND,) * 3,
      out_specs=(PER_ISLAND, PER_ISLAND), check_vma=False))


def _flat(tree, i):
  return np.concatenate([np.ravel(leaf[i]) for leaf in jax.tree.leaves(tree)])


def _reference_ring(islands, tree, weights, block_size=64):
  """The compressed ring all-reduce on the host, with the host codec: each
  island encodes chunk j of its share-weighted values, island j decodes
  and sums them and encodes the sum, and every island decodes that.

  Returns (mean, sent [islands, n]).
  """
  flat = np.stack([_flat(tree, i) for i in range(islands)])
  n = flat.shape[1]
  chunk = math.ceil(n / (islands * block_size)) * block_size
  shares = weights / weights.sum()
  padded = np.zeros((islands, chunk * islands), np.float32)
  padded[:, :n] = flat * shares[:, None]
  sent = np.stack([_reference_round_trip(row, block_size) for row in padded])
  total = np.zeros(chunk * islands, np.float32)
  for j in range(islands):
    part = slice(j * chunk, (j + 1) * chunk)
    total[part] = _reference_round_trip(sent[:, part].sum(axis=0), block_size)
  with np.errstate(divide="ignore", invalid="ignore"):
    sent = np.where(shares[:, None] > 0, sent / shares[:, None], 0.0)
  return total[:n], sent[:, :n]


@pytest.mark.parametrize("islands", [4, 8])
def test_fp4_island_mean_equals_the_host_ring_reference(islands):
  rng = np.random.default_rng(6)
  tree = {"w": rng.standard_normal((islands, 40, 13)).astype(np.float32),
          "b": (rng.standard_t(2, (islands, 30)) * 1e-3).astype(np.float32)}
  weights = rng.uniform(0.5, 3, islands).astype(np.float32)
  weights[1] = 0.0  # an island without weight sends nothing
  mean, sent = _fp4_island_mean(islands)(tree, weights,
                                         np.zeros(islands, np.int32))
  expected_mean, expected_sent = _reference_ring(islands, tree, weights)
  for i in range(islands):
    np.testing.assert_allclose(_flat(mean, i), expected_mean,
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(_flat(sent, i), expected_sent[i],
                               rtol=1e-5, atol=1e-6)
  assert not np.any(_flat(sent, 1))


def test_fp4_island_mean_with_stochastic_rounding_is_unbiased():
  islands, repeats = 4, 200
  rng = np.random.default_rng(7)
  tree = {"w": rng.standard_normal((islands, 300)).astype(np.float32)}
  weights = np.array([1.0, 2.0, 3.0, 2.0], np.float32)
  exact = np.tensordot(weights, tree["w"], 1) / weights.sum()
  island_mean = _fp4_island_mean(islands, stochastic=True)
  seeds = np.arange(islands, dtype=np.int32)
  means = np.stack([
      _flat(island_mean(tree, weights, seeds + islands * r)[0], 0)
      for r in range(repeats)])
  # A rounding between grid points h apart has a variance of at most
  # h^2 / 4, and h is at most a third of the block's absmax (2 / 6). The
  # first phase rounds each island's share-weighted values; the second
  # their decoded sum, no larger than the sum of the islands' absmaxes.
  shares = weights / weights.sum()
  absmaxes = [np.abs(tree["w"][i] * shares[i]).max() for i in range(islands)]
  std = math.sqrt(sum((a / 3) ** 2 for a in absmaxes) / 4
                  + (sum(absmaxes) / 3) ** 2 / 4)
  assert np.abs(means.mean(axis=0) - exact).max() < 5 * std / math.sqrt(
      repeats)
  nearest = _flat(_fp4_island_mean(islands)(tree, weights, seeds)[0], 0)
  assert (np.abs(means.mean(axis=0) - exact).mean()
          < np.abs(nearest - exact).mean() / 3)


def test_fp4_payload_is_half_a_byte_per_value_and_a_scale_per_block():
  codec = codecs.make_codec("fp4", block_size=64)
  assert codec.payload_bytes(2048) == 2048 // 2 + (2048 // 64) * 4
  tree = {"a": jax.ShapeDtypeStruct((64, 32), jnp.float32),
          "b": jax.ShapeDtypeStruct((2048,), jnp.bfloat16)}  # 4096 values
  k, codec = 4, codecs.make_codec("fp4", block_size=256)
  chunk = 1024  # 4096 / 4, whole blocks
  payload = chunk // 2 + (chunk // 256) * 4
  weight_psum = 2 * (k - 1) * 4
  fp4 = compression_lib.Compression("fp4", codec)
  assert compression_lib.mean_bytes(tree, k, fp4) == (
      weight_psum + 2 * (k - 1) * payload)


def _settings():
  settings = config_schema.base_config().diloco
  settings.codec_block_size = 64
  settings.lowrank.min_rank, settings.lowrank.max_rank = 2, 8
  return settings


@pytest.mark.parametrize("islands", [2, 3, 8])
@pytest.mark.parametrize("fields", [
    ("codec",), ("codec:topk", "fallback_codec"),
    ("codec:sign_prune", "fallback_codec"),
    ("codec:adaptive_lowrank", "fallback_codec", "lowrank.factor_codec")])
def test_fp4_sends_the_bytes_int4_sends_wherever_a_dense_codec_goes(
    islands, fields):
  tree = {"w": jax.ShapeDtypeStruct((96, 80), jnp.float32),
          "e": jax.ShapeDtypeStruct((33, 64, 40), jnp.float32),
          "b": jax.ShapeDtypeStruct((80,), jnp.float32),
          "odd": jax.ShapeDtypeStruct((7,), jnp.float32)}
  counts = {}
  for dense in ("int4", "fp4", "int8"):
    settings = _settings()
    for field in fields:
      name, _, value = field.partition(":")
      section, _, leaf = name.rpartition(".")
      (settings[section] if section else settings)[leaf] = value or dense
    compression = run_config.compression(settings)
    counts[dense] = compression_lib.mean_bytes(tree, islands, compression)
  assert counts["fp4"] == counts["int4"]
  assert counts["fp4"] < counts["int8"]  # and the codec really was used


def test_fp4_configs_validate_and_odd_blocks_are_refused():
  from configs import tiny  # pylint: disable=g-import-not-at-top
  for overrides in ({"diloco.codec": "fp4"},
                    {"diloco.codec": "fp4", "diloco.error_feedback": True,
                     "diloco.stochastic_rounding": True},
                    {"diloco.codec": "topk", "diloco.fallback_codec": "fp4"},
                    {"diloco.codec": "adaptive_lowrank",
                     "diloco.lowrank.factor_codec": "fp4"}):
    config = helpers.with_overrides(tiny.get_config(), overrides)
    validation.validate_config(config, num_devices=8)
    compression = run_config.compression(config.diloco)
    assert "fp4" in (compression.dense.name, compression.factor_codec.name)
  config = helpers.with_overrides(tiny.get_config(), {
      "diloco.codec": "fp4", "diloco.codec_block_size": 63})
  with pytest.raises(validation.ConfigError, match="codec_block_size"):
    validation.validate_config(config, num_devices=8)
  config = helpers.with_overrides(tiny.get_config(),
                                  {"diloco.fallback_codec": "fp5"})
  with pytest.raises(validation.ConfigError, match="fallback_codec='fp5'"):
    validation.validate_config(config, num_devices=8)


def test_fp4_outer_step_leaves_every_island_with_the_same_params():
  # e2m1's widest step is 2 in units of absmax / 6: half of it, 1/6.
  hlo = helpers.check_islands_leave_the_outer_step_at_x(
      codecs.make_codec("fp4", block_size=64), half_step=1 / 6)
  # Packed codes cross the link as bytes, in the one compiled program.
  helpers.assert_compressed_one_program(hlo, wire_type="u8[")


def test_training_with_fp4_stays_finite_and_reports_its_bytes(tmp_path):
  from configs import tiny  # pylint: disable=g-import-not-at-top
  from diloco_jax.run import train  # pylint: disable=g-import-not-at-top
  config = helpers.with_overrides(tiny.get_config(), {
      "diloco.codec": "fp4", "diloco.error_feedback": True,
      "diloco.stochastic_rounding": True})
  summary = train.train_and_evaluate(config, str(tmp_path))
  assert summary["codec"] == "fp4"
  assert math.isfinite(summary["final_eval_loss"])
  assert summary["compression_vs_fp32"] > 6.0
