"""train_and_evaluate: the loop that runs one configured training job.

Modes share this loop: every mode takes inner steps on all islands at once;
`diloco` adds an outer step at the end of each round of H steps; `ddp` averages
gradients across islands inside every inner step; `single` is one island on
its own. Everything is compiled before the clock starts, and per-step metrics
are fetched one step late so the host never waits on the device.
"""

import functools
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax import communication
from diloco_jax import diloco
from diloco_jax import flops
from diloco_jax import mesh as mesh_lib
from diloco_jax import metrics as metrics_lib
from diloco_jax import model as model_lib
from diloco_jax import optimizers
from diloco_jax import validation
from diloco_jax.data import corpus as corpus_lib
from diloco_jax.data import streams

BYTE_LEVEL_CORPORA = ("embedded", "text_files")
RUN_FILES = ("metrics.jsonl", "summary.json")


class WorkdirError(ValueError):
  """The workdir already holds another run's outputs."""


def check_workdir_is_fresh(workdir: str) -> None:
  """Refuses a workdir that holds another run's metrics, so none are lost."""
  for name in RUN_FILES:
    if os.path.exists(os.path.join(workdir, name)):
      raise WorkdirError(
          f"--workdir={workdir} already holds {name} from an earlier run; "
          "choose a new workdir or delete that one")


def _place(array: np.ndarray, sharding) -> jax.Array:
  # A callback rather than device_put: each process materializes only the
  # slices its own devices hold, so the same line works on many hosts.
  return jax.make_array_from_callback(array.shape, sharding,
                                      lambda index: array[index])


def _round_ends(step: int, inner_steps: int, total_steps: int) -> bool:
  return step % inner_steps == 0 or step == total_steps


def _eval_record(loss: float, byte_level: bool) -> dict:
  record = {"eval_loss": loss,
            "eval_perplexity": math.exp(min(loss, 80.0))}
  if byte_level:
    record["eval_bits_per_byte"] = loss / math.log(2)
  return record


