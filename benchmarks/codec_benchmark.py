r"""Codec costs: encode+decode time and the outer step with each codec.

  python benchmarks/codec_benchmark.py [--islands=4] [--codecs=int8,topk]

1. Encode + decode of the 150M config's param pytree, per codec, on one
   device: `compression.island_mean` on a one-island mesh, so every codec
   does its whole local work (selection, power iteration, quantization,
   scatter) and its collectives move nothing.
2. The outer step of the 150M config's params with each codec, with
   `--islands` islands on forced CPU devices (the island link is in-process
   memory here, so this measures the codec's compute, not a network), and
   the bytes one island sends for it.
Final eval loss and bytes per codec on the default config come from
experiments/codec_sweep.py; see docs/compression.md.
"""

import gc
import importlib
import os
import statistics
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# pylint: disable=g-import-not-at-top,wrong-import-position
from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import optimizers
from diloco_jax.algorithm import outer_settings
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.config import overlap_defaults
from diloco_jax.config import run_config
from diloco_jax.model import transformer as model_lib
from diloco_jax.parallel import communication
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel import placement
from diloco_jax.parallel.placement import PER_ISLAND, REPLICATED
# pylint: enable=g-import-not-at-top,wrong-import-position

_ISLANDS = flags.DEFINE_integer("islands", 4, "Islands for the outer step.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repeats (median).")
_CODECS = flags.DEFINE_list("codecs", [], "Codecs to time (default: all).")
_SECTIONS = flags.DEFINE_list("sections", ["round_trip", "outer_step"],
                              "Which parts to run.")
_CONFIG = flags.DEFINE_string("config", "c4_150m",
                              "A module in configs/ whose model to use.")


def _median_seconds(fn, repeats: int) -> tuple[float, float]:
  """(seconds of the first call, which compiles; median of the rest)."""
  start = time.perf_counter()
  fn()
  first = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return first, statistics.median(times)


def _compression(config, name: str):
  config.diloco.codec = name
  return run_config.compression(config.diloco)


def _round_trips(config, names, tree, n: int) -> None:
  """Encode + decode of the whole pytree through each codec, one device."""
  print("\nencode + decode of the whole pytree, one device:")
  one = mesh_lib.build_mesh(1)
  for name in names:
    compression = _compression(config, name)
    codec_state = compression_lib.init_codec_state(tree, compression)
    # One island: the tree gets its island axis inside the program.
    mean = placement.island_map(
        lambda t, s, c=compression: compression_lib.island_mean(
            t, jnp.float32(1.0), c, s)[0],
        one, in_specs=(PER_ISLAND, REPLICATED), out_specs=REPLICATED,
        check_vma=False)
    round_trip = jax.jit(lambda t, s, mean=mean: mean(
        jax.tree.map(lambda x: x[None], t), s))
    first, seconds = _median_seconds(
        lambda f=round_trip, s=codec_state, t=tree: jax.block_until_ready(
            f(t, s)),
        _REPEATS.value)
    print(f"  {name:17s} {seconds * 1e3:9.1f} ms  "
          f"{4 * n / seconds / 1e9:6.2f} GB/s of float32  "
          f"(first call {first:.1f} s)", flush=True)


def _outer_steps(config, names, params, shapes) -> None:
  """The outer step through each codec, islands on CPU devices."""
  islands = _ISLANDS.value
  print(f"\nouter step, {islands} islands on {islands} CPU devices:")
  mesh = mesh_lib.build_mesh(islands)
  outer_opt = optimizers.outer_optimizer(run_config.outer_optimizer(
      overlap_defaults.resolve(config).diloco.outer_optimizer))
  weights = jax.device_put(jnp.ones(islands), NamedSharding(mesh, P("island")))
  fp32_bytes = communication.island_mean_bytes(shapes, islands)
  baseline = None
  for name in names:
    compression = _compression(config, name)
    # A stateless inner optimizer keeps memory to the params the step reads.
    # A copy: the step donates its state, which would free `params`.
    state = outer_settings.init_state(jax.tree.map(jnp.copy, params),
                                      optax.sgd(1.0), outer_opt, islands,
                                      compression=compression)
    state = jax.device_put(state, state_lib.state_shardings(state, mesh))
    step = outer_step_lib.make_outer_step(outer_opt, mesh, compression)
    holder = {"state": state}
    del state

    def run(step=step, holder=holder):
      holder["state"] = step(holder["state"], weights)
      jax.block_until_ready(holder["state"].global_params)

    first, seconds = _median_seconds(run, _REPEATS.value)
    baseline = baseline or seconds
    sent = compression_lib.mean_bytes(
        shapes, islands, compression,
        compression_lib.rank_indices(holder["state"].outer.codec_state))
    # Free this codec's state and programs before the next one's: two
    # 150M states with their temporaries do not fit in 24 GB.
    holder.clear()
    del step, run
    gc.collect()
    jax.clear_caches()
    print(f"  {name:17s} {seconds * 1e3:9.1f} ms ({seconds / baseline:5.2f}x "
          f"the first)  sends {sent / 1e6:8.2f} MB per island "
          f"({fp32_bytes / sent:6.2f}x less than fp32)  "
          f"(first call {first:.1f} s)", flush=True)


def main(argv):
  del argv
  jax.config.update("jax_num_cpu_devices", _ISLANDS.value)
  config = importlib.import_module(f"configs.{_CONFIG.value}").get_config()
  names = _CODECS.value or list(compression_lib.CODECS)
  shapes = model_lib.param_shapes(config.model)
  n = model_lib.count_params(shapes)
  _, params = model_lib.init_params(config.model, 0)
  print(f"{_CONFIG.value} config: {n:,} params; jax {jax.__version__}, "
        f"{jax.devices()[0].device_kind}")
  if "round_trip" in _SECTIONS.value:
    tree = jax.tree.map(
        lambda x: jax.random.normal(jax.random.key(0), x.shape, x.dtype)
        * 1e-3, params)
    _round_trips(config, names, tree, n)
    del tree
  if "outer_step" in _SECTIONS.value:
    _outer_steps(config, names, params, shapes)


if __name__ == "__main__":
  app.run(main)
