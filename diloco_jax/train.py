"""train_and_evaluate: the loop that runs one configured training job.

Modes share this loop: every mode takes inner steps on all islands at once;
`diloco` adds an outer step at the end of each round of H steps; `ddp` averages
gradients across islands inside every inner step; `single` is one island on
its own. Everything is compiled before the clock starts, and per-step metrics
are fetched one step late so the host never waits on the device.

Runs are resumable: the state is checkpointed (see checkpointing.py) and
rerunning the same command in the same workdir continues from the newest
readable checkpoint, replaying exactly what an uninterrupted run would do.
"""

import functools
import json
import math
import os
import time

import jax
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax import checkpointing
from diloco_jax import compression as compression_lib
from diloco_jax import communication
from diloco_jax import diloco
from diloco_jax import flops
from diloco_jax import mesh as mesh_lib
from diloco_jax import metrics as metrics_lib
from diloco_jax import model as model_lib
from diloco_jax import optimizers
from diloco_jax import programs as programs_lib
from diloco_jax import validation
from diloco_jax.data import sources

RUN_FILES = ("metrics.jsonl", "summary.json")


class WorkdirError(ValueError):
  """The workdir holds another run's outputs that cannot be resumed."""


def _place(array: np.ndarray, sharding) -> jax.Array:
  # A callback rather than device_put: each process materializes only the
  # slices its own devices hold, so the same line works on many hosts.
  return jax.make_array_from_callback(array.shape, sharding,
                                      lambda index: array[index])


def _round_ends(step: int, inner_steps: int, total_steps: int) -> bool:
  return step % inner_steps == 0 or step == total_steps


def _checkpoint_due(step: int, round_ended: bool, rounds_done: int,
                    total_steps: int, checkpoint_config) -> bool:
  if step == total_steps:
    return True
  every_rounds = checkpoint_config.every_rounds
  every_steps = checkpoint_config.every_steps
  return ((round_ended and every_rounds and rounds_done % every_rounds == 0)
          or bool(every_steps and step % every_steps == 0))


def _eval_record(loss: float, byte_level: bool) -> dict:
  record = {"eval_loss": loss,
            "eval_perplexity": math.exp(min(loss, 80.0))}
  if byte_level:
    record["eval_bits_per_byte"] = loss / math.log(2)
  return record


def _ratio(numerator: float, denominator: float) -> float | None:
  """numerator / denominator, or None when nothing was sent (k = 1)."""
  return numerator / denominator if denominator else None


def _mean_rank(compression, rank_indices) -> float | None:
  """The low-rank codecs' mean rank over factored matrices this round."""
  if not rank_indices:
    return None
  return float(np.mean([compression.ranks[i] for i in rank_indices]))


def _mean_loss(evaluate, state, eval_arrays) -> float:
  return float(np.mean(jax.device_get([evaluate(state, b)
                                       for b in eval_arrays])))


def _with_shardings(abstract_tree, shardings):
  return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      abstract_tree, shardings)


def _restore(checkpointer, config, abstract_state, mesh, inner_opt,
             islands: int):
  """Restores the newest readable checkpoint, adapting the island count.

  Returns:
    (step, meta, state), or None when there is no checkpoint.

  Raises:
    checkpointing.IncompatibleCheckpointError: the checkpoint was written for
      a model of another shape (checked before any array is read).
  """
  current_shapes = checkpointing.param_shapes_record(
      abstract_state.global_params)
  current_layout = checkpointing.state_layout_record(abstract_state)
  target_shardings = diloco.state_shardings(abstract_state, mesh,
                                           config.mesh.fsdp)

  def restore(step, meta):
    where = f"checkpoint {checkpointer.directory}/{step}"
    mismatch = checkpointing.shape_mismatch(meta["param_shapes"],
                                            current_shapes)
    if mismatch:
      raise checkpointing.IncompatibleCheckpointError(
          f"{where} was written for another model: {mismatch} "
          "(config.model differs)")
    mismatch = checkpointing.layout_mismatch(meta["state_layout"],
                                             current_layout)
    if mismatch:
      raise checkpointing.IncompatibleCheckpointError(
          f"{where} has another state layout: {mismatch} (config.diloco."
          "outer_optimizer, config.inner_optimizer, config.diloco.codec "
          "settings or config.diloco.error_feedback differ)")
    saved_islands = meta["islands"]
    if saved_islands == islands:
      return checkpointer.restore_state(
          step, _with_shardings(abstract_state, target_shardings))
    # Read at the saved island count, replicated, then resize and reshard.
    saved_abstract = jax.eval_shape(
        lambda s: diloco.resize_islands(s, saved_islands, inner_opt),
        abstract_state)
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, P()),
                              saved_abstract)
    saved = checkpointer.restore_state(
        step, _with_shardings(saved_abstract, replicated))
    logging.warning(
        "resuming with %d islands from a checkpoint of %d: %s", islands,
        saved_islands,
        f"islands {islands}..{saved_islands - 1} are dropped with their "
        "progress since the last outer step" if islands < saved_islands else
        f"islands {saved_islands}..{islands - 1} start from the global params"
        " with fresh inner optimizer state")
    return jax.jit(lambda s: diloco.resize_islands(s, islands, inner_opt),
                   out_shardings=target_shardings)(saved)

  return checkpointer.latest_readable(restore)


