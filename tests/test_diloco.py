"""Identities of the DiLoCo algorithm, on forced CPU devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from diloco_jax.config import run_config

from diloco_jax.algorithm import evaluation as evaluation_lib
from diloco_jax.algorithm import inner_step as inner_step_lib
from diloco_jax.algorithm import optimizers
from diloco_jax.algorithm import outer_settings
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.config import schema as config_schema
from diloco_jax.parallel import mesh as mesh_lib
from tests import helpers
from tests import test_sparseloco


def _setup(islands, data=1, outer=None, seed=0):
  params, loss_fn = helpers.tiny_problem(seed)
  params = jax.tree.map(np.array, params)  # host copies survive donation
  inner_opt = optax.adamw(1e-2, weight_decay=0.1)
  outer_opt = outer or optax.sgd(0.7, momentum=0.9, nesterov=True)
  mesh = mesh_lib.build_mesh(islands, data)
  state = outer_settings.init_state(params, inner_opt, outer_opt, islands)
  state = jax.device_put(state, state_lib.state_shardings(state, mesh))
  return params, loss_fn, inner_opt, outer_opt, mesh, state


def _put_batch(batch, mesh):
  return jax.device_put(batch, NamedSharding(mesh, state_lib.BATCH_SPEC))


def _weights(islands, mesh, value=1.0):
  return jax.device_put(jnp.full((islands,), value, jnp.float32),
                        NamedSharding(mesh, jax.sharding.PartitionSpec("island")))


def _run_diloco(islands, data, rounds, inner_steps, batches, outer=None):
  _, loss_fn, inner_opt, outer_opt, mesh, state = _setup(islands, data, outer)
  inner = inner_step_lib.make_inner_step(loss_fn, inner_opt, mesh)
  outer_step = outer_step_lib.make_outer_step(outer_opt, mesh)
  for r in range(rounds):
    for h in range(inner_steps):
      state, _ = inner(state, _put_batch(batches[r * inner_steps + h], mesh))
    state = outer_step(state, _weights(islands, mesh))
  return state


def test_one_island_one_step_fedavg_is_plain_adamw():
  """k=1, H=1, outer SGD lr 1 momentum 0: DiLoCo is the inner optimizer."""
  steps = 6
  batches = helpers.random_batches(steps, 1, 4)
  state = _run_diloco(1, 1, rounds=steps, inner_steps=1, batches=batches,
                      outer=optax.sgd(1.0))
  params, loss_fn, inner_opt, *_ = _setup(1)
  opt_state = inner_opt.init(params)
  plain_step = jax.jit(lambda p, s, b: _plain_step(loss_fn, inner_opt, p, s, b))
  for b in batches:
    params, opt_state = plain_step(params, opt_state, b[0])
  # Not bit-identical: the island step is vmapped (over one island), and XLA
  # rounds a batched matmul's gradient differently (~1e-7); Adam divides
  # each gradient by its own RMS, so a near-zero component's rounding can
  # move its update by ~1e-6 after 6 steps of lr 1e-2.
  helpers.assert_trees_close(state.global_params, params, rtol=1e-5, atol=1e-5)
  assert int(state.round) == steps and int(state.step) == steps


def _plain_step(loss_fn, opt, params, opt_state, batch):
  grads = jax.grad(loss_fn)(params, batch)
  updates, opt_state = opt.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def test_outer_sgd_lr_one_is_parameter_averaging():
  islands, inner_steps = 4, 3
  batches = helpers.random_batches(inner_steps, islands, 2)
  _, loss_fn, inner_opt, _, mesh, state = _setup(islands, outer=optax.sgd(1.0))
  inner = inner_step_lib.make_inner_step(loss_fn, inner_opt, mesh)
  for b in batches:
    state, _ = inner(state, _put_batch(b, mesh))
  island_params = jax.device_get(state.island_params)
  expected = jax.tree.map(lambda y: y.mean(axis=0), island_params)
  # The islands really diverged, so the average is not trivially any one.
  leaf = jax.tree.leaves(island_params)[0]
  assert not np.allclose(leaf[0], leaf[1])
  state = outer_step_lib.make_outer_step(optax.sgd(1.0), mesh)(
      state, _weights(islands, mesh))
  helpers.assert_trees_close(state.global_params, expected)
  # Every island restarts from the new global params.
  for i in range(islands):
    helpers.assert_trees_close(
        jax.tree.map(lambda y: y[i], state.island_params), expected)


def test_weighted_mean_weights_islands_by_tokens():
  islands = 2
  _, loss_fn, inner_opt, _, mesh, state = _setup(islands, outer=optax.sgd(1.0))
  inner = inner_step_lib.make_inner_step(loss_fn, inner_opt, mesh)
  state, _ = inner(state, _put_batch(helpers.random_batches(1, islands, 2)[0],
                                     mesh))
  y = jax.device_get(state.island_params)
  weights = jax.device_put(jnp.array([3.0, 1.0]), NamedSharding(
      mesh, jax.sharding.PartitionSpec("island")))
  state = outer_step_lib.make_outer_step(optax.sgd(1.0), mesh)(state, weights)
  expected = jax.tree.map(lambda a: 0.75 * a[0] + 0.25 * a[1], y)
  helpers.assert_trees_close(state.global_params, expected)


# Islands left out of a round: no weight, or a pseudo-gradient with NaN/inf.


def _diverged_islands_state(islands, outer_opt):
  """A state after one inner step and one outer step (so the outer
  momentum is not zero), then one more inner step."""
  _, loss_fn, inner_opt, _, mesh, state = _setup(islands, outer=outer_opt)
  inner = inner_step_lib.make_inner_step(loss_fn, inner_opt, mesh)
  outer_step = outer_step_lib.make_outer_step(outer_opt, mesh)
  batches = helpers.random_batches(2, islands, 2)
  state, _ = inner(state, _put_batch(batches[0], mesh))
  state = outer_step(state, _weights(islands, mesh))
  state, _ = inner(state, _put_batch(batches[1], mesh))
  return state, outer_step, mesh


def _poison(state, island):
  """Island `island`'s params with a NaN and an inf in every leaf."""
  def poison(y):
    y = np.array(y)
    y[island].reshape(-1)[:2] = [np.nan, np.inf]
    return y
  return state.replace(island_params=jax.device_put(
      jax.tree.map(poison, jax.device_get(state.island_params)),
      jax.tree.map(lambda a: a.sharding, state.island_params)))


