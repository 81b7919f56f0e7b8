"""The public outer step (algorithm/library.py) against the built-in one.

A hand-written loop's outer_update must compute what the runs compute:
after the same inner steps, its x equals make_outer_step's, stacked or per
island inside shard_map, with any codec. Both run sync_island (one
implementation), so they differ only in how XLA fuses the same float32
arithmetic: rtol 1e-6 allows a few ulps of reassociation.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import fragments
from diloco_jax.algorithm import inner_step as inner_step_lib
from diloco_jax.algorithm import library as diloco
from diloco_jax.algorithm import outer_settings
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.codecs import dense as dense_codecs
from diloco_jax.config import run_config
from diloco_jax.config import schema as config_schema
from diloco_jax.model import transformer as model_lib
from diloco_jax.parallel import mesh as mesh_lib
from tests import helpers

ISLANDS = 4


def test_codec_by_name_carries_its_settings_as_a_run_builds_them():
  """library.codec is how runs build their codec (run_config.compression):
  each name's settings land in the fields its collective reads."""
  dense = lambda name: dense_codecs.make_codec(name, 128)
  cases = {
      "int4": compression_lib.Compression("int4", dense("int4")),
      "topk": compression_lib.Compression("topk", dense("bf16"),
                                          topk_fraction=0.05,
                                          prune_rate=0.25),
      "sign_prune": compression_lib.Compression("sign_prune", dense("bf16"),
                                                topk_fraction=0.05,
                                                prune_rate=0.25),
      "lowrank": compression_lib.Compression("lowrank", dense("bf16"),
                                             ranks=(8,)),
      "adaptive_lowrank": compression_lib.Compression(
          "adaptive_lowrank", dense("bf16"), ranks=(16, 32, 64),
          energy_fraction=0.8, factor_codec=dense("fp4")),
  }
  for name, expected in cases.items():
    config = config_schema.base_config()
    config.diloco.update(codec=name, codec_block_size=128,
                         fallback_codec="bf16", topk_fraction=0.05,
                         prune_rate=0.25)
    config.diloco.lowrank.update(rank=8, min_rank=16, max_rank=64,
                                 energy_fraction=0.8, factor_codec="fp4")
    assert run_config.compression(config.diloco) == expected, name
  config.diloco.outer_optimizer.name = "sparseloco"
  config.diloco.codec_block_size = 256
  config.diloco.sparseloco.update(chunk_size=1024, density=0.05, bits=4,
                                  beta=0.9)
  assert run_config.compression(config.diloco) == diloco.sparseloco(
      chunk_size=1024, density=0.05, bits=4, beta=0.9)[1]
  with pytest.raises(ValueError, match="'int3' is not one of"):
    diloco.codec("int3")


def _islands_after_a_round(seed=0):
  """(x, the islands' params after 3 AdamW steps each on its own data)."""
  params, loss_fn = helpers.tiny_problem(seed)
  params = jax.tree.map(np.array, params)
  inner_opt = optax.adamw(1e-2, weight_decay=0.1)
  mesh = mesh_lib.build_mesh(ISLANDS, 1)
  state = outer_settings.init_state(params, inner_opt, optax.sgd(1.0), ISLANDS)
  state = jax.device_put(state, state_lib.state_shardings(state, mesh))
  inner = inner_step_lib.make_inner_step(loss_fn, inner_opt, mesh)
  for batch in helpers.random_batches(3, ISLANDS, 4):
    state, _ = inner(state, jax.device_put(
        batch, NamedSharding(mesh, state_lib.BATCH_SPEC)))
  return params, jax.device_get(state.island_params)


def _built_in(params, island_params, outer_tx, compression, weights):
  mesh = mesh_lib.build_mesh(ISLANDS, 1)
  state = outer_settings.init_state(params, optax.adamw(1e-2), outer_tx,
                                    ISLANDS, compression=compression)
  state = state.replace(island_params=island_params)
  state = jax.device_put(state, state_lib.state_shardings(state, mesh))
  step = outer_step_lib.make_outer_step(outer_tx, mesh, compression)
  state = step(state, jax.device_put(
      jnp.asarray(weights, jnp.float32), NamedSharding(mesh, P("island"))))
  return jax.device_get(state.global_params)


