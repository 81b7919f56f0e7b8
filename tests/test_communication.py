"""The communication boundary: the weighted island mean and its byte count."""

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax.parallel import communication
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel import placement
from diloco_jax.parallel.placement import PER_ISLAND


def test_island_mean_is_the_weighted_mean_on_every_island():
  islands = 4
  mesh = mesh_lib.build_mesh(islands)
  rng = np.random.default_rng(0)
  tree = {"w": rng.standard_normal((islands, 3, 5)).astype(np.float32),
          "b": rng.standard_normal((islands, 7)).astype(np.float32)}
  weights = np.array([1.0, 2.0, 0.0, 5.0], np.float32)  # island 2 inactive

  out = jax.jit(placement.island_map(
      communication.island_mean, mesh, in_specs=(PER_ISLAND, PER_ISLAND),
      out_specs=PER_ISLAND))(tree, weights)
  for key, value in tree.items():
    expected = np.tensordot(weights, value, axes=1) / weights.sum()
    for i in range(islands):
      np.testing.assert_allclose(out[key][i], expected, rtol=1e-6, atol=1e-6)


def test_island_mean_accumulates_low_precision_inputs_in_float32():
  mesh = mesh_lib.build_mesh(2)
  values = jnp.ones((2, 8), jnp.bfloat16)
  mean = jax.jit(placement.island_map(
      lambda x: communication.island_mean(x, jnp.float32(1.0)),
      mesh, in_specs=(PER_ISLAND,), out_specs=PER_ISLAND))
  out = mean(values)
  assert out.dtype == jnp.bfloat16  # the caller gets its own dtype back
  hlo = mean.lower(values).compile().as_text()
  reductions = [line for line in hlo.splitlines() if "all-reduce(" in line
                or "all-reduce-start(" in line]
  assert reductions
  # Nothing crosses the island link, and nothing is summed, in bfloat16.
  assert not any("bf16" in line.split("=")[1].split("all-reduce")[0]
                 for line in reductions)


def test_ring_allreduce_bytes_by_hand():
  assert communication.ring_allreduce_bytes(1000, 4, 1) == 0
  assert communication.ring_allreduce_bytes(1000, 4, 2) == 2 * 1 * 500 * 4
  assert communication.ring_allreduce_bytes(1000, 4, 4) == 2 * 3 * 250 * 4
  # Chunks round up when the array does not split evenly.
  assert communication.ring_allreduce_bytes(10, 4, 4) == 2 * 3 * 3 * 4


def test_island_mean_bytes_for_a_fixed_pytree():
  tree = {"a": jax.ShapeDtypeStruct((64, 32), jnp.float32),
          "b": jax.ShapeDtypeStruct((32,), jnp.bfloat16)}
  k = 4
  expected = (2 * (k - 1) * 1 * 4          # the scalar weight
              + 2 * (k - 1) * 512 * 4      # 2048 floats in chunks of 512
              + 2 * (k - 1) * 8 * 4)       # bf16 leaves are reduced in f32
  assert communication.island_mean_bytes(tree, k) == expected
  assert communication.island_mean_bytes(tree, 1) == 0