def _island_weights(values, mesh):
  return jax.device_put(jnp.array(values, jnp.float32), NamedSharding(
      mesh, jax.sharding.PartitionSpec("island")))


def test_masked_weighted_mean_leaves_out_nan_and_weightless_islands():
  islands = 4
  state, outer_step, mesh = _diverged_islands_state(islands, optax.sgd(1.0))
  y = jax.device_get(state.island_params)
  state = _poison(state, 1)
  # Island 1 diverged, island 3 is not synced: x = (1 y0 + 2 y2) / 3.
  state = outer_step(state, _island_weights([1.0, 5.0, 2.0, 0.0], mesh))
  expected = jax.tree.map(lambda a: (a[0] + 2 * a[2]) / 3, y)
  helpers.assert_trees_close(state.global_params, expected)
  # Every island, the diverged one too, restarts from the finite x.
  for leaf in jax.tree.leaves(jax.device_get(state.island_params)):
    assert np.isfinite(leaf).all()
    np.testing.assert_array_equal(leaf[1], leaf[0])


def test_a_round_without_islands_moves_neither_x_nor_the_outer_state():
  islands = 2
  state, outer_step, mesh = _diverged_islands_state(
      islands, optax.sgd(0.7, momentum=0.9, nesterov=True))
  before = jax.device_get((state.global_params, state.outer.outer_opt_state))
  # Momentum alone would move x: its trace is not zero after one round.
  assert any(np.abs(leaf).max() > 0
             for leaf in jax.tree.leaves(before[1]))
  for weights, poisoned in (([0.0, 0.0], None), ([1.0, 1.0], "both")):
    if poisoned:
      state = _poison(_poison(state, 0), 1)
    state = outer_step(state, _island_weights(weights, mesh))
    after = jax.device_get((state.global_params, state.outer.outer_opt_state))
    jax.tree.map(np.testing.assert_array_equal, after, before)


