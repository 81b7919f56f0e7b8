r"""Inner/outer step cost and model FLOP utilization, on one device.

Prints, for the config's model and per-island batch:
  * the DiLoCo inner step (k=1 mesh, shard_map, donated state) against a plain
    jitted optax train step of the same model and batch (throughput ratio);
  * the outer step's time as a fraction of H=100 inner steps;
  * model FLOP utilization against an XLA f32 matmul measured in this run.
Timings are medians over interleaved repeats, so both sides see the same
machine noise.

  python benchmarks/step_benchmark.py --config=configs/default.py
"""

import functools
import statistics
import time

from absl import app
from absl import flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py",
                                          "Config whose model to measure.")
_REPEATS = flags.DEFINE_integer("repeats", 7, "Interleaved timing repeats.")
_STEPS = flags.DEFINE_integer("steps", 10, "Steps per timed block.")


def _time_block(fn, steps: int) -> float:
  """Seconds per call of fn(), which must block on its own result."""
  start = time.perf_counter()
  for _ in range(steps):
    fn()
  return (time.perf_counter() - start) / steps


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from diloco_jax import diloco, flops, mesh as mesh_lib, model as model_lib  # pylint: disable=g-import-not-at-top
  from diloco_jax import optimizers  # pylint: disable=g-import-not-at-top

  config = _CONFIG.value
  seq_len, batch_size = config.data.sequence_length, config.data.batch_size
  graphdef, params = model_lib.init_params(config.model, config.seed)
  loss_fn = functools.partial(model_lib.next_token_loss, graphdef)
  inner_opt = optimizers.inner_optimizer(config.inner_optimizer,
                                         config.total_steps)
  outer_opt = optimizers.outer_optimizer(config.diloco.outer_optimizer)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, config.model.vocab_size,
                        (batch_size, seq_len + 1), dtype=np.int32)

  # Plain optax training step: the reference every framework would write.
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def plain_step(p, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(p, batch)
    updates, opt_state = inner_opt.update(grads, opt_state, p)
    return optax.apply_updates(p, updates), opt_state, loss

  plain = {"params": jax.tree.map(jnp.array, params)}
  plain["opt"] = inner_opt.init(plain["params"])
  plain_batch = jnp.asarray(tokens)

  def run_plain():
    plain["params"], plain["opt"], loss = plain_step(
        plain["params"], plain["opt"], plain_batch)
    loss.block_until_ready()

  # DiLoCo on a one-device (1, 1, 1) mesh.
  mesh = mesh_lib.build_mesh(1, 1, 1, devices=jax.devices()[:1])
  state = diloco.init_state(params, inner_opt, outer_opt, 1)
  state = jax.device_put(state, diloco.state_shardings(state, mesh))
  island_batch = jax.device_put(tokens[None],
                                NamedSharding(mesh, diloco.BATCH_SPEC))
  weights = jax.device_put(jnp.ones((1,), jnp.float32), NamedSharding(
      mesh, jax.sharding.PartitionSpec(mesh_lib.ISLAND)))
  inner_step = diloco.make_inner_step(loss_fn, inner_opt, mesh)
  outer_step = diloco.make_outer_step(outer_opt, mesh)
  holder = {"state": state}

  def run_inner():
    holder["state"], metrics = inner_step(holder["state"], island_batch)
    metrics["loss"].block_until_ready()

  def run_outer():
    holder["state"] = outer_step(holder["state"], weights)
    jax.block_until_ready(holder["state"].global_params)

  # XLA f32 matmul ceiling, in this process.
  matmuls = {}
  for n in (1024, 2048):
    a = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
    mm = jax.jit(jnp.matmul)
    matmuls[n] = (functools.partial(lambda m, x, y: m(x, y).block_until_ready(),
                                    mm, a, b), flops.matmul_flops(n, n, n))

  for fn in (run_plain, run_inner, run_outer, *(f for f, _ in matmuls.values())):
    fn()  # compile and warm up
    fn()

  samples = {"plain": [], "inner": [], "outer": [], 1024: [], 2048: []}
  for _ in range(_REPEATS.value):
    samples["plain"].append(_time_block(run_plain, _STEPS.value))
    samples["inner"].append(_time_block(run_inner, _STEPS.value))
    samples["outer"].append(_time_block(run_outer, _STEPS.value))
    for n, (fn, _) in matmuls.items():
      samples[n].append(_time_block(fn, 3))
  med = {k: statistics.median(v) for k, v in samples.items()}

  matmul_gflops = max(matmuls[n][1] / med[n] for n in matmuls) / 1e9
  flops_per_step = flops.training_flops_per_token(config.model, seq_len) * (
      batch_size * seq_len)
  model_gflops = flops_per_step / med["inner"] / 1e9
  num_params = model_lib.count_params(params)

  print(f"device: {jax.devices()[0].device_kind} x1, jax {jax.__version__}")
  print(f"model: {num_params:,} params, batch {batch_size} x {seq_len} tokens")
  print(f"plain optax step      {med['plain'] * 1e3:9.2f} ms")
  print(f"DiLoCo inner step     {med['inner'] * 1e3:9.2f} ms")
  print(f"  throughput ratio (plain time / inner time): "
        f"{med['plain'] / med['inner']:.3f}  (target >= 0.97)")
  print(f"DiLoCo outer step     {med['outer'] * 1e3:9.2f} ms")
  # As a percentage of a round of H=100 inner steps: 100 * outer / (100 * inner).
  print(f"  outer / (100 x inner): {med['outer'] / med['inner']:.3f}%"
        "  (target <= 1%)")
  for n in matmuls:
    print(f"f32 matmul {n}^3      {matmuls[n][1] / med[n] / 1e9:9.1f} GFLOP/s")
  print(f"model FLOP/s          {model_gflops:9.1f} GFLOP/s  "
        f"({flops_per_step / 1e9:.2f} GFLOP per step)")
  print(f"  MFU vs best matmul: {model_gflops / matmul_gflops:.1%}")


if __name__ == "__main__":
  app.run(main)
