"""Codecs and the compressed island mean."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax.algorithm import outer_settings
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.codecs import dense as codecs
from diloco_jax.parallel import communication
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel import placement
from diloco_jax.parallel.placement import PER_ISLAND
from tests import helpers

LOSSY = ("bf16", "fp16", "int8", "int4", "fp4")


def _vector(n=4096, seed=0):
  rng = np.random.default_rng(seed)
  # Blocks of very different magnitudes, as pseudo-gradients of different
  # layers have; blockwise scales must handle each.
  scales = np.repeat(10.0 ** rng.uniform(-6, 1, n // 256), 256)
  return jnp.asarray(rng.standard_normal(n) * scales, jnp.float32)


@pytest.mark.parametrize("name", codecs.DENSE_CODECS)
def test_round_trip_error_is_within_half_a_step(name):
  codec = codecs.make_codec(name, block_size=256)
  x = _vector()
  error = jnp.abs(codec.decode(codec.encode(x)) - x)
  bound = codec.max_abs_error(x)
  assert bool(jnp.all(error <= bound * (1 + 1e-6) + 1e-30)), (
      float(jnp.max(error - bound)))
  if name == "fp32":
    assert float(jnp.max(error)) == 0.0


def test_int4_packing_round_trips_every_level():
  q = jnp.arange(-7, 8, dtype=jnp.int8)
  q = jnp.concatenate([q, q[::-1], jnp.zeros(2, jnp.int8)])  # even length
  np.testing.assert_array_equal(
      codecs._unpack_nibbles(codecs._pack_nibbles(q)), q)


def test_stochastic_rounding_is_unbiased():
  codec = codecs.make_codec("int8", block_size=256)
  x = jnp.full((256,), 0.3, jnp.float32).at[0].set(127.0)  # step = 1.0
  keys = jax.random.split(jax.random.key(0), 2000)
  decoded = jax.vmap(lambda k: codec.decode(codec.encode(x, k)))(keys)
  assert abs(float(decoded[:, 1:].mean()) - 0.3) < 0.01
  assert float(codec.decode(codec.encode(x))[1]) == 0.0  # nearest rounds down


def _compressed_mean(islands, codec, tree, weights):
  mesh = mesh_lib.build_mesh(islands)

  def per_island(t, w):
    return communication.island_mean(t, w, codec=codec)

  return jax.jit(placement.island_map(
      per_island, mesh, in_specs=(PER_ISLAND, PER_ISLAND),
      out_specs=PER_ISLAND, check_vma=False))(tree, weights)


# The e2m1 grid (in units of the block's scale) and its codes' parity:
# a tie goes to the point of even code (mantissa bit 0), as in IEEE.
_E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def _numpy_round_trip(name, x, block_size):
  """(decoded, error bound) of float32 `x` [n] through codec `name`,
  written out in numpy from each format's definition (round to nearest):
  bf16 keeps float32's top 16 bits, rounded half to even; fp16 divides
  each block by absmax / 2**14 and rounds to float16; int8/int4 map each
  block's absmax to 127/7 and round to integers; fp4 maps it to 6 and
  rounds to the e2m1 grid. The bound is half the format's step at each
  value: its largest rounding error."""
  x = np.asarray(x, np.float32)
  if name == "bf16":
    bits = x.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) & np.uint32(
        0xFFFF0000)
    # 8 significant bits: half a step is at most 2**-8 of the value.
    return rounded.view(np.float32), np.abs(x) * 2.0 ** -8
  blocks = x.reshape(-1, block_size)
  absmax = np.abs(blocks).max(axis=1, keepdims=True)
  top = {"fp16": 2.0 ** 14, "int8": 127, "int4": 7, "fp4": 6}[name]
  scale = np.where(absmax > 0, absmax / np.float32(top), 1).astype(
      np.float32)
  scaled = blocks / scale
  if name == "fp16":
    decoded = scaled.astype(np.float16).astype(np.float32)
    # 11 significant bits, and float16's subnormal step 2**-24 below 2**-14.
    half_step = np.maximum(np.abs(scaled) * 2.0 ** -11, 2.0 ** -25)
  elif name == "fp4":
    magnitude = np.minimum(np.abs(scaled), 6)
    distance = np.abs(magnitude[..., None] - _E2M1_GRID)
    nearest = np.isclose(distance, distance.min(axis=-1, keepdims=True),
                         rtol=0, atol=0)
    even = nearest & (np.arange(8) % 2 == 0)
    index = np.where(even.any(axis=-1), even.argmax(axis=-1),
                     nearest.argmax(axis=-1))
    decoded = np.sign(scaled) * _E2M1_GRID[index]
    half_step = np.where(magnitude < 2, 0.25, np.where(magnitude < 4, 0.5, 1))
  else:
    decoded = np.clip(np.round(scaled), -top, top)
    half_step = np.full_like(scaled, 0.5)
  # A block of zeros (an island without weight) decodes exactly.
  half_step = np.where(absmax > 0, half_step * scale, 0)
  return ((decoded * scale).reshape(-1),
          half_step.reshape(-1).astype(np.float32))


def _reference_mean(islands, codec, tree, weights):
  """The compressed mean in numpy, from the codec's definition (not its
  code): each island's weighted values in k chunks of whole blocks;
  chunk c's owner decodes every island's chunk c, sums them and sends
  the sum encoded again. Returns (mean, bound): the bound sums each
  rounding's half step, the islands' chunks' and the re-encoded sum's."""
  flat = np.stack([np.concatenate([np.ravel(leaf[i]) for leaf in
                                   jax.tree.leaves(tree)])
                   for i in range(islands)])
  n = flat.shape[1]
  block = codec.block_size
  chunk = -(-n // (islands * block)) * block
  shares = (weights / weights.sum()).astype(np.float32)
  padded = np.zeros((islands, chunk * islands), np.float32)
  padded[:, :n] = flat * shares[:, None]
  sums, bound = np.zeros(chunk * islands, np.float32), np.zeros(
      chunk * islands, np.float32)
  for i in range(islands):
    decoded, half_step = _numpy_round_trip(codec.name, padded[i], block)
    sums += decoded
    bound += half_step
  mean, half_step = _numpy_round_trip(codec.name, sums, block)
  return mean[:n], (bound + half_step)[:n]


@pytest.mark.parametrize("name", LOSSY)
def test_compressed_mean_equals_decode_then_mean_reference(name):
  """The compressed mean on 4 islands (one of weight 0) is its numpy
  definition (_reference_mean), and lies within the sum of its roundings'
  half steps of the exact mean. The islands' decoded chunks are summed in
  another order than numpy's (an ulp apart, measured): rtol 1e-6."""
  islands = 4
  codec = codecs.make_codec(name, block_size=64)
  rng = np.random.default_rng(1)
  tree = {"w": rng.standard_normal((islands, 40, 13)).astype(np.float32),
          "b": rng.standard_normal((islands, 30)).astype(np.float32)}
  weights = np.array([1.0, 3.0, 0.0, 2.0], np.float32)
  out = _compressed_mean(islands, codec, tree, weights)
  expected, bound = _reference_mean(islands, codec, tree, weights)
  leaves = jax.tree.leaves(out)
  for i in range(islands):
    got = np.concatenate([np.ravel(leaf[i]) for leaf in leaves])
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
  exact = np.concatenate([np.ravel(np.tensordot(weights, leaf, 1)
                                   / weights.sum())
                          for leaf in jax.tree.leaves(tree)])
  # float32 sums of 4 terms: a few ulps beyond the roundings' bound
  # (measured: the largest error is 68-92% of the bound).
  assert np.all(np.abs(got - exact) <= bound + 1e-6 * np.abs(exact))


