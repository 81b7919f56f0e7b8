r"""Structured codecs on FSDP islands: what each device holds and moves.

  python benchmarks/fsdp_codecs.py [--data=4] [--islands=2] \
      [--codecs=int8,topk,sparseloco,lowrank,adaptive_lowrank]

Compiles the outer step (with error feedback) of a small transformer (2
layers, d_model 128, MLP 512, vocab 256: every matrix split by FSDP) on
forced CPU devices, for islands replicated over --data devices and for
FSDP islands over them, and prints per codec: the step's temporaries per
device (XLA's memory analysis), the largest float32 collective in the
program (a gathered matrix would be as large as the matrix), the time of
the compiled step (median of 5), and the bytes one island sends
(compression.mean_bytes). Replicated islands code whole matrices; FSDP
islands code each device's pieces (top-k, SparseLoCo) or factor the whole
matrix from its pieces (low rank); see docs/islands.md.
"""

import os
import re
import statistics
import sys
import time

from absl import app
from absl import flags

_DATA = flags.DEFINE_integer("data", 4, "Devices per island.")
_ISLANDS = flags.DEFINE_integer("islands", 2, "Islands.")
_CODECS = flags.DEFINE_list(
    "codecs", ["int8", "topk", "sparseloco", "lowrank", "adaptive_lowrank"],
    "Codecs to compile.")


def _compression(name):
  from diloco_jax.algorithm import compression  # pylint: disable=g-import-not-at-top
  from diloco_jax.codecs import dense  # pylint: disable=g-import-not-at-top
  fp32 = dense.DenseCodec("fp32")
  return {
      "int8": compression.as_compression(dense.DenseCodec("int8", 256)),
      "topk": compression.Compression("topk", fp32, topk_fraction=0.05),
      "sparseloco": compression.Compression(
          "sparseloco", fp32, chunk_size=4096, density=0.02, value_bits=2,
          feedback_decay=0.95),
      "lowrank": compression.Compression("lowrank", fp32, ranks=(4,)),
      "adaptive_lowrank": compression.Compression(
          "adaptive_lowrank", dense.DenseCodec("int4", 256),
          ranks=(2, 4, 8), factor_codec=dense.DenseCodec("int8", 64)),
  }[name]


def _largest_f32_collective(hlo: str) -> int:
  pattern = re.compile(r"=\s*(.*?)\s+(?:all-to-all|all-gather|all-reduce|"
                       r"collective-permute|reduce-scatter)(?:-start)?\(")
  largest = 0
  for line in hlo.splitlines():
    match = pattern.search(line)
    if match:
      for dims in re.findall(r"f32\[([\d,]*)\]", match.group(1)):
        size = 4
        for d in filter(None, dims.split(",")):
          size *= int(d)
        largest = max(largest, size)
  return largest


def main(argv):
  del argv
  data, islands = _DATA.value, _ISLANDS.value
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count="
                             f"{data * islands}")
  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  from diloco_jax.algorithm import compression as compression_lib
  from diloco_jax.algorithm import outer_settings
  from diloco_jax.algorithm import outer_step as outer_step_lib
  from diloco_jax.algorithm import state as state_lib
  from diloco_jax.config import schema
  from diloco_jax.model import transformer as model_lib
  from diloco_jax.parallel import mesh as mesh_lib
  # pylint: enable=g-import-not-at-top
  model = schema.base_config().model
  model.update(num_layers=2, d_model=128, num_heads=4, head_dim=32,
               mlp_dim=512, vocab_size=256, max_sequence_length=32)
  params = model_lib.init_params(model, 0)[1]
  model_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
  mesh = mesh_lib.build_mesh(islands, data,
                             devices=jax.devices()[:islands * data])
  print(f"{islands} islands x {data} devices, model {model_bytes / 2**10:.0f} "
        f"KiB (float32), jax {jax.__version__} on {jax.devices()[0].platform}")
  print(f"{'codec':18s} {'layout':11s} {'temp/device':>12s} "
        f"{'largest f32 coll.':>18s} {'step':>9s} {'bytes/island':>13s}")
  for name in _CODECS.value:
    compression = _compression(name)
    for fsdp in (False, True):
      state = outer_settings.init_state(params, optax.adam(1e-3),
                                        optax.sgd(1.0), islands, error_feedback=True,
                                        compression=compression)
      state = jax.device_put(state,
                             state_lib.state_shardings(state, mesh, fsdp))
      weights = jax.device_put(jnp.ones(islands),
                               NamedSharding(mesh, P(mesh_lib.ISLAND)))
      compiled = outer_step_lib.make_outer_step(
          optax.sgd(1.0), mesh, compression, fsdp=fsdp).lower(
              state, weights).compile()
      times = []
      for _ in range(5):
        copy = jax.tree.map(jnp.copy, state)  # the step donates its state
        jax.block_until_ready(copy)
        start = time.perf_counter()
        jax.block_until_ready(compiled(copy, weights))
        times.append(time.perf_counter() - start)
      sent = compression_lib.mean_bytes(params, islands, compression,
                                        stripes=data if fsdp else 1)
      print(f"{name:18s} {'FSDP' if fsdp else 'replicated':11s} "
            f"{compiled.memory_analysis().temp_size_in_bytes / 2**20:9.2f} "
            f"MiB {_largest_f32_collective(compiled.as_text()) / 2**10:14.1f}"
            f" KiB {1000 * statistics.median(times):6.1f} ms {sent:13,d}")


if __name__ == "__main__":
  app.run(main)
