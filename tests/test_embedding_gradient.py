"""The token look-up's gradient: a float32 sum over positions sorted by id.

Its cost must not depend on which tokens repeat (model/embedding.py), so
the tests check its form in the program given to XLA (a sort of the ids,
then a float32 scatter-add that XLA is told is sorted, for every compute
dtype, tied or untied, stacked islands, pipeline stages) and its numerics
against a float64 numpy sum of the same cotangents, on ids from uniform to
one id everywhere.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from configs import tiny
from diloco_jax.compiled import model_loss
from diloco_jax.model import embedding
from diloco_jax.model import transformer as model
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel import stages as stages_lib
from tests import test_model

VOCAB, D = 64, 8
SHAPE = (4, 32)  # 128 positions


def ids_with_repeats(kind: str) -> np.ndarray:
  rng = np.random.default_rng(0)
  if kind == "uniform":
    return rng.integers(0, VOCAB, SHAPE, dtype=np.int32)
  if kind == "zipf":  # text-like: a few ids take most positions
    return np.minimum(rng.zipf(1.3, SHAPE) - 1, VOCAB - 1).astype(np.int32)
  return np.full(SHAPE, 5, np.int32)  # "constant": every position one id


def numpy_row_sums(cotangents, ids) -> np.ndarray:
  sums = np.zeros((VOCAB, D), np.float64)
  np.add.at(sums, ids.reshape(-1),
            np.asarray(cotangents, np.float64).reshape(-1, D))
  return sums


@pytest.mark.parametrize("kind", ["uniform", "zipf", "constant"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_gradient_is_the_float32_sum_of_the_cotangents(kind, dtype):
  ids = ids_with_repeats(kind)
  table = jax.random.normal(jax.random.key(0), (VOCAB, D))
  cotangents = jax.random.normal(jax.random.key(1), SHAPE + (D,), dtype)
  rows, pullback = jax.vjp(lambda t: embedding.take_rows(t, ids, dtype),
                           table)
  # Forward: the gather commutes with the cast, so this is exact.
  np.testing.assert_array_equal(
      np.asarray(rows, np.float32),
      np.asarray(jnp.take(table.astype(dtype), ids, axis=0), np.float32))
  (gradient,) = pullback(cotangents)
  assert gradient.dtype == jnp.float32
  expected = numpy_row_sums(cotangents, ids)
  # Each row is a float32 sum of n cotangents (bf16 ones are exact in
  # float32); any summation order is within (n - 1) * eps32 * sum|terms|.
  counts = np.bincount(ids.reshape(-1), minlength=VOCAB)[:, None]
  magnitudes = numpy_row_sums(np.abs(np.asarray(cotangents, np.float64)), ids)
  bound = np.maximum(counts - 1, 0) * np.finfo(np.float32).eps * magnitudes
  np.testing.assert_array_less(np.abs(np.asarray(gradient) - expected),
                               bound + 1e-30)


def test_ids_are_read_as_jnp_take_reads_them():
  # Negative ids count from the end; those outside the table give NaN rows
  # and no gradient. -1 sorts first but lands on the last row.
  ids = np.array([[0, VOCAB, 3, -1, -VOCAB - 1, 3]], np.int32)
  table = jax.random.normal(jax.random.key(0), (VOCAB, D))
  cotangents = jax.random.normal(jax.random.key(1), (1, 6, D))
  plain = lambda t: jnp.take(t, ids, axis=0)
  ours = lambda t: embedding.take_rows(t, ids, jnp.float32)
  np.testing.assert_array_equal(ours(table), plain(table))
  np.testing.assert_allclose(jax.vjp(ours, table)[1](cotangents)[0],
                             jax.vjp(plain, table)[1](cotangents)[0],
                             rtol=1e-6)


def compiled_gradient_hlo(tie: bool, dtype: str, islands: int = 0) -> str:
  cfg = test_model.tiny_config(tie_embeddings=tie, dtype=dtype)
  graphdef, params = model.init_params(cfg, seed=0)
  tokens = test_model.random_tokens(0, (test_model.BATCH,
                                        test_model.SEQ + 1))
  gradient = jax.grad(model.next_token_loss, argnums=1)
  fn = lambda p, t: gradient(graphdef, p, t)
  if islands:  # islands folded on one device: vmap over stacked copies
    fn = jax.vmap(fn)
    params = jax.tree.map(lambda a: jnp.stack([a] * islands), params)
    tokens = np.stack([tokens] * islands)
  # The program as jax gives it to XLA (a compiled one from the persistent
  # cache would not print its instructions).
  return jax.jit(fn).lower(params, tokens).as_text(dialect="hlo")


@pytest.mark.parametrize("tie, dtype, islands", [
    (True, "bfloat16", 0), (False, "bfloat16", 0), (True, "float32", 0),
    (True, "bfloat16", 2)])
def test_the_compiled_gradient_sorts_the_ids_and_adds_in_float32(
    tie, dtype, islands):
  hlo = compiled_gradient_hlo(tie, dtype, islands)
  table = (rf"f32\[{islands},{test_model.VOCAB},{test_model.D_MODEL}\]"
           if islands else rf"f32\[{test_model.VOCAB},{test_model.D_MODEL}\]")
  scatters = [line for line in hlo.splitlines()
              if re.search(r"= \S+ scatter\(", line)]
  # Two scatter-adds: the loss's (into the logits) and the table's, which
  # must be in float32 over ids it is told are sorted.
  into_table = [line for line in scatters
                if re.search(table + r"\S* scatter\(", line)]
  assert len(into_table) == 1, scatters
  assert "indices_are_sorted=true" in into_table[0]
  assert not any(re.search(r"= bf16\S* scatter\(", line)
                 for line in scatters), scatters
  assert any(re.search(r"\(s32\[[\d,]+\]\S*, s32\[[\d,]+\]\S*\) sort\(", line)
             for line in hlo.splitlines())


def test_the_model_gradient_equals_the_plain_look_up_in_float32(
    monkeypatch):
  cfg = test_model.tiny_config(tie_embeddings=False)
  graphdef, params = model.init_params(cfg, seed=0)
  tokens = ids_with_repeats("zipf")[:test_model.BATCH,
                                    :test_model.SEQ + 1] % test_model.VOCAB
  gradient = lambda: jax.jit(jax.grad(model.next_token_loss, argnums=1),
                             static_argnums=0)(graphdef, params, tokens)
  ours = gradient()
  monkeypatch.setattr(embedding, "take_rows",
                      lambda t, i, dtype: jnp.take(t, i, axis=0).astype(dtype))
  plain = gradient()
  # Only the order of the embedding rows' float32 sums differs.
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(plain)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                               rtol=1e-5, atol=1e-7)


def test_pipeline_stages_take_rows_the_same_way():
  """Two pipeline stages, bf16: the first stage's look-up differentiates
  into the same float32 scatter over sorted ids (the program jax gives
  XLA, lowered only)."""
  config = tiny.get_config()
  config.model = test_model.tiny_config(num_layers=2, dtype="bfloat16")
  config.mesh.stage = 2
  config.pipeline.microbatches = 2
  mesh = mesh_lib.build_mesh(1, 1, 2)
  layout = stages_lib.StageLayout(2, 1, config.model.num_layers)
  _, params = model.init_params(config.model, seed=0)
  staged = jax.device_put(layout.split_params(params),
                          NamedSharding(mesh, PartitionSpec(mesh_lib.STAGE)))
  tokens = test_model.random_tokens(0, (4, test_model.SEQ + 1))
  loss_fn = model_loss.loss_function(config, mesh)
  hlo = jax.jit(jax.grad(loss_fn)).lower(staged, tokens).as_text(
      dialect="hlo")
  scatters = [line for line in hlo.splitlines()
              if re.search(r"= \S+ scatter\(", line)]
  assert any(re.search(r"= f32\S* scatter\(", line)
             and "indices_are_sorted=true" in line for line in scatters), (
                 scatters)
  assert not any(re.search(r"= bf16\S* scatter\(", line)
                 for line in scatters), scatters