@pytest.mark.parametrize("islands", [2, 4, 8])
def test_int8_sends_about_four_times_fewer_bytes_at_any_island_count(islands):
  tree = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
          "b": jax.ShapeDtypeStruct((1000,), jnp.float32)}
  fp32 = communication.island_mean_bytes(tree, islands)
  ratios = {name: fp32 / communication.island_mean_bytes(
      tree, islands, codecs.make_codec(name)) for name in LOSSY}
  assert 3.85 < ratios["int8"] <= 4.0
  assert 1.95 < ratios["bf16"] <= 2.0
  assert 1.9 < ratios["fp16"] <= 2.0
  assert 7.4 < ratios["int4"] <= 8.0
  assert ratios["fp4"] == ratios["int4"]  # the same bits, another grid


def test_byte_count_by_hand():
  tree = {"a": jax.ShapeDtypeStruct((64, 32), jnp.float32),
          "b": jax.ShapeDtypeStruct((2048,), jnp.bfloat16)}  # 4096 values
  k, codec = 4, codecs.make_codec("int8", block_size=256)
  chunk = 1024  # 4096 / 4, whole blocks
  payload = chunk * 1 + (chunk // 256) * 4  # int8 values + f32 scales
  weight_psum = 2 * (k - 1) * 4
  assert communication.island_mean_bytes(tree, k, codec) == (
      weight_psum + 2 * (k - 1) * payload)
  assert communication.island_mean_bytes(tree, 1, codec) == 0


def test_outer_step_sends_the_int8_payload_in_one_program():
  islands = 2
  params, _ = helpers.tiny_problem()
  params = jax.tree.map(np.array, params)
  outer_opt = optax.sgd(0.7, momentum=0.9, nesterov=True)
  mesh = mesh_lib.build_mesh(islands)
  state = outer_settings.init_state(params, optax.adam(1e-3), outer_opt,
                                    islands)
  state = jax.device_put(state, state_lib.state_shardings(state, mesh))
  weights = jax.device_put(jnp.ones(islands), NamedSharding(mesh, P("island")))
  codec = codecs.make_codec("int8")
  hlo = outer_step_lib.make_outer_step(outer_opt, mesh, codec).lower(
      state, weights).compile().as_text()
  helpers.assert_compressed_one_program(hlo)  # int8 values, s8


def test_int8_outer_step_leaves_every_island_with_the_same_params():
  # Every island takes the same bits; x lands within int8's rounding (half
  # a step, 1/254 of a block's absmax) of the exact average.
  helpers.check_islands_leave_the_outer_step_at_x(codecs.make_codec("int8"),
                                                  half_step=1 / 254)


def test_training_with_a_codec_reports_its_compression(tmp_path):
  from configs import tiny  # pylint: disable=g-import-not-at-top
  from diloco_jax.run import train  # pylint: disable=g-import-not-at-top
  summaries = {}
  for name in ("fp32", "int8"):
    config = tiny.get_config()
    config.diloco.codec = name
    summaries[name] = train.train_and_evaluate(config, str(tmp_path / name))
  fp32, int8 = summaries["fp32"], summaries["int8"]
  assert int8["codec"] == "int8" and fp32["compression_vs_fp32"] == 1.0
  assert int8["compression_vs_fp32"] == pytest.approx(
      fp32["comm_bytes"] / int8["comm_bytes"])
  assert int8["compression_vs_fp32"] > 3.0
  assert int8["compression_vs_ddp"] == pytest.approx(
      int8["ddp_comm_bytes"] / int8["comm_bytes"])
  assert abs(int8["final_eval_loss"] - fp32["final_eval_loss"]) < 0.05


def test_error_feedback_conserves_mass_over_rounds():
  """sum of what was sent + the residual left = sum of the inputs."""
  islands, rounds = 2, 4
  mesh = mesh_lib.build_mesh(islands)
  codec = codecs.make_codec("int4", block_size=64)

  def round_trip(g, e):
    v = g + e
    _, sent = communication.island_mean(v, jnp.float32(1.0), codec=codec,
                                        return_sent=True)
    return sent, v - sent

  step = jax.jit(placement.island_map(round_trip, mesh,
                                      in_specs=(PER_ISLAND, PER_ISLAND),
                                      out_specs=(PER_ISLAND, PER_ISLAND)))
  rng = np.random.default_rng(0)
  inputs = rng.standard_normal((rounds, islands, 1000)).astype(np.float32)
  residual = np.zeros((islands, 1000), np.float32)
  total_sent = np.zeros_like(residual)
  for g in inputs:
    sent, residual = step(g, residual)
    total_sent += np.asarray(sent)
    residual = np.asarray(residual)
  assert np.abs(residual).max() > 1e-3  # int4 really left something behind
  np.testing.assert_allclose(total_sent + residual, inputs.sum(axis=0),
                             rtol=1e-5, atol=1e-5)


def test_error_feedback_residuals_live_in_the_state():
  islands = 2
  codec = codecs.make_codec("int4", block_size=64)
  final = {}
  for error_feedback in (False, True):
    state, outer, weights = helpers.state_after_one_inner_step(
        islands, codec, error_feedback)
    final[error_feedback] = outer(state, weights)
  assert final[False].outer.residuals is None
  residual_leaves = jax.tree.leaves(final[True].outer.residuals)
  assert residual_leaves[0].shape[0] == islands
  assert max(float(jnp.abs(r).max()) for r in residual_leaves) > 0
  # Both runs sent the same first round: the residual starts at zero.
  helpers.assert_trees_close(final[True].global_params,
                             final[False].global_params, rtol=0, atol=0)


@pytest.mark.slow
def test_resume_with_codec_state_is_exact(tmp_path):
  from configs import tiny  # pylint: disable=g-import-not-at-top
  from tests import test_checkpoint  # pylint: disable=g-import-not-at-top

  def config():
    c = tiny.get_config()
    c.total_steps, c.diloco.inner_steps = 12, 3
    c.diloco.codec, c.diloco.error_feedback = "int8", True
    c.diloco.stochastic_rounding = True
    c.checkpoint.max_to_keep = 20
    return c

  test_checkpoint.check_resume_from_round_2(config, tmp_path)


def test_toggling_error_feedback_is_an_incompatible_checkpoint(tmp_path):
  from configs import tiny  # pylint: disable=g-import-not-at-top
  from diloco_jax.storage import checkpoints as checkpointing
  from diloco_jax.run import train  # pylint: disable=g-import-not-at-top
  config = tiny.get_config()
  config.total_steps = 4
  train.train_and_evaluate(config, str(tmp_path))
  config.total_steps = 8
  config.diloco.error_feedback = True
  # Even when the config change is allowed, the state layout must match.
  config.resume.allow_changes = "total_steps,diloco.error_feedback"
  with pytest.raises(checkpointing.IncompatibleCheckpointError,
                     match="residuals"):
    train.train_and_evaluate(config, str(tmp_path))
