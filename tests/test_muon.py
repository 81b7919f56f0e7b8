"""Muon inside the islands (config.inner_optimizer.name='muon', MuLoCo):
Muon on the transformer blocks' matrices, AdamW on everything else."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from diloco_jax.algorithm import inner_step as inner_step_lib
from diloco_jax.algorithm import optimizers
from diloco_jax.algorithm import outer_settings
from diloco_jax.algorithm import state as state_lib
from diloco_jax.config import run_config
from diloco_jax.config import schema as config_schema
from diloco_jax.model import transformer as model_lib
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.run import train
from tests import helpers


def _inner_config(name):
  config = config_schema.base_config().inner_optimizer
  config.name = name
  config.warmup_steps = 0
  config.grad_clip_norm = 0.0
  return run_config.inner_optimizer(config)


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
  with pytest.raises(ValueError, match="name='lion'"):
    optimizers.inner_optimizer(_inner_config("lion"), 10)


def _reference_leaf_optimizer(label, inner, schedule):
  """The optimizer one leaf takes under name='muon', built here straight
  from optax: optax.contrib.muon on a block matrix, AdamW (decaying
  matrices only) on the rest."""
  if label == "muon":
    return optax.contrib.muon(
        learning_rate=schedule, ns_steps=inner.muon.ns_steps,
        beta=inner.muon.momentum, weight_decay=inner.weight_decay,
        consistent_rms=inner.muon.consistent_rms)
  return optax.adamw(schedule, b1=inner.b1, b2=inner.b2, eps=inner.eps,
                     weight_decay=inner.weight_decay if label == "matrix"
                     else 0.0)


def test_the_islands_inner_steps_are_optax_muon_on_the_blocks():
  """Three inner steps of 2 islands with config.inner_optimizer.name =
  'muon' (warmup, clipping and all), as the run compiles them, against
  each leaf stepped alone by optax.contrib.muon (the blocks' kernels) or
  AdamW (embedding, norms) on the same island's gradients, clipped by
  their global norm. The island step is vmapped: its matmuls (the
  gradients, Newton-Schulz) may sum in another order, a few ulps, which
  Adam's normalization can grow where a gradient is near 0 (rtol 1e-5,
  atol 1e-6, as for stacked layers above)."""
  config = config_schema.base_config().inner_optimizer
  config.name, config.learning_rate, config.warmup_steps = "muon", 1e-2, 1
  inner, total_steps, islands = run_config.inner_optimizer(config), 10, 2
  params, loss_fn = helpers.tiny_problem()
  params = jax.tree.map(np.array, params)
  opt = optimizers.inner_optimizer(inner, total_steps)
  mesh = mesh_lib.build_mesh(islands)
  state = outer_settings.init_state(params, opt, optax.sgd(1.0), islands)
  state = jax.device_put(state, state_lib.state_shardings(state, mesh))
  step = inner_step_lib.make_inner_step(loss_fn, opt, mesh)
  batches = helpers.random_batches(3, islands, 2)
  for batch in batches:
    state, _ = step(state, jax.device_put(
        batch, NamedSharding(mesh, state_lib.BATCH_SPEC)))
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, 1e-2, 1, total_steps, 1e-2 * config.final_learning_rate_fraction)
  leaves, treedef = jax.tree.flatten(params)
  labels = [label if label == "muon" or leaf.ndim < 2 else "matrix"
            for label, leaf in zip(
                jax.tree.leaves(optimizers.muon_labels(params)), leaves)]
  assert labels.count("muon") == 7 and labels.count("matrix") == 1
  reference = [_reference_leaf_optimizer(label, inner, schedule)
               for label in labels]

  @jax.jit
  def reference_step(ours, slots, batch):
    grads = jax.tree.leaves(jax.grad(loss_fn)(
        jax.tree.unflatten(treedef, ours), batch))
    scale = jnp.minimum(1.0, inner.grad_clip_norm / optax.tree.norm(grads))
    stepped = [r.update(g * scale, s, p) for r, g, s, p in zip(
        reference, grads, slots, ours)]
    return ([optax.apply_updates(p, u) for p, (u, _) in zip(ours, stepped)],
            [s for _, s in stepped])

  for island in range(islands):
    ours = leaves
    slots = [r.init(leaf) for r, leaf in zip(reference, leaves)]
    for batch in batches:
      ours, slots = reference_step(ours, slots, batch[island])
    helpers.assert_trees_close(
        jax.tree.map(lambda y: y[island], jax.device_get(state.island_params)),
        jax.tree.unflatten(treedef, ours), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_diloco_run_with_inner_muon_learns(tmp_path):
  """configs/tiny.py with Muon inside the islands, 4 rounds at an inner
  learning rate that learns in 16 steps: every round's eval is below the
  one before, and x ends 0.45 nats below the untrained model's loss
  (measured; 0.4 asked). The embedding and head alone (AdamW, with Muon's
  update zeroed) get 0.34 in these steps, with every eval still falling;
  with Muon's blocks stepping uphill they get about 0.19 and their eval
  rises in the last round (both measured)."""
  from configs import tiny  # pylint: disable=g-import-not-at-top
  config = helpers.with_overrides(tiny.get_config(), {
      "inner_optimizer.name": "muon", "inner_optimizer.learning_rate": 1e-2,
      "total_steps": 16})
  workdir = tmp_path / "muon"
  summary = train.train_and_evaluate(config, str(workdir))
  with open(workdir / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  assert len(evals) == 4 and evals[-1] == summary["final_eval_loss"]
  assert all(later < earlier for earlier, later in zip(evals, evals[1:]))
  assert summary["final_eval_loss"] < records[0]["train_loss"] - 0.4