def test_a_diverged_island_restarts_with_a_fresh_inner_state():
  islands = 2
  _, loss_fn, inner_opt, outer_opt, mesh, state = _setup(islands)
  inner = inner_step_lib.make_inner_step(loss_fn, inner_opt, mesh)
  outer_step = outer_step_lib.make_outer_step(outer_opt, mesh, inner_opt=inner_opt)
  for batch in helpers.random_batches(3, islands, 2):
    state, _ = inner(state, _put_batch(batch, mesh))
  before = jax.device_get(state.inner_opt_state)
  state = outer_step(_poison(state, 1), _weights(islands, mesh))
  after = jax.device_get(state.inner_opt_state)
  x = jax.device_get(state.global_params)
  fresh = optimizers.with_step_counts(inner_opt.init(x), 3)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[0], b[0]),
               after, before)  # the healthy island keeps its moments
  jax.tree.map(lambda a, f: np.testing.assert_array_equal(a[1], f),
               after, fresh)
  assert any(np.abs(np.asarray(b[1], np.float64)).max() > 0
             for b in jax.tree.leaves(before))  # it had moments to lose


@pytest.mark.parametrize("codec", ["int8", "topk", "adaptive_lowrank"])
def test_codecs_leave_out_a_nan_island(codec):
  config = config_schema.base_config().diloco
  config.codec = codec
  config.fallback_codec = "int8"
  compression = run_config.compression(config)
  state, outer_step, weights = helpers.state_after_one_inner_step(
      4, compression, error_feedback=True)
  residuals_before = jax.device_get(state.outer.residuals)
  state = outer_step(_poison(state, 2), weights)
  for leaf in jax.tree.leaves(jax.device_get(
      (state.global_params, state.outer.codec_state, state.outer.residuals))):
    assert np.isfinite(np.asarray(leaf, np.float64)).all()
  # The diverged island keeps the residual it had (it sent nothing).
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[2], b[2]),
               jax.device_get(state.outer.residuals), residuals_before)


def test_nesterov_outer_update_matches_optax_reference():
  islands, inner_steps, rounds = 2, 2, 3
  batches = helpers.random_batches(rounds * inner_steps, islands, 2)
  params, loss_fn, inner_opt, outer_opt, mesh, state = _setup(islands)
  inner = inner_step_lib.make_inner_step(loss_fn, inner_opt, mesh)
  outer_step = outer_step_lib.make_outer_step(outer_opt, mesh)
  reference_opt = optax.sgd(0.7, momentum=0.9, nesterov=True)
  x = jax.tree.map(np.array, params)  # a host copy: the state is donated
  ref_state = reference_opt.init(x)
  for r in range(rounds):
    for h in range(inner_steps):
      state, _ = inner(state, _put_batch(batches[r * inner_steps + h], mesh))
    y = jax.device_get(state.island_params)
    pseudo_grad = jax.tree.map(lambda g, yi: g - yi.mean(axis=0), x, y)
    updates, ref_state = reference_opt.update(pseudo_grad, ref_state, x)
    x = optax.apply_updates(x, updates)
    state = outer_step(state, _weights(islands, mesh))
    helpers.assert_trees_close(state.global_params, x)


