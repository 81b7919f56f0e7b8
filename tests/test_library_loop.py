"""A hand-written DiLoCo loop on the public API reproduces the built-in run.

The loops (`_hand_written_diloco`, `_hand_written_eager`) are what a user
writes: k islands stacked with jax.vmap over the model's loss and an optax
inner optimizer, a Python loop over rounds of H inner steps, then
library.outer_update and island_copies (with eager updates eager_update,
each island going on from its own point, and eager_settle at the end).
Started from what train_and_evaluate starts from (its initial params,
inner optimizer, batches, eval set and equal island weights, taken from
the run's own pieces), their per-step train losses, eval losses and final
x equal the run's on configs/tiny.py: plain DiLoCo, through the int8
codec, and with eager updates.

Tolerances. Both sides do the same float32 arithmetic in different
programs: the run's inner step maps the islands over their devices and its
outer step (with the islands' reset) is one jitted program over the mesh;
the loop vmaps the islands and jits the library's update alone. XLA may
fuse and reassociate differently, a few ulps per op (float32's ulp at 1 is
1.2e-7), compounded over 8 steps and 4 outer steps.
  fp32 (plain and eager): measured at most 2.8e-7 relative on the losses
    and 2.4e-7 absolute on x; bounds rtol 1e-6 and atol 2e-6.
  int8: quantizing is not continuous: an ulp can carry a value across a
    rounding boundary, moving that element of the mean by one level
    (its block's absmax / 127, ~2e-4 of x here), and later rounds spread
    it, as any change of x does (measured: no element moved after round
    1, one after round 2, ~610 of 11392 after round 4, by at most 3.5e-4;
    losses within 2e-6 relative, mean |x - x_run| 3.3e-6). Bounds: losses
    rtol 3e-5, each element of x within 1e-3 (a few levels) and
    mean |x - x_run| under 5e-5.
A wrong outer step stays far outside them: an outer lr of 0.69 for 0.7
moves the losses by up to 2.9e-4 relative and x by 4.5e-4 on average; the
loop without the int8 codec moves x by 1.3e-4 on average.
"""

import functools
import json
import os

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from configs import tiny
from diloco_jax.algorithm import library as diloco
from diloco_jax.algorithm import optimizers
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.config import overlap_defaults
from diloco_jax.config import run_config as run_config_lib
from diloco_jax.data import sources
from diloco_jax.model import transformer as model_lib
from diloco_jax.run import train
from tests import helpers
from tests import test_checkpoint


def _config(codec: str, overlap: str):
  config = tiny.get_config()
  # tiny's inner lr 4e-4 barely moves the islands in 8 steps; 1e-2 learns,
  # so each round's pseudo-gradient (and the outer step on it) is large.
  config.inner_optimizer.learning_rate = 1e-2
  # 4 rounds of 2 steps: the outer momentum carries over 3 times.
  config.diloco.inner_steps = 2
  config.checkpoint.every_rounds = 0  # the final checkpoint only
  return helpers.with_overrides(config, {"diloco.codec": codec,
                                         "diloco.overlap": overlap})


def _built_in(config, workdir: str):
  """(train loss per step, eval loss per round, final x) of the run."""
  train.train_and_evaluate(config, workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records] == list(
      range(1, config.total_steps + 1))
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  assert len(evals) == config.total_steps // config.diloco.inner_steps
  # pylint: disable-next=protected-access
  final_x = test_checkpoint._final_state(workdir)["global_params"]
  return [r["train_loss"] for r in records], evals, final_x


def _round_trainer(loss_fn, inner_tx, batches, inner_steps: int):
  """train_round(params, opt_state) -> (params, opt_state, losses): H
  steps of every island (stacked) on its own batch; `losses` holds the
  islands' mean loss of each step."""

  @jax.jit
  def inner_step(params, opt_state, batch):
    def one_island(params, opt_state, batch):
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      updates, opt_state = inner_tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss
    return jax.vmap(one_island)(params, opt_state, batch)

  def train_round(params, opt_state):
    losses = []
    for _ in range(inner_steps):
      params, opt_state, loss = inner_step(params, opt_state,
                                           batches.next_batch())
      losses.append(float(np.mean(loss)))
    return params, opt_state, losses

  return train_round


def _evaluator(loss_fn, eval_batches):
  """eval_loss(x): x's mean loss over the eval batches."""
  evaluate = jax.jit(loss_fn)
  return lambda x: float(np.mean([evaluate(x, b) for b in eval_batches]))


def _hand_written_diloco(train_round, eval_loss, x, inner_tx, outer_tx,
                         compression, islands: int, rounds: int):
  """DiLoCo added to a plain training loop with the public API.

  Returns (the islands' mean train loss per step, eval loss of x after
  each round, final x).
  """
  outer_update = jax.jit(functools.partial(
      diloco.outer_update, outer_tx=outer_tx, compression=compression))
  state = diloco.init(x, outer_tx, islands, compression=compression)
  params = diloco.island_copies(x, islands)
  opt_state = jax.vmap(inner_tx.init)(params)  # kept across rounds
  train_losses, eval_losses = [], []
  for _ in range(rounds):
    params, opt_state, losses = train_round(params, opt_state)
    train_losses += losses
    # Equal weights (the default): the islands processed as many tokens
    # each, of the same data distribution.
    x, state, _ = outer_update(x, params, state)
    params = diloco.island_copies(x, islands)
    eval_losses.append(eval_loss(x))
  return train_losses, eval_losses, x


