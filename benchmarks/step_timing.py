"""Timing helpers of the step benchmark (step_benchmark.py): interleaved
medians, the DiLoCo inner step of islands folded onto one device, a plain
optax step of the same model, and a matmul's FLOP/s in a dtype.

JAX and the project are imported inside the functions: step_benchmark.py
sets up its flags (and the platform) before anything initializes JAX.
"""

import functools
import statistics
import time


def format_flops(rate: float) -> str:
  """A FLOP/s figure in TFLOP/s, or GFLOP/s below one TFLOP/s."""
  return (f"{rate / 1e12:9.2f} TFLOP/s" if rate >= 1e12
          else f"{rate / 1e9:9.2f} GFLOP/s")


def time_block(run, steps: int) -> float:
  """Seconds per step of `run(steps)`, which must block at its end."""
  start = time.perf_counter()
  run(steps)
  return (time.perf_counter() - start) / steps


def interleaved(runs: dict, repeats: int, steps: int) -> dict:
  """Median seconds per step of each run, timed in turns."""
  for run in runs.values():  # compile and warm up
    run(2)
  samples = {name: [] for name in runs}
  for _ in range(repeats):
    for name, run in runs.items():
      samples[name].append(time_block(run, steps))
  return {name: statistics.median(times) for name, times in samples.items()}


class InnerSteps:
  """The DiLoCo inner step of `islands` islands folded onto one device."""

  def __init__(self, config, islands: int, batch_size: int,
               microbatches: int = 1, tokens=None):
    """`tokens`: [islands, batch_size, L+1] int32 (default: random ids)."""
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
    from diloco_jax.algorithm import inner_step as inner_step_lib
    from diloco_jax.algorithm import optimizers  # pylint: disable=g-import-not-at-top
    from diloco_jax.algorithm import outer_settings
    from diloco_jax.algorithm import outer_step as outer_step_lib
    from diloco_jax.algorithm import state as state_lib
    from diloco_jax.config import overlap_defaults
    from diloco_jax.config import run_config
    from diloco_jax.model import transformer as model_lib
    from diloco_jax.parallel import mesh as mesh_lib
    self.tokens_per_step = islands * batch_size * config.data.sequence_length
    mesh = mesh_lib.build_mesh(islands, devices=jax.devices()[:1])
    loss_fn = functools.partial(model_lib.next_token_loss,
                                model_lib.graphdef(config.model))
    inner_opt = optimizers.inner_optimizer(
        run_config.inner_optimizer(config.inner_optimizer),
        config.total_steps)
    outer_opt = optimizers.outer_optimizer(run_config.outer_optimizer(
        overlap_defaults.resolve(config).diloco.outer_optimizer))
    init = lambda seed: outer_settings.init_state(
        model_lib.new_params(config.model, seed), inner_opt, outer_opt,
        islands)
    shardings = state_lib.state_shardings(jax.eval_shape(init, 0), mesh)
    with model_lib.fast_init_compile():
      self.state = jax.jit(init, out_shardings=shardings)(config.seed)
    if tokens is None:
      tokens = np.random.default_rng(0).integers(
          0, config.model.vocab_size,
          (islands, batch_size, config.data.sequence_length + 1), np.int32)
    self.batch = jax.device_put(tokens,
                                NamedSharding(mesh, state_lib.BATCH_SPEC))
    self.step = inner_step_lib.make_inner_step(loss_fn, inner_opt, mesh,
                                               microbatches=microbatches)
    self.outer = outer_step_lib.make_outer_step(outer_opt, mesh)
    self.weights = jax.device_put(
        np.ones(islands, np.float32),
        NamedSharding(mesh, jax.sharding.PartitionSpec(mesh_lib.ISLAND)))

  def __call__(self, steps: int) -> None:
    import jax  # pylint: disable=g-import-not-at-top
    for _ in range(steps):
      self.state, metrics = self.step(self.state, self.batch)
    jax.block_until_ready(metrics["loss"])

  def outer_steps(self, steps: int) -> None:
    import jax  # pylint: disable=g-import-not-at-top
    for _ in range(steps):
      self.state = self.outer(self.state, self.weights)
    jax.block_until_ready(self.state.global_params)


def plain_steps(config):
  """A plain jitted optax train step of the same model and batch."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from diloco_jax.algorithm import optimizers  # pylint: disable=g-import-not-at-top
  from diloco_jax.config import run_config
  from diloco_jax.model import transformer as model_lib
  loss_fn = functools.partial(model_lib.next_token_loss,
                              model_lib.graphdef(config.model))
  opt = optimizers.inner_optimizer(
      run_config.inner_optimizer(config.inner_optimizer), config.total_steps)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  with model_lib.fast_init_compile():
    params = jax.jit(functools.partial(model_lib.new_params, config.model))(
        config.seed)
  holder = {"params": params, "opt": jax.jit(opt.init)(params)}
  batch = jax.device_put(np.random.default_rng(0).integers(
      0, config.model.vocab_size,
      (config.data.batch_size, config.data.sequence_length + 1), np.int32))

  def run(steps: int) -> None:
    for _ in range(steps):
      holder["params"], holder["opt"], loss = step(holder["params"],
                                                   holder["opt"], batch)
    loss.block_until_ready()

  return run


def matmul_flops_per_s(dtype_name: str, on_cpu: bool) -> float:
  """The best of two square matmuls in the compute dtype, in FLOP/s."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from diloco_jax.analysis import flops  # pylint: disable=g-import-not-at-top
  dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype_name]
  best = 0.0
  for n in ((1024, 2048) if on_cpu else (4096, 8192)):
    keys = jax.random.split(jax.random.key(n))
    a = jax.random.normal(keys[0], (n, n), dtype)
    b = jax.random.normal(keys[1], (n, n), dtype)
    matmul = jax.jit(jnp.matmul)

    def run(steps, a=a, b=b, matmul=matmul):
      for _ in range(steps):
        out = matmul(a, b)
      out.block_until_ready()

    seconds = interleaved({"mm": run}, 5, 3 if on_cpu else 20)["mm"]
    best = max(best, flops.matmul_flops(n, n, n) / seconds)
  return best
