"""Muon inside the islands (config.inner_optimizer.name='muon', MuLoCo):
Muon on the transformer blocks' matrices, AdamW on everything else."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_jax.algorithm import optimizers
from diloco_jax.config import schema as config_schema
from diloco_jax.model import transformer as model_lib


def _inner_config(name):
  config = config_schema.base_config().inner_optimizer
  config.name = name
  config.warmup_steps = 0
  config.grad_clip_norm = 0.0
  return config


def _paths(tree, label):
  return sorted(jax.tree_util.keystr(path) for path, leaf
                in jax.tree_util.tree_leaves_with_path(tree) if leaf == label)


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
  model = config_schema.base_config().model
  model.num_layers, model.tie_embeddings = 2, False
  labels = optimizers.muon_labels(model_lib.param_shapes(model))
  muon = _paths(labels, "muon")
  # Every attention and MLP kernel of both blocks, nothing else.
  assert len(muon) == 2 * 7
  assert all(p.startswith("['blocks']") and "kernel" in p for p in muon)
  adamw = _paths(labels, "adamw")
  assert any("['embed']" in p for p in adamw)
  assert any("['head']" in p for p in adamw)
  assert any("final_norm" in p for p in adamw)
  assert sum("norm" in p for p in adamw) == 2 * 2 + 1


def test_adamw_leaves_step_exactly_as_under_adamw():
  """The partition changes nothing for the leaves AdamW keeps, and Muon's
  matrices take an orthogonalized step: its singular values all about
  equal (Newton-Schulz's quintic leaves them in roughly [0.7, 1.2])."""
  params = {"blocks": {"0": {"kernel": jnp.ones((16, 32)) * 0.1,
                             "scale": jnp.ones((16,))}},
            "embed": {"embedding": jnp.ones((10, 16)) * 0.1}}
  grads = jax.tree.map(
      lambda p: jax.random.normal(jax.random.key(p.size), p.shape), params)
  total_steps = 10
  updates = {}
  for name in ("adamw", "muon"):
    opt = optimizers.inner_optimizer(_inner_config(name), total_steps)
    state = opt.init(params)
    updates[name], _ = opt.update(grads, state, params)
  for get in (lambda tree: tree["blocks"]["0"]["scale"],
              lambda tree: tree["embed"]["embedding"]):
    np.testing.assert_array_equal(get(updates["muon"]),
                                  get(updates["adamw"]))
  muon_step = np.asarray(updates["muon"]["blocks"]["0"]["kernel"])
  singular = np.linalg.svd(muon_step, compute_uv=False)
  assert singular.max() / singular.min() < 2.0
  assert not np.allclose(muon_step, updates["adamw"]["blocks"]["0"]["kernel"])


def test_stacked_layers_are_orthogonalized_one_by_one():
  """A pipeline stage holds its layers stacked [layers, in, out]: each
  layer's matrix is its own Muon matrix (leading axes are batch axes),
  as if the layers were separate leaves."""
  grads = jax.random.normal(jax.random.key(0), (3, 8, 24))
  opt = optimizers.inner_optimizer(_inner_config("muon"), 10)
  stacked = {"blocks": {"kernel": jnp.zeros((3, 8, 24))}}
  update, _ = opt.update({"blocks": {"kernel": grads}}, opt.init(stacked),
                         stacked)
  for layer in range(3):
    alone = {"blocks": {"kernel": jnp.zeros((8, 24))}}
    single, _ = opt.update({"blocks": {"kernel": grads[layer]}},
                           opt.init(alone), alone)
    # The same float32 arithmetic on each slice; vmapped matmuls may sum
    # in another order: rtol 1e-5.
    np.testing.assert_allclose(update["blocks"]["kernel"][layer],
                               single["blocks"]["kernel"], rtol=1e-5,
                               atol=1e-7)


def test_an_unknown_inner_optimizer_is_refused():
  with pytest.raises(ValueError, match="inner_optimizer.name='lion'"):
    optimizers.inner_optimizer(_inner_config("lion"), 10)
