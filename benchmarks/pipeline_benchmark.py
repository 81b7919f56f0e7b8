r"""Pipeline-parallel islands: the bubble each schedule leaves, measured
against the ideal, and per-device memory against the stage count.

  python -m benchmarks.pipeline_benchmark                   # both sections
  python -m benchmarks.pipeline_benchmark --sections=bubble --stages=2,4

Sections (--sections), each printing a markdown table:

  bubble  For S stages, a schedule (gpipe; circular with R repeats) and M
          microbatches of a fixed size: the wall-clock of a training pass
          (forward and backward) of parallel/pipeline.run_stages over
          chunks of dense layers, T_pipe, against the same stages each
          running their own R M chunk applications back to back with no
          hand-off, T_busy (the useful work at the same parallelism).
          Every stage computes in every tick (an idle tick computes on
          zeros, as SPMD does), so the measured bubble is 1 - T_busy /
          T_pipe, beside the ideal (S - 1) / (R M + S - 1); what it adds
          beyond the ideal is the hand-offs' cost. Medians of interleaved
          repeats.
  memory  The inner step of one island of a model whose layers dominate
          (8 layers, d_model 256), for S = 1, 2, 4: bytes per device of
          the params and both optimizer states, read from the arrays'
          shardings, and the compiled step's argument and temporary bytes
          (XLA's memory analysis).

On a CPU the stages are forced host devices sharing the machine's cores,
so the ratios, not the absolute times, carry over; with fewer accelerators
than stages the section says which stage counts it skipped.
"""

import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax.algorithm import inner_step as inner_step_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.compiled import model_loss
from diloco_jax.config import schema as config_schema
from diloco_jax.config import state_spec
from diloco_jax.config import validation
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel.mesh import STAGE
from diloco_jax.parallel import pipeline
from diloco_jax.parallel import placement
from diloco_jax.parallel import stages as stages_lib

_SECTIONS = flags.DEFINE_list("sections", ["bubble", "memory"],
                              "Which tables to print.")
_STAGES = flags.DEFINE_list("stages", ["2", "4"], "bubble: stage counts.")
_MICROBATCHES = flags.DEFINE_list(
    "microbatches", ["1", "2", "4"],
    "bubble: microbatches as multiples of the stage count.")
_WIDTH = flags.DEFINE_integer("width", 512, "bubble: the layers' width.")
_ROWS = flags.DEFINE_integer("rows", 256, "bubble: rows per microbatch.")
_LAYERS = flags.DEFINE_integer("layers_per_stage", 4,
                               "bubble: dense layers per stage.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Interleaved timing repeats.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 8, "Host CPU devices to create (the stages on a CPU).")


def _time(fn, *args) -> float:
  """Seconds of one call of `fn` (compiled already), blocking."""
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start


def _bubble_programs(stages: int, repeats: int, microbatches: int):
  """(pipelined pass, busy pass, their arguments) for one setting."""
  mesh = mesh_lib.build_mesh(1, 1, stages, jax.devices()[:stages])
  width, rows = _WIDTH.value, _ROWS.value
  per_chunk = _LAYERS.value // repeats
  keys = jax.random.split(jax.random.key(0), 2)
  chunks = jax.random.normal(
      keys[0], (stages, repeats, per_chunk, width, width)) / width**0.5
  chunks = jax.device_put(chunks, NamedSharding(mesh, P(STAGE)))
  inputs = jax.random.normal(keys[1], (microbatches, rows, width))

  def stage_fn(chunk, h):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, chunk)
    return h

  def pipelined(chunks, inputs):
    return jnp.sum(pipeline.run_stages(stage_fn, chunks, inputs, stages,
                                       repeats, mesh) ** 2)

  def busy(chunks, inputs):
    """Each stage applies each of its chunks to every microbatch, with no
    hand-off: R M chunk applications, the pipeline's useful work."""
    def one_stage(stage_chunks):
      def apply(total, x):
        for r in range(repeats):
          x = stage_fn(stage_chunks[r], x)
        return total + jnp.sum(x ** 2), None
      return jax.lax.scan(apply, 0.0, inputs)[0]
    return jnp.sum(stages_lib.per_stage(one_stage, stages)(chunks))

  compile_pass = lambda f: jax.jit(jax.grad(f)).lower(chunks, inputs).compile()
  return compile_pass(pipelined), compile_pass(busy), (chunks, inputs)