def _numpy_outer_rule(name, outer, sparseloco):
  """update(pseudo_grads [k, ...] of one leaf, slot) -> the step x takes,
  for outer optimizer `name`, written out in numpy (float32) from each
  optimizer's definition; `slot` is a dict of that leaf's running values.
  Islands weigh the same (equal batches): the mean is a plain mean."""
  lr, mu = np.float32(outer.learning_rate), np.float32(outer.momentum or 0)
  b1, b2, eps = (np.float32(outer.b1), np.float32(outer.b2),
                 np.float32(outer.eps))

  def update(deltas, slot):
    if name == "sparseloco":
      # Per island: e <- beta e + d; s = Q(TopK(e)); e <- e - s; the
      # islands' s are what is averaged.
      e = np.float32(sparseloco.beta) * slot.get("e", 0) + deltas
      sent = np.stack([test_sparseloco._numpy_payload(  # pylint: disable=protected-access
          e_m, sparseloco.bits, sparseloco.chunk_size, sparseloco.density)
                       for e_m in e])
      slot["e"] = e - sent
      return lr * sent.mean(axis=0)
    g = deltas.mean(axis=0)
    if name == "sgd":
      return lr * g
    if name in ("momentum", "nesterov"):
      slot["t"] = mu * slot.get("t", 0) + g
      return lr * (slot["t"] if name == "momentum" else g + mu * slot["t"])
    assert name == "adam", name
    # 1 - b in float64 for the moments, in float32 for the bias correction,
    # as optax rounds them: they differ by 1.3e-5 (b2 = 0.999), 6e-6 of
    # a step where g is well above eps.
    n = slot["n"] = slot.get("n", 0) + 1
    slot["m"] = np.float32(1 - outer.b1) * g + b1 * slot.get("m", 0)
    slot["v"] = np.float32(1 - outer.b2) * g * g + b2 * slot.get("v", 0)
    m_hat, v_hat = slot["m"] / (1 - b1 ** n), slot["v"] / (1 - b2 ** n)
    return lr * m_hat / (np.sqrt(v_hat) + eps)

  return update


@pytest.mark.parametrize("name", config_schema.OUTER_OPTIMIZERS)
def test_every_outer_optimizer_steps_by_its_own_rule(name):
  """Three rounds on 2 islands with each outer optimizer as a run builds
  it from config.diloco (SparseLoCo with its own codec, error feedback
  and settings, at its default alpha): after each round, x is the numpy
  rule of that optimizer applied to the islands' pseudo-gradients. Three
  rounds tell heavy ball from Nesterov from SGD, and Adam's bias
  correction from none. float32 in both, with the same operations: x
  agrees to an ulp or two (measured: at most 1.2e-7 at |x| < 2), atol
  1e-6, where a step moves x by ~1e-3 or more."""
  config = config_schema.base_config().diloco
  config.outer_optimizer.name = name
  config.outer_optimizer.learning_rate, config.outer_optimizer.momentum = (
      (config.sparseloco.alpha, None) if name == "sparseloco" else (0.5, 0.9))
  # Adam's eps near the pseudo-gradients' size (~1e-2), not DiLoCo's 0.1
  # far above it, so that its moments, not eps alone, set the step.
  config.outer_optimizer.eps = 1e-3
  islands, inner_steps, rounds = 2, 2, 3
  compression = run_config.compression(config)
  outer_opt = optimizers.outer_optimizer(
      run_config.outer_optimizer(config.outer_optimizer))
  params, loss_fn = helpers.tiny_problem()
  params = jax.tree.map(np.array, params)
  inner_opt = optax.adamw(1e-2, weight_decay=0.1)
  mesh = mesh_lib.build_mesh(islands)
  state = outer_settings.init_state(params, inner_opt, outer_opt, islands,
                                    run_config.keeps_residuals(config),
                                    compression)
  state = jax.device_put(state, state_lib.state_shardings(state, mesh))
  inner = inner_step_lib.make_inner_step(loss_fn, inner_opt, mesh)
  outer_step = outer_step_lib.make_outer_step(outer_opt, mesh, compression)
  rule = _numpy_outer_rule(name, config.outer_optimizer, config.sparseloco)
  batches = helpers.random_batches(rounds * inner_steps, islands, 2)
  treedef = jax.tree.structure(params)
  slots = [{} for _ in range(treedef.num_leaves)]  # each leaf's, by round
  for r in range(rounds):
    for h in range(inner_steps):
      state, _ = inner(state, _put_batch(batches[r * inner_steps + h], mesh))
    # Each round from the run's own x and y: the islands' Adam would turn
    # last-bit differences of x into larger ones of y (assert_trees_close_
    # but_few), which are not what this test is about.
    x = treedef.flatten_up_to(jax.device_get(state.global_params))
    y = treedef.flatten_up_to(jax.device_get(state.island_params))
    state = outer_step(state, _weights(islands, mesh))
    x = [x_leaf - rule(x_leaf[None] - y_leaf, slot)
         for x_leaf, y_leaf, slot in zip(x, y, slots, strict=True)]
    helpers.assert_trees_close(state.global_params,
                               jax.tree.unflatten(treedef, x),
                               rtol=0, atol=1e-6)


