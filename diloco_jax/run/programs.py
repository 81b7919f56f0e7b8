"""The compiled programs of a run, built from shapes alone.

Compiling needs only the shapes and shardings of the state and batches, not
their values, so a run starts compiling in a background thread at once and
initializes (or restores) its state meanwhile: start-up costs about
max(compile, init) instead of their sum. XLA compiles outside the GIL.
"""

import concurrent.futures
import time
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax.algorithm import evaluation as evaluation_lib
from diloco_jax.algorithm import inner_step as inner_step_lib

from diloco_jax.algorithm import outer_step as outer_step_lib

from diloco_jax.algorithm import overlap as overlap_lib

from diloco_jax.algorithm import state as state_lib
from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.run import background
from diloco_jax.run import integrity
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.algorithm import schedule as schedule_lib


class Programs(NamedTuple):
  """A run's compiled steps (None where the mode has no such step)."""
  inner_step: Any
  outer_step: Any
  flush: Any  # one_step_delay: applies the update in flight at the end
  sends: Any  # Streaming DiLoCo: per fragment, average it and step its x
  merges: Any  # Streaming DiLoCo: per fragment, fold its x into the islands
  evaluate: Any
  evaluate_island_mean: Any  # config.eval.island_mean: (state, batches)
  inspect_state: Any  # integrity.inspect_state, checked before each save
  compile_s: float


def batch_shapes(mesh, islands: int, batch_size: int, seq_len: int,
                 eval_batch_size: int):
  """Abstract (training batch, eval batch, island weights) on `mesh`."""
  shape = lambda dims, dtype, spec: jax.ShapeDtypeStruct(
      dims, dtype, sharding=NamedSharding(mesh, spec))
  return (shape((islands, batch_size, seq_len + 1), np.int32,
                state_lib.BATCH_SPEC),
          shape((eval_batch_size, seq_len + 1), np.int32,
                P((mesh_lib.ISLAND, mesh_lib.DATA))),
          shape((islands,), np.float32, P(mesh_lib.ISLAND)))


def compile_programs(config, mesh, loss_fn, inner_opt, outer_opt,
                     compression, state, batch, eval_batch,
                     weights, saved_state=None,
                     num_eval_batches: int = 1) -> Programs:
  """Compiles the inner step, outer step (diloco) and evaluations.

  `state`, `batch`, `eval_batch` and `weights` may be abstract
  (jax.ShapeDtypeStruct with shardings). `saved_state` is the state
  checkpoints hold when it differs from the one the steps take (with
  outer_placement='host' the outer fields live elsewhere, and the outer
  step is host_outer's, not compiled here).
  `num_eval_batches`: how many eval batches the islands' average
  (config.eval.island_mean) is scored on, all in one program.
  """
  saved_state = state if saved_state is None else saved_state
  on_device = config.diloco.get("outer_placement", "device") == "device"
  start = time.perf_counter()
  mode, fsdp = config.mode, config.mesh.fsdp
  inner_step = inner_step_lib.make_inner_step(
      loss_fn, inner_opt, mesh,
      sync_gradients_across_islands=(mode == "ddp"),
      microbatches=config.data.microbatches, fsdp=fsdp).lower(
          state, batch).compile()
  outer_step = evaluate_island_mean = flush = sends = merges = None
  rounding_seed = (config.seed if config.diloco.stochastic_rounding
                   else None)
  if mode == "diloco" and schedule_lib.is_streaming(config.diloco):
    num_fragments = config.diloco.fragments
    if on_device:
      sends = tuple(fragments_lib.make_fragment_send(
          outer_opt, mesh, num_fragments, p, compression, rounding_seed,
          fsdp).lower(state, weights).compile()
                    for p in range(num_fragments))
    # With 'host' the sends are HostOuter's, and a merge takes the
    # fragment's x from the outer devices.
    assignment = fragments_lib.leaf_fragments(state.global_params,
                                              num_fragments)

    def merge_args(p):
      if on_device:
        return (state,)
      return (state, fragments_lib.select(state.global_params, assignment, p))

    merges = tuple(fragments_lib.make_fragment_merge(
        mesh, num_fragments, p, config.diloco.fragment_alpha, fsdp,
        inner_opt).lower(*merge_args(p)).compile()
                   for p in range(num_fragments))
  elif mode == "diloco" and on_device:
    outer_step = outer_step_lib.make_outer_step(
        outer_opt, mesh, compression, rounding_seed=rounding_seed, fsdp=fsdp,
        inner_opt=inner_opt,
        restart_dropped=config.diloco.dropped_islands == "idle",
        overlap=config.diloco.overlap).lower(state, weights).compile()
    if overlap_lib.is_delayed(config.diloco.overlap):
      flush = outer_step_lib.make_flush(outer_opt, mesh, fsdp).lower(state).compile()
  if mode == "diloco" and config.eval.island_mean:
    evaluate_island_mean = evaluation_lib.make_evaluate_island_mean(loss_fn).lower(
        state, (eval_batch,) * num_eval_batches).compile()
  evaluate = evaluation_lib.make_evaluate(loss_fn, mode).lower(
      state, eval_batch).compile()
  return Programs(inner_step, outer_step, flush, sends, merges, evaluate,
                  evaluate_island_mean,
                  integrity.compile_inspector(saved_state),
                  time.perf_counter() - start)


def compile_in_background(*args, **kwargs) -> concurrent.futures.Future:
  """Starts compile_programs(*args, **kwargs) in a thread; .result() gives
  Programs."""
  return background.submit("compile", compile_programs, *args, **kwargs)