def _hand_written_eager(train_round, eval_loss, x, inner_tx, outer_tx,
                        compression, islands: int, rounds: int,
                        own_weight: float, warmup_rounds: int):
  """DiLoCo with eager updates in a plain loop: each island steps its own
  point at once and does not wait for the mean in flight (after
  `warmup_rounds` rounds that do); the model is the islands' average
  point. Returns what _hand_written_diloco does."""
  eager_update = jax.jit(
      functools.partial(diloco.eager_update, outer_tx=outer_tx,
                        compression=compression, own_weight=own_weight),
      static_argnames="wait")
  settle = jax.jit(functools.partial(diloco.eager_settle, outer_tx=outer_tx))
  average = jax.jit(lambda points: jax.tree.map(lambda p: p.mean(axis=0),
                                                points))
  points, state = diloco.eager_init(x, outer_tx, islands,
                                    compression=compression)
  params = points
  opt_state = jax.vmap(inner_tx.init)(params)
  train_losses, eval_losses = [], []
  for r in range(rounds):
    params, opt_state, losses = train_round(params, opt_state)
    train_losses += losses
    points, state, _ = eager_update(points, params, state,
                                    wait=r < warmup_rounds)
    params = points  # each island goes on from its own point
    x = (average(points) if r < rounds - 1
         else settle(points, state)[0])  # the last mean lands
    eval_losses.append(eval_loss(x))
  return train_losses, eval_losses, x


def _loop_as_the_run_sets_it_up(config):
  """The hand-written loop, from what train_and_evaluate starts from."""
  config = overlap_defaults.resolve(config)  # the outer lr and momentum
  diloco_config = config.diloco
  islands, inner_steps = diloco_config.islands, diloco_config.inner_steps
  graphdef, x = model_lib.init_params(config.model, config.seed)
  inner_tx = optimizers.inner_optimizer(
      run_config_lib.inner_optimizer(config.inner_optimizer),
      config.total_steps)
  outer = diloco_config.outer_optimizer
  assert outer.name == "nesterov"  # the run's default
  batches = sources.make_batch_source(config.data, islands,
                                      config.data.batch_size,
                                      seed=config.data.seed)
  # The run weighs islands by tokens x corpus share: equal here.
  np.testing.assert_array_equal(batches.island_token_weights(),
                                np.full(islands, 1 / islands))
  eval_batches = sources.make_eval_batches(
      config.data, config.eval.batch_size, config.eval.num_batches)
  loss_fn = functools.partial(model_lib.next_token_loss, graphdef)
  args = (_round_trainer(loss_fn, inner_tx, batches, inner_steps),
          _evaluator(loss_fn, eval_batches), x, inner_tx,
          diloco.nesterov(outer.learning_rate, outer.momentum),
          diloco.codec(diloco_config.codec, diloco_config.codec_block_size),
          islands, config.total_steps // inner_steps)
  if diloco_config.overlap == "none":
    return _hand_written_diloco(*args)
  assert diloco_config.overlap == "eager"
  return _hand_written_eager(
      *args, own_weight=outer_overlaps.from_mode(
          "eager", diloco_config.eager_own_weight).own_weight,
      warmup_rounds=overlap_defaults.warmup_rounds(diloco_config))


def _by_path(tree) -> dict:
  """{'blocks/0/attn/q/kernel': array, ...}: the checkpoint's dicts have
  string keys where the params' have ints, and end each variable in
  'value'."""
  leaves = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    keys = [str(getattr(key, "key", key)) for key in path]
    leaves["/".join(keys[:-1] if keys[-1] == "value" else keys)] = (
        np.asarray(leaf))
  return leaves


@pytest.mark.slow
@pytest.mark.parametrize("codec,overlap", [
    ("fp32", "none"),  # plain DiLoCo
    ("int8", "none"),  # through a codec
    ("fp32", "eager"),  # eager updates
])
def test_hand_written_loop_reproduces_the_built_in_run(codec, overlap,
                                                       tmp_path):
  config = _config(codec, overlap)
  run_losses, run_evals, run_x = _built_in(config, str(tmp_path))
  losses, evals, x = _loop_as_the_run_sets_it_up(config)

  # Tolerances: see the module docstring.
  loss_rtol = 1e-6 if codec == "fp32" else 3e-5
  np.testing.assert_allclose(losses, run_losses, rtol=loss_rtol)
  np.testing.assert_allclose(evals, run_evals, rtol=loss_rtol)
  x, run_x = _by_path(nnx.to_pure_dict(x)), _by_path(run_x)
  assert sorted(x) == sorted(run_x)
  if codec == "fp32":
    helpers.assert_trees_close(x, run_x, rtol=0, atol=2e-6)
  else:
    helpers.assert_trees_close(x, run_x, rtol=0, atol=1e-3)
    differences = np.concatenate([np.abs(x[p] - run_x[p]).ravel()
                                  for p in x])
    assert differences.mean() < 5e-5
  # The run learned: what is compared is a moving model.
  assert run_evals[-1] < run_evals[0] - 0.05