def test_islands_start_identical_and_get_different_batches():
  islands = 4
  params, loss_fn, inner_opt, _, mesh, state = _setup(islands)
  y = jax.device_get(state.island_params)
  for i in range(islands):
    helpers.assert_trees_close(jax.tree.map(lambda a: a[i], y), params,
                               rtol=0, atol=0)
  inner = inner_step_lib.make_inner_step(loss_fn, inner_opt, mesh)
  batch = helpers.random_batches(1, islands, 2)[0]
  state, metrics = inner(state, _put_batch(batch, mesh))
  losses = np.asarray(metrics["loss"])
  assert len(set(np.round(losses, 6))) == islands  # each saw its own data
  y = jax.tree.leaves(jax.device_get(state.island_params))[0]
  assert not np.allclose(y[0], y[1])


@pytest.mark.slow
def test_data_parallel_replicas_inside_island_match_one_replica():
  """(islands=2, data=2) equals (islands=2, data=1) at the same island batch."""
  batches = helpers.random_batches(4, 2, 4)
  one = _run_diloco(2, 1, rounds=2, inner_steps=2, batches=batches)
  two = _run_diloco(2, 2, rounds=2, inner_steps=2, batches=batches)
  helpers.assert_trees_close(one.global_params, two.global_params,
                             rtol=2e-5, atol=2e-6)
  helpers.assert_trees_close(one.inner_opt_state, two.inner_opt_state,
                             rtol=2e-5, atol=2e-6)


def _all_reduce_groups(hlo_text: str):
  """Replica groups of every all-reduce in an HLO module, as sets of ids."""
  groups = []
  for line in hlo_text.splitlines():
    if " all-reduce(" not in line and " all-reduce-start(" not in line:
      continue
    match = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)
    if match:
      groups.append(frozenset(
          frozenset(int(i) for i in g.split(","))
          for g in re.findall(r"\{([\d,]+)\}", match.group(1))))
      continue
    match = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\]"
                      r"(?:T\(([\d,]+)\))?", line)
    if match:
      groups.append(_iota_groups(*match.groups()))
      continue
    # Newer XLA (jax >= 0.11): replica_groups=mesh['island'=2,'data'=2] {'island'}
    match = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    assert match, f"cannot parse replica groups in: {line}"
    groups.append(_mesh_groups(match.group(1), match.group(2)))
  return groups


def _mesh_groups(axes: str, reduced: str):
  """Groups of a mesh-form replica_groups: device ids (row-major over the
  mesh's axes) that vary along the reduced axes only."""
  sizes = dict((name, int(size))
               for name, size in re.findall(r"'(\w+)'=(\d+)", axes))
  reduced_axes = re.findall(r"'(\w+)'", reduced)
  names = list(sizes)
  ids = np.arange(int(np.prod(list(sizes.values())))).reshape(
      list(sizes.values()))
  order = ([i for i, n in enumerate(names) if n not in reduced_axes]
           + [names.index(n) for n in reduced_axes])
  group_size = int(np.prod([sizes[n] for n in reduced_axes]))
  rows = ids.transpose(order).reshape(-1, group_size)
  return frozenset(frozenset(int(i) for i in row) for row in rows)