def train_and_evaluate(config, workdir: str) -> dict:
  """Trains as `config` says, writing metrics and a summary to `workdir`.

  Returns:
    The summary dict also written to `workdir/summary.json`.
  """
  wall_start = time.perf_counter()
  validation.validate_config(config, num_devices=jax.device_count())
  check_workdir_is_fresh(workdir)

  mode = config.mode
  islands = validation.effective_islands(config)
  inner_steps = config.diloco.inner_steps
  total_steps = config.total_steps
  seq_len = config.data.sequence_length

  corpus = corpus_lib.build_corpus(config.data)
  batches = streams.IslandBatches(corpus.train, islands, config.data.batch_size,
                                  seed=config.data.seed)
  eval_set = streams.eval_batches(corpus.validation, config.eval.batch_size,
                                  config.eval.num_batches)

  mesh = mesh_lib.build_mesh(islands, config.mesh.data, config.mesh.stage)
  graphdef, params = model_lib.init_params(config.model, config.seed)
  loss_fn = functools.partial(model_lib.next_token_loss, graphdef)
  inner_opt = optimizers.inner_optimizer(config.inner_optimizer, total_steps)
  outer_opt = optimizers.outer_optimizer(config.diloco.outer_optimizer)

  abstract_state = jax.eval_shape(
      lambda p: diloco.init_state(p, inner_opt, outer_opt, islands), params)
  state = jax.jit(
      lambda p: diloco.init_state(p, inner_opt, outer_opt, islands),
      out_shardings=diloco.state_shardings(abstract_state, mesh))(params)
  del params

  batch_sharding = NamedSharding(mesh, diloco.BATCH_SPEC)
  eval_sharding = NamedSharding(mesh, P((mesh_lib.ISLAND, mesh_lib.DATA)))
  eval_arrays = [_place(b, eval_sharding) for b in eval_set]
  weights_sharding = NamedSharding(mesh, P(mesh_lib.ISLAND))

  # Compile everything up front so timings exclude compilation.
  compile_start = time.perf_counter()
  first_batch = _place(batches.batch(0), batch_sharding)
  inner_step = diloco.make_inner_step(
      loss_fn, inner_opt, mesh,
      sync_gradients_across_islands=(mode == "ddp")).lower(
          state, first_batch).compile()
  outer_step = None
  if mode == "diloco":
    outer_step = diloco.make_outer_step(outer_opt, mesh).lower(
        state, _place(np.zeros(islands, np.float32), weights_sharding)
    ).compile()
  evaluate = diloco.make_evaluate(loss_fn, mode).lower(
      state, eval_arrays[0]).compile()
  compile_s = time.perf_counter() - compile_start
  logging.info("compiled in %.1fs", compile_s)

  param_shapes = abstract_state.global_params
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(param_shapes))
  sync_bytes = communication.island_mean_bytes(param_shapes, islands)
  flops_per_token = flops.training_flops_per_token(config.model, seq_len)
  tokens_per_step = islands * config.data.batch_size * seq_len
  learning_rates = np.asarray(jax.vmap(
      optimizers.inner_learning_rate(config.inner_optimizer, total_steps))(
          jnp.arange(total_steps)))
  byte_level = config.data.corpus in BYTE_LEVEL_CORPORA
  logging.info("mode=%s islands=%d H=%d params=%s tokens/step=%d sync=%.2fMB",
               mode, islands, inner_steps, f"{num_params:,}", tokens_per_step,
               sync_bytes / 1e6)

  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
  writer = metrics_lib.MetricsWriter(workdir, total_steps,
                                     config.log_every_seconds)

  def comm_bytes_after(step: int, rounds_done: int) -> int:
    if mode == "diloco":
      return rounds_done * sync_bytes
    if mode == "ddp":
      return step * sync_bytes
    return 0

  def record_for(step, rounds_done, step_metrics) -> dict:
    step_metrics = jax.device_get(step_metrics)
    return {
        "step": step,
        "round": math.ceil(step / inner_steps),
        "train_loss": float(np.mean(step_metrics["loss"])),
        "grad_norm": float(np.mean(step_metrics["grad_norm"])),
        "learning_rate": float(learning_rates[step - 1]),
        "tokens_seen": step * tokens_per_step,
        "comm_bytes": comm_bytes_after(step, rounds_done),
        "ddp_comm_bytes": step * sync_bytes,
    }

  writer.start_clock()
  train_start = time.perf_counter()
  pending = None  # the previous step's metrics, fetched one step late
  rounds_done = 0
  steps_in_round = 0
  eval_loss = float("nan")
  next_batch = first_batch
  for step in range(1, total_steps + 1):
    state, step_metrics = inner_step(state, next_batch)
    steps_in_round += 1
    if step < total_steps:  # prepare the next batch while this step runs
      next_batch = _place(batches.batch(step), batch_sharding)
    if pending is not None:
      writer.write(record_for(*pending))
    pending = (step, rounds_done, step_metrics)
    if not _round_ends(step, inner_steps, total_steps):
      continue
    if outer_step is not None:
      # Islands are weighted by the tokens they processed this round.
      round_weights = _place(
          np.full(islands, steps_in_round * config.data.batch_size * seq_len,
                  np.float32), weights_sharding)
      state = outer_step(state, round_weights)
    rounds_done += 1
    steps_in_round = 0
    eval_loss = float(np.mean(jax.device_get(
        [evaluate(state, b) for b in eval_arrays])))
    record = record_for(step, rounds_done, step_metrics)
    record.update(_eval_record(eval_loss, byte_level))
    writer.write(record)
    pending = None
  if pending is not None:
    writer.write(record_for(*pending))
  jax.block_until_ready(state)
  train_s = time.perf_counter() - train_start
  writer.close()

  tokens_seen = total_steps * tokens_per_step
  summary = {
      "mode": mode,
      "islands": islands,
      "inner_steps": inner_steps,
      "total_steps": total_steps,
      "rounds": rounds_done,
      "corpus": config.data.corpus,
      "num_params": num_params,
      "tokens_seen": tokens_seen,
      "comm_bytes": comm_bytes_after(total_steps, rounds_done),
      "ddp_comm_bytes": total_steps * sync_bytes,
      "compile_s": compile_s,
      "train_s": train_s,
      "wall_s": time.perf_counter() - wall_start,
      "tokens_per_s": tokens_seen / train_s,
      "model_flops_per_token": flops_per_token,
      "model_flops_per_s": flops_per_token * tokens_seen / train_s,
  }
  summary.update({"final_" + k: v
                  for k, v in _eval_record(eval_loss, byte_level).items()})
  if corpus.entropy_rate is not None:
    summary["corpus_entropy_rate"] = corpus.entropy_rate
  if jax.process_index() == 0:
    metrics_lib.write_json_atomically(
        os.path.join(workdir, "summary.json"), summary)
  logging.info("done: final eval loss %.4f, %.0f tokens/s, %.1f MB sent",
               eval_loss, summary["tokens_per_s"], summary["comm_bytes"] / 1e6)
  return summary
