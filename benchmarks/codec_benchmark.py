r"""Codec costs: encode+decode throughput and the outer step with each codec.

  python benchmarks/codec_benchmark.py [--islands=4]

1. Encode + decode (one jitted round trip) of a flat float32 vector the size
   of the 150M config's params, per codec, on this process's first device.
2. The outer step of the 150M config's params with each codec, with
   `--islands` islands on forced CPU devices (the island link is in-process
   memory here, so this measures the codec's compute, not a network).
Final eval loss and bytes per codec come from training runs; see README.
"""

import os
import statistics
import sys
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_ISLANDS = flags.DEFINE_integer("islands", 4, "Islands for the outer step.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repeats (median).")


def _median_seconds(fn, repeats: int) -> float:
  fn()  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_num_cpu_devices", _ISLANDS.value)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from configs import c4_150m  # pylint: disable=g-import-not-at-top
  from diloco_jax import codecs, communication, diloco, mesh as mesh_lib  # pylint: disable=g-import-not-at-top
  from diloco_jax import model as model_lib, optimizers  # pylint: disable=g-import-not-at-top

  config = c4_150m.get_config()
  shapes = model_lib.param_shapes(config.model)
  n = model_lib.count_params(shapes)
  x = jax.random.normal(jax.random.key(0), (n - n % 256,), jnp.float32) * 1e-3
  print(f"150M config: {n:,} params; jax {jax.__version__}, "
        f"{jax.devices()[0].device_kind}")
  print("\nencode + decode of the whole vector, one device:")
  for name in codecs.CODECS:
    codec = codecs.make_codec(name)
    round_trip = jax.jit(lambda v, c=codec: c.decode(c.encode(v)))
    seconds = _median_seconds(lambda: round_trip(x).block_until_ready(),
                              _REPEATS.value)
    print(f"  {name:5s} {seconds * 1e3:8.1f} ms  "
          f"{x.nbytes / seconds / 1e9:6.2f} GB/s of float32")

  islands = _ISLANDS.value
  mesh = mesh_lib.build_mesh(islands)
  _, params = model_lib.init_params(config.model, 0)
  outer_opt = optimizers.outer_optimizer(config.diloco.outer_optimizer)
  # A stateless inner optimizer keeps memory to the params the step reads.
  state = diloco.init_state(params, optax.sgd(1.0), outer_opt, islands)
  state = jax.device_put(state, diloco.state_shardings(state, mesh))
  weights = jax.device_put(jnp.ones(islands), NamedSharding(mesh, P("island")))
  fp32_bytes = communication.island_mean_bytes(shapes, islands)
  print(f"\nouter step, {islands} islands on {islands} CPU devices:")
  baseline = None
  for name in codecs.CODECS:
    codec = codecs.make_codec(name)
    step = diloco.make_outer_step(outer_opt, mesh, codec)
    holder = {"state": state}

    def run(step=step, holder=holder):
      holder["state"] = step(holder["state"], weights)
      jax.block_until_ready(holder["state"].global_params)

    seconds = _median_seconds(run, _REPEATS.value)
    state = holder["state"]
    baseline = baseline or seconds
    sent = communication.island_mean_bytes(shapes, islands, codec)
    print(f"  {name:5s} {seconds * 1e3:8.1f} ms ({seconds / baseline:4.2f}x "
          f"fp32)  sends {sent / 1e6:8.1f} MB per island "
          f"({fp32_bytes / sent:4.2f}x less than fp32)")


if __name__ == "__main__":
  app.run(main)