def _placement_line(mesh, islands: int, config) -> str:
  slots = mesh.shape[mesh_lib.ISLAND]
  folded = mesh_lib.folded_islands(mesh, islands)
  line = (f"{islands} island(s) on {slots} device slot(s) of "
          f"{config.mesh.data} x {config.mesh.stage} {mesh.devices.flat[0].platform}"
          f" device(s)")
  if folded > 1:
    line += f", {folded} folded per slot"
  return line + (", FSDP over 'data'" if config.mesh.fsdp else "")


def _byte_counts(config, param_shapes, islands: int, compression):
  """(bytes of one ddp step, sync_bytes(rank_indices) -> bytes of a sync).

  Bytes one island sends: DDP all-reduces float32 gradients, DiLoCo sends
  pseudo-gradients through the codec (at this round's low-rank ranks, or
  None for codecs without ranks); with FSDP every device of an island
  sends its own shards' part.
  """
  stripes = config.mesh.data if config.mesh.fsdp else 1
  ddp_step_bytes = communication.island_mean_bytes(param_shapes, islands,
                                                   stripes=stripes)

  @functools.lru_cache(maxsize=None)  # few rank patterns recur
  def sync_bytes(rank_indices: tuple[int, ...] | None) -> int:
    if config.mode != "diloco":
      return ddp_step_bytes
    return compression_lib.mean_bytes(param_shapes, islands, compression,
                                      rank_indices, stripes)

  return ddp_step_bytes, sync_bytes


def _rank_indices(state) -> tuple[int, ...] | None:
  """This round's low-rank ranks, chosen last round (a small fetch)."""
  indices = compression_lib.rank_indices(state.codec_state)
  return None if indices is None else tuple(indices)


def _throughput(tokens: int, seconds: float, flops_per_token: float, mesh,
                dtype: str) -> dict:
  """tokens/s, model FLOP/s, and model FLOP utilization against the
  devices' own peak for the compute dtype (None where flops.py's table
  does not know the device, e.g. CPUs)."""
  tokens_per_s = tokens / max(seconds, 1e-9)
  peak = flops.peak_flops_per_s(mesh.devices.flat[0].device_kind, dtype)
  peak = peak and peak * mesh.devices.size
  return {"tokens_per_s": tokens_per_s,
          "model_flops_per_s": flops_per_token * tokens_per_s,
          "peak_flops_per_s": peak,
          "mfu": flops_per_token * tokens_per_s / peak if peak else None}


def _check_workdir(workdir: str) -> None:
  """Refuses a workdir holding run outputs that cannot be resumed."""
  if os.path.isdir(os.path.join(workdir, "checkpoints")):
    return
  for name in RUN_FILES:
    if os.path.exists(os.path.join(workdir, name)):
      raise WorkdirError(
          f"--workdir={workdir} holds {name} but no checkpoints to resume "
          "from; choose a new workdir or delete that one")


def _restore_data_positions(batches, meta: dict, islands: int) -> None:
  """Puts the data streams where the checkpoint left them, if they map."""
  if "data" not in meta:
    return
  if meta["islands"] == islands or "step" in meta["data"]:
    batches.restore(meta["data"])
  else:  # per-island read positions do not map onto another island count
    logging.warning("data streams restart for the new island count")


