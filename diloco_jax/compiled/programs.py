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
from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.algorithm import guards
from diloco_jax.algorithm import inner_step as inner_step_lib
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.compiled import background
from diloco_jax.compiled import stage_sends
from diloco_jax.config import run_config as run_config_lib
from diloco_jax.config import state_spec as state_spec_lib
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.storage import integrity


class Programs(NamedTuple):
  """A run's compiled steps (None where the mode has no such step)."""
  inner_step: Any
  outer_step: Any
  flush: Any  # one_step_delay: applies the update in flight at the end
  sends: Any  # Streaming DiLoCo: per fragment, average it and step its x
  merges: Any  # Streaming DiLoCo: per fragment, fold its x into the islands
  evaluate: Any
  evaluate_island_mean: Any  # config.eval.island_mean: (state, batches)
  consensus: Any  # eager updates: the islands' average point, to evaluate
  inspect_state: Any  # integrity.inspect_state, checked before each save
  check_islands: Any  # guards.islands_finite, at each sync
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


def compile_programs(run_config: run_config_lib.RunConfig, mesh, loss_fn,
                     spec: state_spec_lib.StateSpec, state, batch,
                     eval_batch, weights, saved_state=None,
                     num_eval_batches: int = 1) -> Programs:
  """Compiles the inner step, DiLoCo's syncs and the evaluations.

  `state`, `batch`, `eval_batch` and `weights` may be abstract
  (jax.ShapeDtypeStruct with shardings). `saved_state` is the state
  checkpoints hold when it differs from the one the steps take (with
  outer_placement='host' the outer fields live elsewhere, and the outer
  step is host_outer's, not compiled here).
  `num_eval_batches`: how many eval batches the islands' average
  (config.eval.island_mean) is scored on, all in one program.
  """
  config = run_config.config
  saved_state = state if saved_state is None else saved_state
  start = time.perf_counter()
  inner_step = inner_step_lib.make_inner_step(
      loss_fn, spec.inner_opt, mesh,
      sync_gradients_across_islands=(config.mode == "ddp"),
      microbatches=config.data.microbatches, fsdp=config.mesh.fsdp).lower(
          state, batch).compile()
  syncs = {}
  if config.mode == "diloco" and run_config.streaming:
    syncs = _fragment_programs(run_config, mesh, spec, state, weights)
  elif config.mode == "diloco" and not run_config.host_outer:
    syncs = _outer_programs(run_config, mesh, spec, state, weights)
  evaluate_island_mean = None
  if config.mode == "diloco" and config.eval.island_mean:
    evaluate_island_mean = evaluation_lib.make_evaluate_island_mean(
        loss_fn).lower(state, (eval_batch,) * num_eval_batches).compile()
  evaluate = evaluation_lib.make_evaluate(loss_fn, config.mode).lower(
      state, eval_batch).compile()
  consensus = None
  if isinstance(run_config.diloco.overlap, outer_overlaps.Eager):
    consensus = evaluation_lib.make_consensus(jax.tree.map(
        lambda a: a.sharding, state.global_params)).lower(state).compile()
  return Programs(
      inner_step=inner_step, outer_step=syncs.get("outer_step"),
      flush=syncs.get("flush"), sends=syncs.get("sends"),
      merges=syncs.get("merges"), evaluate=evaluate,
      evaluate_island_mean=evaluate_island_mean, consensus=consensus,
      inspect_state=integrity.compile_inspector(saved_state),
      check_islands=jax.jit(guards.islands_finite).lower(state).compile(),
      compile_s=time.perf_counter() - start)


def _outer_programs(run_config: run_config_lib.RunConfig, mesh,
                    spec: state_spec_lib.StateSpec, state, weights) -> dict:
  """DiLoCo's outer step on the compute devices, the run's outer object
  applied after the islands' collective (and the end of a delayed
  overlap's run: its `finish`)."""
  settings, fsdp = run_config.diloco, run_config.config.mesh.fsdp
  programs = {"outer_step": outer_step_lib.make_outer_program(
      spec.outer, mesh, rounding_seed=settings.rounding_seed, fsdp=fsdp,
      inner_opt=spec.inner_opt, restart_dropped=settings.restart_dropped,
      reset_inner=settings.reset_inner).lower(state, weights).compile()}
  if isinstance(settings.overlap, (outer_overlaps.OneStepDelay,
                                   outer_overlaps.Eager)):
    programs["flush"] = outer_step_lib.make_flush(
        spec.outer_opt, mesh, fsdp).lower(state).compile()
  return programs


def _fragment_programs(run_config: run_config_lib.RunConfig, mesh,
                       spec: state_spec_lib.StateSpec, state,
                       weights) -> dict:
  """Streaming DiLoCo's per-fragment sends (on the compute devices; with
  'host' they are host_outer's) and merges (with 'host' a merge takes the
  fragment's x from the outer devices)."""
  settings, fsdp = run_config.diloco, run_config.config.mesh.fsdp
  num_fragments = settings.fragments
  on_device = not run_config.host_outer
  if mesh.shape[mesh_lib.STAGE] > 1:  # fragment s is stage s
    programs = {"merges": stage_sends.compile_merges(
        mesh, state, alpha=settings.fragment_alpha,
        inner_opt=spec.inner_opt)}
    if on_device:
      programs["sends"] = stage_sends.compile_sends(
          mesh, state, weights, outer=spec.outer,
          rounding_seed=settings.rounding_seed,
          stripes=mesh.shape[mesh_lib.DATA] if fsdp else 1)
    return programs
  programs = {}
  if on_device:
    programs["sends"] = tuple(fragments_lib.make_fragment_send(
        spec.outer, mesh, p, settings.rounding_seed, fsdp).lower(
            state, weights).compile() for p in range(num_fragments))
  assignment = fragments_lib.leaf_fragments(state.global_params,
                                            num_fragments)

  def merge_args(p):
    if on_device:
      return (state,)
    return (state, fragments_lib.select(state.global_params, assignment, p))

  programs["merges"] = tuple(fragments_lib.make_fragment_merge(
      mesh, num_fragments, p, settings.fragment_alpha, fsdp,
      spec.inner_opt).lower(*merge_args(p)).compile()
                             for p in range(num_fragments))
  return programs


def compile_in_background(*args, **kwargs) -> concurrent.futures.Future:
  """Starts compile_programs(*args, **kwargs) in a thread; .result() gives
  Programs."""
  return background.submit("compile", compile_programs, *args, **kwargs)