def _iota_groups(num_groups, group_size, dims, transpose):
  dims = [int(d) for d in dims.split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if transpose:
    ids = ids.transpose([int(t) for t in transpose.split(",")])
  ids = ids.reshape(int(num_groups), int(group_size))
  return frozenset(frozenset(int(i) for i in row) for row in ids)


def _device_groups(mesh, axis):
  """Device-id groups that vary along `axis` only (the collective's groups)."""
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  axis_index = mesh.axis_names.index(axis)
  moved = np.moveaxis(ids, axis_index, -1).reshape(-1, ids.shape[axis_index])
  return frozenset(frozenset(int(i) for i in row) for row in moved)


def test_outer_step_reduces_across_islands_and_inner_step_does_not():
  islands, data = 2, 2
  _, loss_fn, inner_opt, outer_opt, mesh, state = _setup(islands, data)
  island_groups = _device_groups(mesh, "island")
  data_groups = _device_groups(mesh, "data")
  outer_hlo = outer_step_lib.make_outer_step(outer_opt, mesh).lower(
      state, _weights(islands, mesh)).compile().as_text()
  assert island_groups in _all_reduce_groups(outer_hlo)

  batch = _put_batch(helpers.random_batches(1, islands, 4)[0], mesh)
  inner_hlo = inner_step_lib.make_inner_step(loss_fn, inner_opt, mesh).lower(
      state, batch).compile().as_text()
  inner_groups = _all_reduce_groups(inner_hlo)
  assert data_groups in inner_groups
  assert island_groups not in inner_groups  # islands never talk mid-round

  ddp_hlo = inner_step_lib.make_inner_step(
      loss_fn, inner_opt, mesh, sync_gradients_across_islands=True).lower(
          state, batch).compile().as_text()
  assert island_groups in _all_reduce_groups(ddp_hlo)


@pytest.mark.parametrize("islands,data", [(2, 1), (2, 2)])
def test_microbatched_step_equals_the_whole_batch(islands, data):
  """Gradient accumulation over 4 parts takes the whole batch's step."""
  batch = helpers.random_batches(1, islands, 8)[0]
  results = {}
  for microbatches in (1, 4):
    _, loss_fn, inner_opt, _, mesh, state = _setup(islands, data)
    step = inner_step_lib.make_inner_step(loss_fn, inner_opt, mesh,
                                          microbatches=microbatches)
    state, metrics = step(state, _put_batch(batch, mesh))
    results[microbatches] = (jax.device_get(metrics),
                             jax.device_get(state.island_params))
  (one_metrics, one), (four_metrics, four) = results[1], results[4]
  np.testing.assert_allclose(four_metrics["loss"], one_metrics["loss"],
                             rtol=1e-6)
  np.testing.assert_allclose(four_metrics["grad_norm"],
                             one_metrics["grad_norm"], rtol=1e-5)
  helpers.assert_trees_close(four, one, rtol=1e-5, atol=1e-6)


def _collective_sizes(hlo: str) -> list[list[int]]:
  """Per collective in compiled HLO text, the element counts of its
  operands (a collective over a tuple has several)."""
  ops = "all-to-all|all-gather|all-reduce|collective-permute|reduce-scatter"
  return [[int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
           for dims in re.findall(r"\[([\d,]*)\]", types)]
          for types in helpers.collective_types(hlo, ops)]


@pytest.mark.parametrize("islands,data", [(2, 1), (2, 2)])
def test_evaluation_sends_no_params_across_islands(islands, data):
  """Scoring x (DiLoCo) or the identical islands (ddp) moves losses only;
  the islands' average is one all-reduce of the params for all batches."""
  params, loss_fn, _, _, mesh, state = _setup(islands, data)
  batch = jax.device_put(
      helpers.random_batches(1, 1, 4 * islands * data)[0, 0],
      NamedSharding(mesh, jax.sharding.PartitionSpec(
          (mesh_lib.ISLAND, mesh_lib.DATA))))
  for mode in ("ddp", "diloco"):
    evaluate = evaluation_lib.make_evaluate(loss_fn, mode)
    sizes = _collective_sizes(
        evaluate.lower(state, batch).compile().as_text())
    assert max(n for op in sizes for n in op) <= islands * data, (mode, sizes)
    # ddp's islands are identical: each island's share with its own params
    # is island 0's loss on the whole batch.
    island_0 = loss_fn(jax.tree.map(lambda y: np.asarray(y)[0],
                                    state.island_params), np.asarray(batch))
    np.testing.assert_allclose(evaluate(state, batch), island_0, rtol=1e-6)

  evaluate_mean = evaluation_lib.make_evaluate_island_mean(loss_fn)
  sizes = _collective_sizes(
      evaluate_mean.lower(state, (batch,) * 3).compile().as_text())
  leaf_sizes = sorted(int(np.size(p)) for p in jax.tree.leaves(params))
  # Each param crosses once (XLA may combine them into one collective).
  sent = sorted(n for op in sizes for n in op if n > islands * data)
  assert sent == leaf_sizes, sizes