# The structured codecs by name, each with settings of its own;
# adaptive_lowrank keeps state (bases, ranks). Its factors cross in fp32
# here: they come out of matmuls and a QR, which the two programs may round
# an ulp apart, and a quantized factor would turn that into a whole
# quantization step on a row.
CODECS = {"fp32": {}, "int8": {},
          "topk": dict(topk_fraction=0.1, fallback="int8"),
          "sign_prune": dict(prune_rate=0.5),
          "adaptive_lowrank": dict(rank=4, min_rank=2, energy_fraction=0.8)}


@pytest.mark.slow
@pytest.mark.parametrize("codec_name", list(CODECS))
def test_outer_update_equals_the_built_in_outer_step(codec_name):
  params, island_params = _islands_after_a_round()
  outer_tx = diloco.nesterov(0.7, 0.9)
  compression = diloco.codec(codec_name, **CODECS[codec_name])
  weights = [1.0, 2.0, 0.0, 1.0]  # island 2 dropped this round
  expected = _built_in(params, island_params, outer_tx, compression,
                       weights)

  state = diloco.init(params, outer_tx, ISLANDS, compression=compression)
  x, state, included = jax.jit(functools.partial(
      diloco.outer_update, outer_tx=outer_tx, compression=compression))(
          params, island_params, state, weights=jnp.asarray(weights))
  np.testing.assert_array_equal(included, [True, True, False, True])
  assert int(state.round) == 1
  sent, dense = (diloco.bytes_sent(params, ISLANDS, compression,
                                   state.codec_state),
                 diloco.bytes_sent(params, ISLANDS))
  assert sent == dense if codec_name == "fp32" else sent < dense
  helpers.assert_trees_close(x, expected, rtol=1e-6, atol=1e-7)
  # x moved: the islands did learn something different from x.
  assert max(float(jnp.abs(a - b).max()) for a, b in zip(
      jax.tree.leaves(x), jax.tree.leaves(params))) > 1e-4

  # Per island, inside shard_map over the islands' devices.
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:ISLANDS]), ("islands",))
  per_island_state = diloco.init(params, outer_tx, compression=compression)

  def one_island(y, w):
    y = jax.tree.map(lambda a: a[0], y)
    x, _, _ = diloco.outer_update(params, y, per_island_state, outer_tx,
                                  weights=w[0], compression=compression,
                                  axis_name="islands")
    return x

  sharded = jax.jit(jax.shard_map(
      one_island, mesh=mesh, in_specs=(P("islands"), P("islands")),
      out_specs=P(), check_vma=False))
  on_islands = NamedSharding(mesh, P("islands"))
  helpers.assert_trees_close(
      sharded(jax.device_put(island_params, on_islands),
              jax.device_put(jnp.asarray(weights), on_islands)),
      expected, rtol=1e-6, atol=1e-7)


def _rounds_of_moves(rounds: int, seed: int):
  """(x, per round the islands' moves from their start [k, ...], unequal
  island weights): island params given round by round, no training."""
  params, _ = helpers.tiny_problem(0)
  params = jax.tree.map(np.array, params)
  rng = np.random.default_rng(seed)
  moves = [jax.tree.map(lambda p: rng.normal(
      0, 1e-2, (ISLANDS,) + p.shape).astype(np.float32), params)
           for _ in range(rounds)]
  return params, moves, jnp.asarray([1.0, 2.0, 1.0, 1.0], jnp.float32)