def train_and_evaluate(config, workdir: str, devices=None,
                       launch_time: float | None = None) -> dict:
  """Trains as `config` says, writing metrics, checkpoints and a summary.

  Rerunning with the same workdir resumes from the newest checkpoint; a run
  that already finished returns its summary.

  Args:
    config: a config built from config_schema.base_config().
    workdir: where outputs and checkpoints go.
    devices: the devices to place islands on (default: all). Islands fold
      onto them: d of the k islands' slots, d the largest divisor of k that
      fits, each slot holding k / d islands.
    launch_time: time.time() when the process started, for `startup_s`
      (default: when this function was called).

  Returns:
    The summary dict also written to `workdir/summary.json`.
  """
  wall_start = time.perf_counter()
  launch_time = time.time() if launch_time is None else launch_time
  devices = jax.devices() if devices is None else list(devices)
  validation.validate_config(config, num_devices=len(devices))

  mode = config.mode
  islands = validation.effective_islands(config)
  inner_steps = config.diloco.inner_steps
  total_steps = config.total_steps
  seq_len = config.data.sequence_length
  batch_size = config.data.batch_size

  _check_workdir(workdir)

  phase_start = time.perf_counter()
  batches = sources.make_batch_source(config.data, islands, batch_size,
                                      seed=config.data.seed)
  eval_set = sources.make_eval_batches(config.data, config.eval.batch_size,
                                       config.eval.num_batches)
  # The outer mean weights island i by the tokens it processed this round
  # times its cluster's share of the corpus (uniform for iid islands), so the
  # averaged update stands for the whole data distribution.
  island_shares = batches.island_token_weights() * islands
  logging.info("data ready in %.1fs", time.perf_counter() - phase_start)
  phase_start = time.perf_counter()

  mesh = mesh_lib.build_mesh(islands, config.mesh.data, config.mesh.stage,
                             devices)
  fsdp = config.mesh.fsdp
  loss_fn = functools.partial(model_lib.next_token_loss,
                              model_lib.graphdef(config.model))
  inner_opt = optimizers.inner_optimizer(config.inner_optimizer, total_steps)
  outer_opt = optimizers.outer_optimizer(config.diloco.outer_optimizer)
  compression = compression_lib.from_config(config.diloco)
  error_feedback = mode == "diloco" and config.diloco.error_feedback
  init = lambda p: diloco.init_state(
      p, inner_opt, outer_opt, islands, error_feedback,
      compression if mode == "diloco" else None, seed=config.seed)
  abstract_state = jax.eval_shape(init, model_lib.param_shapes(config.model))
  state_shardings = diloco.state_shardings(abstract_state, mesh, fsdp)

  checkpointer = checkpointing.Checkpointer(
      workdir, max_to_keep=config.checkpoint.max_to_keep,
      async_save=config.checkpoint.async_save)
  restored = _restore(checkpointer, config, abstract_state, mesh, inner_opt,
                      islands)
  if restored is not None:
    start_step, meta, state = restored
    if start_step > total_steps:
      raise validation.ConfigError(
          f"config.total_steps={total_steps} is before the checkpoint at step "
          f"{start_step} in {checkpointer.directory}")
    logging.info("resuming from the checkpoint at step %d", start_step)
  summary_path = os.path.join(workdir, "summary.json")
  if restored is not None and start_step == total_steps and os.path.exists(
      summary_path):
    logging.info("the run in %s already finished", workdir)
    checkpointer.close()
    with open(summary_path) as f:
      return json.load(f)

  # The steps compile from shapes in the background while the state is
  # initialized and the rest is set up.
  batch_shape, eval_shape, weights_shape = programs_lib.batch_shapes(
      mesh, islands, batch_size, seq_len, config.eval.batch_size)
  compiling = programs_lib.compile_in_background(
      config, mesh, loss_fn, inner_opt, outer_opt, compression,
      _with_shardings(abstract_state, state_shardings), batch_shape,
      eval_shape, weights_shape)
  if restored is None:
    start_step, meta = 0, {}
    # Params are created on their devices, already sharded.
    with model_lib.fast_init_compile():
      state = jax.jit(lambda seed: init(model_lib.new_params(config.model,
                                                            seed)),
                      out_shardings=state_shardings)(config.seed)
  jax.block_until_ready(state)
  logging.info("state %s in %.1fs", "restored" if start_step else "initialized",
               time.perf_counter() - phase_start)
  dropped = metrics_lib.truncate_metrics(workdir, start_step)
  if dropped:
    logging.info("dropped %d metrics records logged after step %d; they are "
                 "taken again", dropped, start_step)
  _restore_data_positions(batches, meta, islands)
  eval_arrays = [_place(b, eval_shape.sharding) for b in eval_set]
  next_batch = _place(batches.next_batch(), batch_shape.sharding)
  learning_rates = optimizers.learning_rate_table(config.inner_optimizer,
                                                  total_steps)
  if jax.process_index() == 0:
    metrics_lib.write_json_atomically(
        os.path.join(workdir, "config.json"),
        json.loads(config.to_json_best_effort()))
  writer = metrics_lib.MetricsWriter(workdir, total_steps,
                                     config.log_every_seconds)

  programs = compiling.result()
  inner_step, outer_step = programs.inner_step, programs.outer_step
  evaluate, evaluate_island_mean = (programs.evaluate,
                                    programs.evaluate_island_mean)
  compile_s = programs.compile_s
  logging.info("compiled in %.1fs, %.1fs after launch", compile_s,
               time.time() - launch_time)

  param_shapes = abstract_state.global_params
  num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(param_shapes))
  ddp_step_bytes, sync_bytes = _byte_counts(config, param_shapes, islands,
                                            compression)

  flops_per_token = flops.training_flops_per_token(config.model, seq_len)
  tokens_per_island_step = batch_size * seq_len
  byte_level = config.data.tokenizer == "byte"
  logging.info("mode=%s islands=%d H=%d params=%s tokens/step=%d sync=%.2fMB",
               mode, islands, inner_steps, f"{num_params:,}",
               islands * tokens_per_island_step,
               sync_bytes(_rank_indices(state)) / 1e6)
  logging.info("placement: %s; attention: %s", _placement_line(
      mesh, islands, config), model_lib.attention_implementation(config.model))

  # Counters carried across restarts (a restart may change the island count).
  rounds_done = meta.get("rounds_done", 0)
  tokens_seen = meta.get("tokens_seen", 0)
  comm_bytes = meta.get("comm_bytes", 0)
  ddp_comm_bytes = meta.get("ddp_comm_bytes", 0)
  # What the syncs so far would have sent uncompressed.
  fp32_comm_bytes = meta.get("fp32_comm_bytes", 0)
  island_round_steps = np.zeros(islands, np.int64)  # steps since last sync
  saved_round_steps = meta.get("island_round_steps", [])[:islands]
  island_round_steps[:len(saved_round_steps)] = saved_round_steps
  param_shapes_record = checkpointing.param_shapes_record(param_shapes)

  def save(step: int) -> None:
    writer.flush()  # metrics up to `step` reach the file before the state
    checkpointer.save(step, state, {
        "step": step, "rounds_done": rounds_done, "tokens_seen": tokens_seen,
        "comm_bytes": comm_bytes, "ddp_comm_bytes": ddp_comm_bytes,
        "fp32_comm_bytes": fp32_comm_bytes,
        "island_round_steps": island_round_steps.tolist(),
        "islands": islands, "data": data_state,
        "param_shapes": param_shapes_record,
        "state_layout": checkpointing.state_layout_record(abstract_state),
        "config": json.loads(config.to_json_best_effort()),
    })

  def finish_record(record: dict, step_metrics) -> dict:
    step_metrics = jax.device_get(step_metrics)
    record["train_loss"] = float(np.mean(step_metrics["loss"]))
    record["grad_norm"] = float(np.mean(step_metrics["grad_norm"]))
    return record

  island_mean_loss = rank = None
  writer.start_clock(tokens_seen)
  train_start = time.perf_counter()
  pending = None  # the previous step's record, finished one step late
  eval_loss = float("nan")
  startup_s = None
  for step in range(start_step + 1, total_steps + 1):
    state, step_metrics = inner_step(state, next_batch)
    if startup_s is None:  # launch to the first inner step's result
      jax.block_until_ready(step_metrics)
      startup_s = time.time() - launch_time
      logging.info("first inner step done %.1fs after launch (compile %.1fs)",
                   startup_s, compile_s)
    data_state = batches.state()  # the position after the batch just used
    island_round_steps += 1
    tokens_seen += islands * tokens_per_island_step
    ddp_comm_bytes += ddp_step_bytes
    if mode == "ddp":
      comm_bytes += ddp_step_bytes
      fp32_comm_bytes += ddp_step_bytes
    if step < total_steps:  # prepare the next batch while this step runs
      next_batch = _place(batches.next_batch(), batch_shape.sharding)
    if pending is not None:
      writer.write(finish_record(*pending))
    round_ended = _round_ends(step, inner_steps, total_steps)
    if round_ended:
      if evaluate_island_mean is not None:
        # Before the outer step resets them, the islands' plain average.
        island_mean_loss = _mean_loss(evaluate_island_mean, state, eval_arrays)
      if outer_step is not None:
        # Islands are weighted by the tokens they processed this round.
        weights = island_round_steps * tokens_per_island_step * island_shares
        rank_indices = _rank_indices(state)
        round_bytes = sync_bytes(rank_indices)
        rank = _mean_rank(compression, rank_indices)
        state = outer_step(state, _place(weights.astype(np.float32),
                                         weights_shape.sharding))
        comm_bytes += round_bytes
        fp32_comm_bytes += ddp_step_bytes
      rounds_done += 1
      island_round_steps[:] = 0
    record = {
        "step": step, "round": math.ceil(step / inner_steps),
        "learning_rate": float(learning_rates[step - 1]),
        "tokens_seen": tokens_seen, "comm_bytes": comm_bytes,
        "ddp_comm_bytes": ddp_comm_bytes,
        "compression_vs_ddp": _ratio(ddp_comm_bytes, comm_bytes),
    }
    pending = (record, step_metrics)
    if round_ended:
      eval_loss = _mean_loss(evaluate, state, eval_arrays)
      record.update(_eval_record(eval_loss, byte_level))
      if evaluate_island_mean is not None:
        record["eval_loss_island_mean"] = island_mean_loss
      if outer_step is not None and rank is not None:
        record["codec_mean_rank"] = rank
      writer.write(finish_record(*pending))
      pending = None
    if _checkpoint_due(step, round_ended, rounds_done, total_steps,
                       config.checkpoint):
      if pending is not None:
        writer.write(finish_record(*pending))
        pending = None
      save(step)
  if pending is not None:
    writer.write(finish_record(*pending))
  if math.isnan(eval_loss):  # resumed from the final checkpoint
    eval_loss = _mean_loss(evaluate, state, eval_arrays)
  jax.block_until_ready(state)
  train_s = time.perf_counter() - train_start
  checkpointer.close()
  writer.close()

  summary = {
      "mode": mode,
      "islands": islands,
      "inner_steps": inner_steps,
      "total_steps": total_steps,
      "rounds": rounds_done,
      "corpus": config.data.corpus,
      "num_params": num_params,
      "tokens_seen": tokens_seen,
      "comm_bytes": comm_bytes,
      "ddp_comm_bytes": ddp_comm_bytes,
      "codec": config.diloco.codec if mode == "diloco" else "fp32",
      # What the codec saved on the syncs, and what it saved against DDP.
      "compression_vs_fp32": _ratio(fp32_comm_bytes, comm_bytes),
      "compression_vs_ddp": _ratio(ddp_comm_bytes, comm_bytes),
      "compile_s": compile_s,
      "startup_s": startup_s,
      "train_s": train_s,
      "wall_s": time.perf_counter() - wall_start,
      "resumed_from_step": start_step,
      "model_flops_per_token": flops_per_token,
  }
  summary.update(_throughput(tokens_seen - meta.get("tokens_seen", 0),
                             train_s, flops_per_token, mesh,
                             config.model.dtype))
  summary.update({"final_" + k: v
                  for k, v in _eval_record(eval_loss, byte_level).items()})
  if evaluate_island_mean is not None and island_mean_loss is not None:
    summary["final_eval_loss_island_mean"] = island_mean_loss
  if batches.info.entropy_rate is not None:
    summary["corpus_entropy_rate"] = batches.info.entropy_rate
  if jax.process_index() == 0:
    metrics_lib.write_json_atomically(summary_path, summary)
  logging.info("done: final eval loss %.4f, %.0f tokens/s, %.1f MB sent",
               eval_loss, summary["tokens_per_s"], comm_bytes / 1e6)
  return summary