def bubble_table() -> list[str]:
  lines = ["| stages S | schedule | repeats R | microbatches M | T_pipe (ms) "
           "| T_busy (ms) | measured bubble | ideal (S-1)/(RM+S-1) |",
           "|---|---|---|---|---|---|---|---|"]
  for stages in map(int, _STAGES.value):
    if stages > len(jax.devices()):
      lines.append(f"| {stages} | skipped: {len(jax.devices())} device(s) "
                   "| | | | | | |")
      continue
    for schedule, repeats in (("gpipe", 1), ("circular", 2)):
      if _LAYERS.value % repeats:
        continue
      for multiple in map(int, _MICROBATCHES.value):
        microbatches = multiple * stages
        pipe, busy, args = _bubble_programs(stages, repeats, microbatches)
        pipe_s, busy_s = [], []
        for _ in range(_REPEATS.value):  # interleaved: the same noise
          pipe_s.append(_time(pipe, *args))
          busy_s.append(_time(busy, *args))
        t_pipe, t_busy = statistics.median(pipe_s), statistics.median(busy_s)
        ideal = pipeline.bubble_fraction(stages, microbatches, repeats)
        lines.append(
            f"| {stages} | {schedule} | {repeats} | {microbatches} | "
            f"{t_pipe * 1e3:.1f} | {t_busy * 1e3:.1f} | "
            f"{1 - t_busy / t_pipe:.1%} | {ideal:.1%} |")
  return lines


def _memory_row(stages: int) -> tuple[int, int, int]:
  config = config_schema.base_config()
  config.model.update(num_layers=8, d_model=256, num_heads=4, head_dim=64,
                      mlp_dim=1024, vocab_size=257, max_sequence_length=128)
  config.diloco.islands = 1
  config.mesh.stage = stages
  config.data.update(corpus="synthetic", batch_size=16, sequence_length=128)
  run_config = validation.validate_config(config, len(jax.devices()))
  mesh = mesh_lib.build_mesh(1, 1, stages, jax.devices()[:stages])
  spec = state_spec.for_run(run_config)
  abstract = jax.eval_shape(spec.staged, spec.abstract(config.model))
  state = placement.with_shardings(
      abstract, state_lib.state_shardings(abstract, mesh))
  batch = jax.ShapeDtypeStruct((1, 16, 129), jnp.int32, sharding=(
      NamedSharding(mesh, state_lib.BATCH_SPEC)))
  step = inner_step_lib.make_inner_step(
      model_loss.loss_function(config, mesh), spec.inner_opt, mesh)
  memory = step.lower(state, batch).compile().memory_analysis()
  held = stages_lib.bytes_per_device(
      [state.global_params, state.outer.outer_opt_state, state.island_params,
       state.inner_opt_state])
  return held, memory.argument_size_in_bytes, memory.temp_size_in_bytes


def memory_table() -> list[str]:
  lines = ["| stages S | params + inner + outer state per device (MB) | "
           "vs S=1 | step arguments (MB) | step temporaries (MB) |",
           "|---|---|---|---|---|"]
  base = None
  for stages in (1, 2, 4):
    if stages > len(jax.devices()):
      lines.append(f"| {stages} | skipped: {len(jax.devices())} device(s) "
                   "| | | |")
      continue
    held, arguments, temporaries = _memory_row(stages)
    base = base or held
    lines.append(f"| {stages} | {held / 1e6:.2f} | {held / base:.2f} | "
                 f"{arguments / 1e6:.2f} | {temporaries / 1e6:.2f} |")
  return lines


def main(argv):
  del argv
  # Host CPU devices for the stages (on an accelerator, beside it).
  jax.config.update("jax_num_cpu_devices", _CPU_DEVICES.value)
  print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}")
  if "bubble" in _SECTIONS.value:
    print("\n".join(["", "Bubble: a training pass of run_stages"] +
                     bubble_table()))
  if "memory" in _SECTIONS.value:
    print("\n".join(["", "Memory: the inner step of one island"] +
                     memory_table()))


if __name__ == "__main__":
  app.run(main)