def test_the_one_step_delay_equals_the_built_in_one():
  """Two rounds of given island params, then the flush: x after each
  equals make_outer_step(overlap='one_step_delay') and make_flush's,
  stacked and per island inside shard_map."""
  params, moves, weights = _rounds_of_moves(2, seed=0)
  outer_tx = diloco.nesterov(0.7, 0.9)

  mesh = mesh_lib.build_mesh(ISLANDS, 1)
  built_in = outer_settings.init_state(params, optax.adamw(1e-2), outer_tx,
                                       ISLANDS, overlap="one_step_delay")
  built_in = jax.device_put(built_in,
                            state_lib.state_shardings(built_in, mesh))
  step = outer_step_lib.make_outer_step(outer_tx, mesh,
                                        overlap="one_step_delay")
  on_islands = NamedSharding(mesh, P("island"))
  x = params
  state = diloco.init(params, outer_tx, ISLANDS, one_step_delay=True)
  for move in moves:
    islands = jax.tree.map(lambda a, m: a[None] - m, x, move)
    built_in = step(built_in.replace(island_params=jax.device_put(
        islands, state_lib.state_shardings(built_in, mesh).island_params)),
                    jax.device_put(weights, on_islands))
    x, state, _ = diloco.outer_update(x, islands, state, outer_tx,
                                      weights=weights)
    helpers.assert_trees_close(x, jax.device_get(built_in.global_params),
                               rtol=1e-6, atol=1e-7)
  flushed = outer_step_lib.make_flush(outer_tx, mesh)(built_in)
  x, state = diloco.flush(x, state, outer_tx)
  helpers.assert_trees_close(x, jax.device_get(flushed.global_params),
                             rtol=1e-6, atol=1e-7)
  assert not bool(state.in_flight_valid)

  # Per island, inside shard_map: the same two rounds and the flush.
  islands_mesh = jax.sharding.Mesh(np.array(jax.devices()[:ISLANDS]),
                                   ("islands",))

  def per_island(moves, weights):
    x = params
    state = diloco.init(params, outer_tx, one_step_delay=True)
    for move in moves:
      x, state, _ = diloco.outer_update(
          x, jax.tree.map(lambda a, m: a - m[0], x, move), state, outer_tx,
          weights=weights[0], axis_name="islands")
    return diloco.flush(x, state, outer_tx)[0]

  on_islands = NamedSharding(islands_mesh, P("islands"))
  sharded = jax.jit(jax.shard_map(
      per_island, mesh=islands_mesh, in_specs=(P("islands"), P("islands")),
      out_specs=P(), check_vma=False))
  helpers.assert_trees_close(
      sharded(jax.device_put(moves, on_islands),
              jax.device_put(weights, on_islands)),
      jax.device_get(flushed.global_params), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("own_weight", [1.0, None], ids=["eager",
                                                         "eager_share"])
def test_eager_updates_equal_the_built_in_ones(own_weight):
  """Three rounds (the first waiting for its own mean, as a warm-up
  round does) of given island params, then the settle: every island's
  point after each round and the final x equal make_outer_step's with
  overlap 'eager' (own weight 1) or 'eager_share', and make_flush's."""
  params, moves, weights = _rounds_of_moves(3, seed=1)
  outer_tx = diloco.nesterov(0.7, 0.9)
  overlap = "eager" if own_weight is not None else "eager_share"

  mesh = mesh_lib.build_mesh(ISLANDS, 1)
  built_in = outer_settings.init_state(params, optax.adamw(1e-2), outer_tx,
                                       ISLANDS, overlap=overlap,
                                       eager_own_weight=own_weight,
                                       warmup_rounds=1)
  shardings = state_lib.state_shardings(built_in, mesh)
  built_in = jax.device_put(built_in, shardings)
  step = outer_step_lib.make_outer_step(outer_tx, mesh, overlap=overlap,
                                        eager_own_weight=own_weight,
                                        warmup_rounds=1)
  points, state = diloco.eager_init(params, outer_tx, ISLANDS)
  for r, move in enumerate(moves):
    islands = jax.tree.map(jnp.subtract, points, move)
    built_in = step(built_in.replace(island_params=jax.device_put(
        islands, shardings.island_params)),
                    jax.device_put(weights, NamedSharding(mesh, P("island"))))
    points, state, _ = diloco.eager_update(
        points, islands, state, outer_tx, weights=weights,
        own_weight=own_weight, wait=r < 1)
    helpers.assert_trees_close(points, jax.device_get(built_in.outer.anchors),
                               rtol=1e-6, atol=1e-7)
  flushed = outer_step_lib.make_flush(outer_tx, mesh)(built_in)
  x, _ = diloco.eager_settle(points, state, outer_tx)
  helpers.assert_trees_close(x, jax.device_get(flushed.global_params),
                             rtol=1e-6, atol=1e-7)

  # Per island, inside shard_map: the same rounds; each island's point and
  # the settled x equal the stacked ones.
  islands_mesh = jax.sharding.Mesh(np.array(jax.devices()[:ISLANDS]),
                                   ("islands",))

  def per_island(moves, weights):
    points, state = diloco.eager_init(params, outer_tx)
    for r, move in enumerate(moves):
      islands = jax.tree.map(lambda a, m: a - m[0], points, move)
      points, state, _ = diloco.eager_update(
          points, islands, state, outer_tx, weights=weights[0],
          own_weight=own_weight, wait=r < 1, axis_name="islands")
    x, _ = diloco.eager_settle(points, state, outer_tx,
                               axis_name="islands")
    return jax.tree.map(lambda a: a[None], points), x

  on_islands = NamedSharding(islands_mesh, P("islands"))
  sharded = jax.jit(jax.shard_map(
      per_island, mesh=islands_mesh, in_specs=(P("islands"), P("islands")),
      out_specs=(P("islands"), P()), check_vma=False))
  island_points, island_x = sharded(jax.device_put(moves, on_islands),
                                    jax.device_put(weights, on_islands))
  helpers.assert_trees_close(island_points, points, rtol=1e-6, atol=1e-7)
  helpers.assert_trees_close(island_x, x, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("codec_name", ["int8", "adaptive_lowrank"])
def test_streaming_sends_and_merges_equal_the_built_in_ones(codec_name):
  """Two fragments over two rounds of H = 4 (tau = 1, alpha = 0.5, error
  feedback) while the islands move by given steps: after every step's
  sends and merges (streaming_schedule's), x and the islands equal
  make_fragment_send's and make_fragment_merge's on a TrainState; per
  island inside shard_map, the end is the same."""
  config = helpers.tiny_model_config()
  config.num_layers = 2
  _, params = model_lib.init_params(config, 0)
  params = jax.tree.map(np.array, params)
  inner_steps, num_fragments, tau, alpha, total = 4, 2, 1, 0.5, 8
  compression = diloco.codec(codec_name, **CODECS.get(codec_name, {}))
  outer_tx = diloco.nesterov(0.7, 0.9)
  weights = jnp.asarray([1.0, 2.0, 0.0, 1.0], jnp.float32)
  rng = np.random.default_rng(2)
  moves = [jax.tree.map(lambda p: rng.normal(
      0, 1e-2, (ISLANDS,) + p.shape).astype(np.float32), params)
           for _ in range(total)]
  schedule = [diloco.streaming_schedule(
      step, inner_steps=inner_steps, num_fragments=num_fragments,
      total_steps=total, fragment_delay=tau) for step in range(1, total + 1)]
  assert ("send", 1) in schedule[1] and ("merge", 1) in schedule[2]

  mesh = mesh_lib.build_mesh(ISLANDS, 1)
  built_in = outer_settings.init_state(params, optax.adamw(1e-2), outer_tx,
                                       ISLANDS, error_feedback=True,
                                       compression=compression)
  built_in_outer = diloco.diloco(outer_tx, compression,
                                 diloco.streaming(num_fragments),
                                 error_feedback=True)
  built_in = built_in.replace(outer=built_in_outer.init(params, ISLANDS))
  shardings = state_lib.state_shardings(built_in, mesh)
  built_in = jax.device_put(built_in, shardings)
  built_in_programs = {
      ("send", f): fragments.make_fragment_send(built_in_outer, mesh, f)
      for f in range(num_fragments)} | {
      ("merge", f): fragments.make_fragment_merge(mesh, num_fragments, f,
                                                  alpha)
      for f in range(num_fragments)}
  on_islands = NamedSharding(mesh, P("island"))

  state = diloco.streaming_init(params, outer_tx, num_fragments, ISLANDS,
                                compression=compression, error_feedback=True)
  assert state.assignment == fragments.leaf_fragments(params, num_fragments)
  send = jax.jit(functools.partial(diloco.fragment_send, outer_tx=outer_tx,
                                   compression=compression),
                 static_argnums=3)
  merge = jax.jit(functools.partial(diloco.fragment_merge, alpha=alpha),
                  static_argnums=3)
  x, islands = params, diloco.island_copies(params, ISLANDS)
  for move, actions in zip(moves, schedule):
    islands = jax.tree.map(jnp.subtract, islands, move)
    built_in = built_in.replace(island_params=jax.device_put(
        jax.tree.map(jnp.subtract, jax.device_get(built_in.island_params),
                     move), shardings.island_params))
    for kind, f in actions:
      if kind == "send":
        built_in = built_in_programs[kind, f](
            built_in, jax.device_put(weights, on_islands))
        x, state, _ = send(x, islands, state, f, weights=weights)
      else:
        built_in = built_in_programs[kind, f](built_in)
        islands = merge(x, islands, state, f)
    helpers.assert_trees_close(x, jax.device_get(built_in.global_params),
                               rtol=1e-6, atol=1e-7)
    helpers.assert_trees_close(islands,
                               jax.device_get(built_in.island_params),
                               rtol=1e-6, atol=1e-7)
  if codec_name != "int8":
    return

  islands_mesh = jax.sharding.Mesh(np.array(jax.devices()[:ISLANDS]),
                                   ("islands",))

  def per_island(moves, weights):
    x, y = params, params
    state = diloco.streaming_init(params, outer_tx, num_fragments,
                                  compression=compression,
                                  error_feedback=True)
    for move, actions in zip(moves, schedule):
      y = jax.tree.map(lambda a, m: a - m[0], y, move)
      for kind, f in actions:
        if kind == "send":
          x, state, _ = diloco.fragment_send(
              x, y, state, f, outer_tx, weights=weights[0],
              compression=compression, axis_name="islands")
        else:
          y = diloco.fragment_merge(x, y, state, f, alpha,
                                    axis_name="islands")
    return x, jax.tree.map(lambda a: a[None], y)

  on_islands = NamedSharding(islands_mesh, P("islands"))
  sharded = jax.jit(jax.shard_map(
      per_island, mesh=islands_mesh, in_specs=(P("islands"), P("islands")),
      out_specs=(P(), P("islands")), check_vma=False))
  island_x, island_y = sharded(jax.device_put(moves, on_islands),
                               jax.device_put(weights, on_islands))
  helpers.assert_trees_close(island_x, x, rtol=1e-6, atol=1e-7)
  helpers.assert_trees_close(island_y, islands, rtol=1e-6, atol=1e-7)


def test_a_tree_without_blocks_is_cut_into_runs_of_about_equal_size():
  """Fragments of a model that is not ours: consecutive leaves, each
  fragment non-empty, sizes as even as whole leaves allow."""
  tree = lambda *sizes: {f"w{i}": jnp.zeros((n,)) for i, n in
                         enumerate(sizes)}
  assert diloco.fragment_assignment(tree(10, 10, 10, 10), 2) == (0, 0, 1, 1)
  assert diloco.fragment_assignment(tree(100, 1, 1, 1), 2) == (0, 1, 1, 1)
  assert diloco.fragment_assignment(tree(1, 1, 100), 3) == (0, 1, 2)
  assert diloco.fragment_assignment(tree(5, 5, 5, 5, 5, 5), 3) == (
      0, 0, 1, 1, 2, 2)
  with pytest.raises(ValueError, match="3 fragments need 1 to 2 leaves"):
    diloco.fragment_assignment(tree(1, 1), 3)
  with pytest.raises(ValueError, match="must give each"):
    diloco.streaming_init(tree(1, 1), diloco.fedavg(), 2,
                          assignment=(0, 0))


@pytest.mark.slow
def test_a_stacked_state_placed_by_island_specs_runs_per_island():
  """Two rounds of int8 with error feedback, and of eager updates, per
  island inside shard_map with the stacked state split by island_specs:
  x, each island's residuals (and eager's points and outer states) equal
  the stacked form's (rtol 1e-6: the same sums, reduced in another
  order)."""
  params, moves, weights = _rounds_of_moves(2, seed=3)
  compression, outer_tx = diloco.codec("int8"), diloco.nesterov(0.7, 0.9)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:ISLANDS]), ("islands",))
  on_islands = NamedSharding(mesh, P("islands"))

  x, state = params, diloco.init(params, outer_tx, ISLANDS,
                                 compression=compression,
                                 error_feedback=True)
  specs = diloco.island_specs(state, "islands")

  def per_island(x, move, block, weight):
    state = diloco.this_island(block)
    islands = jax.tree.map(lambda a, m: a - m[0], x, move)
    x, state, _ = diloco.outer_update(x, islands, state, outer_tx,
                                      weights=weight[0],
                                      compression=compression,
                                      axis_name="islands")
    return x, diloco.island_block(state)

  sharded = jax.jit(jax.shard_map(
      per_island, mesh=mesh, in_specs=(P(), P("islands"), specs,
                                       P("islands")),
      out_specs=(P(), specs), check_vma=False))
  island_x, island_state = x, state
  for move in moves:
    islands = jax.tree.map(lambda a, m: a - m, diloco.island_copies(x, 4),
                           move)
    x, state, _ = diloco.outer_update(x, islands, state, outer_tx,
                                      weights=weights,
                                      compression=compression)
    island_x, island_state = sharded(island_x,
                                     jax.device_put(move, on_islands),
                                     island_state,
                                     jax.device_put(weights, on_islands))
  helpers.assert_trees_close(island_x, x, rtol=1e-6, atol=1e-7)
  helpers.assert_trees_close(island_state.residuals, state.residuals,
                             rtol=1e-6, atol=1e-7)

  points, eager = diloco.eager_init(params, outer_tx, ISLANDS)
  eager_specs = diloco.island_specs(eager, "islands")

  def eager_per_island(point, move, block, weight):
    point = jax.tree.map(lambda a: a[0], point)
    islands = jax.tree.map(lambda a, m: a - m[0], point, move)
    point, block_state, _ = diloco.eager_update(
        point, islands, diloco.this_island(block), outer_tx,
        weights=weight[0], axis_name="islands")
    return (jax.tree.map(lambda a: a[None], point),
            diloco.island_block(block_state))

  eager_sharded = jax.jit(jax.shard_map(
      eager_per_island, mesh=mesh,
      in_specs=(P("islands"), P("islands"), eager_specs, P("islands")),
      out_specs=(P("islands"), eager_specs), check_vma=False))
  island_points, island_eager = points, eager
  for move in moves:
    islands = jax.tree.map(lambda a, m: a - m, points, move)
    points, eager, _ = diloco.eager_update(points, islands, eager, outer_tx,
                                           weights=weights)
    island_points, island_eager = eager_sharded(
        island_points, jax.device_put(move, on_islands), island_eager,
        jax.device_put(weights, on_islands))
  helpers.assert_trees_close(island_points, points, rtol=1e-6, atol=1e-7)
  helpers.assert_trees_close(island_eager.outer_opt_states,
                             eager.outer_opt_states, rtol=1e-6, atol=1e-7)
  with pytest.raises(ValueError, match="not a block of one island"):
    diloco.this_island(state)  # the whole stacked state, not a block
