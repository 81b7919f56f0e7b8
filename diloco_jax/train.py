"""train_and_evaluate: the loop that runs one configured training job.

Modes share this loop: every mode takes inner steps on all islands at once;
`diloco` adds an outer step at the end of each round of H steps; `ddp` averages
gradients across islands inside every inner step; `single` is one island on
its own. Everything is compiled before the clock starts, and per-step metrics
are fetched one step late so the host never waits on the device.

Runs are resumable: the state is checkpointed (see checkpointing.py) and
rerunning the same command in the same workdir continues from the newest
readable checkpoint, replaying exactly what an uninterrupted run would do.

Runs never lose work or report what did not happen: one run holds a workdir
at a time (workdir.py); a NaN or inf stops the run or rolls it back
(guards.py) and is never saved; SIGTERM and Ctrl-C save before exiting
(stops.py); any error waits for the checkpoint in flight; resuming under a
config that changes the run's meaning is refused (config_changes.py).
"""

import functools
import json
import math
import os
import time

import jax
import numpy as np
from absl import logging

from diloco_jax import accounting
from diloco_jax import checkpointing
from diloco_jax import compression as compression_lib
from diloco_jax import config_changes
from diloco_jax import diloco
from diloco_jax import flops
from diloco_jax import guards
from diloco_jax import mesh as mesh_lib
from diloco_jax import metrics as metrics_lib
from diloco_jax import model as model_lib
from diloco_jax import multihost
from diloco_jax import network_model
from diloco_jax import optimizers
from diloco_jax import outer_placement
from diloco_jax import participation
from diloco_jax import placement
from diloco_jax import programs as programs_lib
from diloco_jax import resume
from diloco_jax import schedule as schedule_lib
from diloco_jax import state_spec as state_spec_lib
from diloco_jax import stops
from diloco_jax import validation
from diloco_jax import warm_start
from diloco_jax import workdir as workdir_lib
from diloco_jax.data import sources

def _place(array: np.ndarray, sharding) -> jax.Array:
  # A callback rather than device_put: each process materializes only the
  # slices its own devices hold, so the same line works on many hosts.
  return jax.make_array_from_callback(array.shape, sharding,
                                      lambda index: array[index])


def _round_ends(step: int, inner_steps: int, total_steps: int) -> bool:
  return step % inner_steps == 0 or step == total_steps


def _eval_due(step: int, inner_steps: int, total_steps: int,
              every_rounds: int) -> bool:
  """Whether the end of `step`'s round is evaluated (config.eval)."""
  if step == total_steps:
    return True
  return bool(every_rounds and step % inner_steps == 0
              and (step // inner_steps) % every_rounds == 0)


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


def _placement_line(mesh, islands: int, config) -> str:
  slots = mesh.shape[mesh_lib.ISLAND]
  folded = mesh_lib.folded_islands(mesh, islands)
  line = (f"{islands} island(s) on {slots} device slot(s) of "
          f"{config.mesh.data} x {config.mesh.stage} {mesh.devices.flat[0].platform}"
          f" device(s)")
  if folded > 1:
    line += f", {folded} folded per slot"
  return line + (", FSDP over 'data'" if config.mesh.fsdp else "")


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


def _summary(config, progress: accounting.Progress, *, num_params: int,
             start_step: int, start_tokens: int, timings: dict,
             flops_per_token: float, mesh, eval_loss: float,
             island_mean_loss: float | None,
             entropy_rate: float | None) -> dict:
  """The run's summary.json: what was trained, sent, measured and changed.

  Throughput counts only the tokens of this process's steps (from
  start_tokens), over timings['train_s'].
  """
  mode = config.mode
  summary = {
      "mode": mode,
      "islands": progress.islands,
      "inner_steps": config.diloco.inner_steps,
      "total_steps": config.total_steps,
      "rounds": progress.rounds_done,
      "corpus": config.data.corpus,
      "num_params": num_params,
      "tokens_seen": progress.tokens_seen,
      "comm_bytes": progress.comm_bytes,
      "ddp_comm_bytes": progress.ddp_comm_bytes,
      "codec": config.diloco.codec if mode == "diloco" else "fp32",
      "overlap": config.diloco.overlap,
      "outer_placement": config.diloco.outer_placement,
      "fragments": (config.diloco.fragments
                    if schedule_lib.is_streaming(config.diloco) else None),
      # What the codec saved on the syncs, and what it saved against DDP.
      "compression_vs_fp32": _ratio(progress.fp32_comm_bytes,
                                    progress.comm_bytes),
      "compression_vs_ddp": _ratio(progress.ddp_comm_bytes,
                                   progress.comm_bytes),
      **timings,
      "resumed_from_step": start_step,
      "model_flops_per_token": flops_per_token,
      # Fields changed on resume (resume.allow_changes) and NaN rollbacks.
      "config_changes": progress.config_changes,
      "rollbacks": progress.rollbacks,
      # The model the run started from (init_from, pretrain_steps) or None.
      "pretrain_steps": config.pretrain_steps,
      "initialized_from": progress.initialized_from,
  }
  summary.update(_throughput(progress.tokens_seen - start_tokens,
                             timings["train_s"], flops_per_token, mesh,
                             config.model.dtype))
  byte_level = config.data.tokenizer == "byte"
  summary.update({"final_" + k: v
                  for k, v in _eval_record(eval_loss, byte_level).items()})
  if island_mean_loss is not None:
    summary["final_eval_loss_island_mean"] = island_mean_loss
  if entropy_rate is not None:
    summary["corpus_entropy_rate"] = entropy_rate
  return summary


def _run_sync_actions(actions, state, programs, weights, host_outer=None):
  """Runs the schedule's synchronization programs after a step, in order:
  the compiled ones, or with outer_placement='host' `host_outer`'s (a
  merge then takes the fragment's x from it)."""
  outer = programs if host_outer is None else host_outer
  for action in actions:
    if action.kind == schedule_lib.OUTER:
      state = outer.outer_step(state, weights)
    elif action.kind == schedule_lib.FLUSH:
      state = outer.flush(state)  # the last update in flight
    elif action.kind == schedule_lib.SEND:
      state = outer.sends[action.fragment](state, weights)
    elif action.kind == schedule_lib.MERGE:
      merge = programs.merges[action.fragment]
      state = (merge(state) if host_outer is None
               else merge(state, host_outer.fragment_x(action.fragment)))
    else:
      raise ValueError(f"unknown schedule action {action}")
  return state


def _participants(config, islands: int):
  """participants(step) -> [islands] bool: the islands synced at the end of
  step's round. Schedules run over the rounds after the pretraining."""
  inner_steps = config.diloco.inner_steps
  first_round = -(-config.pretrain_steps // inner_steps)
  num_rounds = -(-config.total_steps // inner_steps) - first_round
  def participants(step: int) -> np.ndarray:
    if config.mode != "diloco":
      return np.ones(islands, bool)
    return participation.round_mask(
        islands, math.ceil(step / inner_steps) - 1 - first_round, num_rounds,
        config.diloco.island_schedule, config.diloco.drop_probability,
        config.seed)
  return participants


def train_and_evaluate(config, workdir: str, devices=None,
                       launch_time: float | None = None) -> dict:
  """Trains as `config` says, writing metrics, checkpoints and a summary.

  Rerunning with the same workdir resumes from the newest checkpoint; a run
  that already finished returns its summary. The workdir is locked for the
  call's duration; SIGTERM and SIGINT (in the main thread) end the run at
  the next step with a checkpoint and StopRequested.

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

  Raises:
    validation.ConfigError, workdir.WorkdirError, data.DataError,
    checkpointing.IncompatibleCheckpointError (resume.ConfigChangedError):
      before anything is compiled or written, where they can be known
      then.
    guards.NonFiniteError: NaN or inf under config.nonfinite='stop' (or
      after config.max_rollbacks rollbacks).
    stops.StopRequested: a signal stopped the run after saving.
  """
  launch_time = time.time() if launch_time is None else launch_time
  devices = jax.devices() if devices is None else list(devices)
  outer_devices = None
  if config.diloco.get("outer_placement") == "host":
    try:
      devices, outer_devices = outer_placement.split_devices(devices)
    except ValueError as e:
      raise validation.ConfigError(str(e)) from None
  validation.validate_config(config, num_devices=len(devices))
  _check_every_process_holds_islands(config, devices)
  source = (warm_start.parse_source(config.init_from) if config.init_from
            else None)
  if source is not None and source.workdir == os.path.abspath(workdir):
    raise validation.ConfigError(
        f"config.init_from={config.init_from!r} is this run's own workdir; "
        "rerunning the command resumes it without init_from")
  if source is not None and not warm_start.has_checkpoints(workdir):
    warm_start.check(source, config)
  workdir, lock = workdir_lib.claim(workdir,
                                    lock=jax.process_index() == 0)
  try:
    with stops.StopSignals() as signals:
      if config.pretrain_steps:
        source, launch_time = _pretrain(config, workdir, devices,
                                        launch_time)
      return _train(config, workdir, devices, launch_time, signals, source,
                    outer_devices)
  finally:
    if lock is not None:
      lock.release()


def _check_every_process_holds_islands(config, devices) -> None:
  """ConfigError (on every process alike) if a process of a multi-process
  run would have no device in the mesh of the run or of its pretraining."""
  if jax.process_count() == 1:
    return
  islands = validation.effective_islands(config)
  mesh = mesh_lib.build_mesh(islands, config.mesh.data, config.mesh.stage,
                             devices)
  idle = multihost.idle_processes(mesh)
  if idle:
    raise validation.ConfigError(
        f"{islands} island(s) x mesh.data={config.mesh.data} x mesh.stage="
        f"{config.mesh.stage} use {mesh.devices.size} of the "
        f"{len(devices)} devices, leaving process(es) {idle} of "
        f"{jax.process_count()} without any: use more islands or spread "
        "each island over the processes with config.mesh.data")
  if config.pretrain_steps and len(multihost.idle_processes(
      mesh_lib.build_mesh(1, config.mesh.data, config.mesh.stage,
                          devices))):
    raise validation.ConfigError(
        f"config.pretrain_steps={config.pretrain_steps}: the pretraining is "
        f"one worker, on mesh.data x mesh.stage = {config.mesh.data} x "
        f"{config.mesh.stage} devices, which leaves processes of this "
        f"{jax.process_count()}-process run idle; pretrain in a run of its "
        "own (e.g. one process, config.mode=single) and start this one "
        "from it with config.init_from=THAT_WORKDIR")


def _pretrain(config, workdir: str, devices, launch_time: float):
  """Runs (or resumes) the pretraining phase unless the main phase began.

  Returns:
    (the Source the main phase starts from, the main phase's launch time).
  """
  pretrain_dir = warm_start.pretrain_workdir(workdir)
  if warm_start.has_checkpoints(workdir):  # the main phase began
    return warm_start.Source(pretrain_dir), launch_time
  logging.info("pretraining: steps 1..%d as one worker in %s",
               config.pretrain_steps, pretrain_dir)
  summary = train_and_evaluate(warm_start.pretrain_config(config),
                               pretrain_dir, devices, launch_time)
  logging.info("pretrained: eval loss %.4f at step %d; %s starts from it",
               summary["final_eval_loss"], config.pretrain_steps,
               config.mode)
  _mark_pretrain_metrics(pretrain_dir, workdir)
  return warm_start.Source(pretrain_dir), time.time()


def _mark_pretrain_metrics(pretrain_dir: str, workdir: str) -> None:
  """Starts workdir/metrics.jsonl with the pretraining records, marked
  phase 'pretrain', so one file holds the whole run (the main phase has
  not checkpointed, so whatever it logged is taken again)."""
  records = [{**record, "phase": "pretrain"}
             for record in metrics_lib.read_metrics(pretrain_dir)]
  metrics_lib.write_metrics(workdir, records)


def _close_after_error(checkpointer, writer) -> None:
  """Waits for the checkpoint in flight so an error loses nothing saved.

  A failure of that save is logged, not raised: the error being handled is
  the one to report.
  """
  try:
    checkpointer.close()
  except Exception as e:  # pylint: disable=broad-except
    logging.error("the checkpoint being saved could not be finished: %s", e)
  if writer is not None:
    writer.close()


def _train(config, workdir: str, devices, launch_time: float,
           signals: stops.StopSignals,
           source: warm_start.Source | None, outer_devices=None) -> dict:
  """train_and_evaluate's body, in a locked workdir with signals caught;
  a first start begins from `source`'s model when given; with
  `outer_devices` (outer_placement='host') the outer step runs there."""
  wall_start = time.perf_counter()
  mode = config.mode
  islands = validation.effective_islands(config)
  inner_steps = config.diloco.inner_steps
  total_steps = config.total_steps
  seq_len = config.data.sequence_length
  batch_size = config.data.batch_size

  phase_start = time.perf_counter()
  mesh = mesh_lib.build_mesh(islands, config.mesh.data, config.mesh.stage,
                             devices)
  batch_shape, eval_shape, weights_shape = programs_lib.batch_shapes(
      mesh, islands, batch_size, seq_len, config.eval.batch_size)
  # Each process reads the data of its own islands only.
  held = multihost.local_islands(batch_shape.sharding, batch_shape.shape)
  batches = sources.make_batch_source(config.data, islands, batch_size,
                                      seed=config.data.seed, islands=held)
  eval_set = sources.make_eval_batches(config.data, config.eval.batch_size,
                                       config.eval.num_batches)
  # The outer mean weights island i by the tokens it processed this round
  # times its cluster's share of the corpus (uniform for iid islands), so the
  # averaged update stands for the whole data distribution.
  island_shares = batches.island_token_weights() * islands
  logging.info("data ready in %.1fs (islands %d..%d on this process)",
               time.perf_counter() - phase_start, held.start, held.stop - 1)
  phase_start = time.perf_counter()
  place_batch = functools.partial(multihost.global_batch,
                                  sharding=batch_shape.sharding,
                                  global_shape=batch_shape.shape)
  fsdp = config.mesh.fsdp
  loss_fn = functools.partial(model_lib.next_token_loss,
                              model_lib.graphdef(config.model))
  spec = state_spec_lib.for_config(config)
  inner_opt, outer_opt = spec.inner_opt, spec.outer_opt
  compression = spec.compression
  abstract_state = spec.abstract(config.model)
  state_shardings = diloco.state_shardings(abstract_state, mesh, fsdp)
  host_outer = None
  if outer_devices is not None:
    host_outer = outer_placement.HostOuter(
        outer_devices, islands, mesh, outer_opt, compression, inner_opt,
        rounding_seed=(config.seed if config.diloco.stochastic_rounding
                       else None),
        restart_dropped=config.diloco.dropped_islands == "idle",
        overlap=config.diloco.overlap,
        fragments=(config.diloco.fragments
                   if schedule_lib.is_streaming(config.diloco) else None))

  def islands_side(state):
    """The state the islands train (with 'host', the outer fields go to
    the outer devices)."""
    return state if host_outer is None else host_outer.load(state)

  def whole(state):
    """The whole state, as checkpoints hold it."""
    return state if host_outer is None else host_outer.assemble(state)

  def evaluated(state):
    """The state to evaluate: with the outer side's current x."""
    return state if host_outer is None else host_outer.current(state)

  def first_state():
    """(step, source meta, state, progress) of a run's first start: fresh
    params, or `source`'s model (also where a rollback finds no checkpoint)."""
    if source is None:
      # Params are created on their devices, already sharded.
      with model_lib.fast_init_compile():
        state = jax.jit(lambda seed: spec.init(
            model_lib.new_params(config.model, seed)),
                        out_shardings=state_shardings)(config.seed)
      return 0, {}, state, accounting.Progress(islands)
    start = warm_start.load(source, spec, config, mesh, state_shardings)
    meta = start.meta
    progress = accounting.Progress(
        islands, rounds_done=meta.get("rounds_done", 0),
        tokens_seen=meta.get("tokens_seen", 0),
        initialized_from=start.record(source))
    return start.step, meta, start.state, progress

  checkpointer = checkpointing.Checkpointer(
      workdir, max_to_keep=config.checkpoint.max_to_keep,
      async_save=config.checkpoint.async_save)
  config_record = resume.config_record(config)  # saved with every checkpoint
  restore = functools.partial(resume.restore_latest, checkpointer, config,
                              abstract_state, mesh, inner_opt, islands)
  writer = None
  try:
    restored = restore()
    if restored is None:
      # A warm start is read (and refused) before anything compiles.
      start_step, meta, state, progress = first_state()
    else:
      start_step, meta, state = restored
      if start_step > total_steps:
        raise validation.ConfigError(
            f"config.total_steps={total_steps} is before the checkpoint at step "
            f"{start_step} in {checkpointer.directory}")
      logging.info("resuming from the checkpoint at step %d", start_step)
    state = islands_side(state)
    summary_path = os.path.join(workdir, "summary.json")
    if restored is not None and start_step == total_steps and os.path.exists(
        summary_path):
      logging.info("the run in %s already finished", workdir)
      checkpointer.close()
      with open(summary_path) as f:
        return json.load(f)
    if restored is not None:
      progress = accounting.Progress.from_meta(meta, islands)
    if restored is not None and "config" in meta:
      changed = config_changes.changes(meta["config"], config_record)
      if changed:
        logging.warning("resuming with config changes allowed by "
                        "config.resume.allow_changes: %s",
                        config_changes.describe(changed))
        progress.config_changes += [{"step": start_step, **c} for c in changed]

    # The steps compile from shapes in the background while the state is
    # initialized and the rest is set up.
    whole_abstract = placement.with_shardings(abstract_state, state_shardings)
    compiling = programs_lib.compile_in_background(
        config, mesh, loss_fn, inner_opt, outer_opt, compression,
        (whole_abstract if host_outer is None
         else outer_placement.strip(whole_abstract)), batch_shape,
        eval_shape, weights_shape, whole_abstract,
        num_eval_batches=len(eval_set))
    if host_outer is not None:
      host_outer.compile_in_background(whole_abstract)
    jax.block_until_ready(state)
    logging.info("state %s in %.1fs", "restored" if restored else "initialized",
                 time.perf_counter() - phase_start)
    dropped = metrics_lib.truncate_metrics(workdir, start_step)
    if dropped:
      logging.info("dropped %d metrics records logged after step %d; they are "
                   "taken again", dropped, start_step)
    resume.restore_data_positions(batches, meta, islands)
    eval_arrays = [_place(b, eval_shape.sharding) for b in eval_set]
    next_batch = place_batch(batches.next_batch())
    learning_rates = optimizers.learning_rate_table(config.inner_optimizer,
                                                    total_steps)
    if jax.process_index() == 0:
      metrics_lib.write_json_atomically(os.path.join(workdir, "config.json"),
                                        config_record)
    writer = metrics_lib.MetricsWriter(workdir, total_steps,
                                       config.log_every_seconds, islands)

    programs = compiling.result()
    inner_step = programs.inner_step
    syncs = mode == "diloco"  # islands synchronize (outer steps, fragments)
    evaluate, evaluate_island_mean = (programs.evaluate,
                                      programs.evaluate_island_mean)
    compile_s = programs.compile_s
    logging.info("compiled in %.1fs, %.1fs after launch", compile_s,
                 time.time() - launch_time)

    param_shapes = abstract_state.global_params
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(param_shapes))
    link_bytes = accounting.LinkBytes(config, param_shapes, islands,
                                      compression)
    sync_schedule = schedule_lib.from_config(config)

    flops_per_token = flops.training_flops_per_token(config.model, seq_len)
    tokens_per_island_step = batch_size * seq_len
    byte_level = config.data.tokenizer == "byte"
    logging.info("mode=%s islands=%d H=%d params=%s tokens/step=%d sync=%.2fMB",
                 mode, islands, inner_steps, f"{num_params:,}",
                 islands * tokens_per_island_step,
                 link_bytes.sync(_rank_indices(state)) / 1e6)
    logging.info("placement: %s; attention: %s", _placement_line(
        mesh, islands, config), model_lib.attention_implementation(config.model))
    if host_outer is not None:
      logging.info("outer step on its own device(s): %s", ", ".join(
          str(d) for d in host_outer.mesh.devices.flat))

    param_shapes_record = checkpointing.param_shapes_record(param_shapes)
    state_layout = checkpointing.state_layout_record(abstract_state)
    # The newest step this run's checkpoints hold (None: none yet).
    saved_step = start_step if restored else None

    def save(step: int) -> None:
      nonlocal saved_step
      writer.flush()  # metrics up to `step` reach the file before the state
      checkpointer.save(step, whole(state), {
          **progress.to_meta(), "step": step,
          "data": multihost.merge_island_states(data_state, held, islands),
          "param_shapes": param_shapes_record, "state_layout": state_layout,
          "config": config_record,
      }, programs.inspect_state)
      saved_step = step

    def finish_record(record: dict, step_metrics) -> None:
      """Writes a step's record once its metrics are fetched; raises
      NonFiniteError after writing it if the run diverged.

      In DiLoCo, islands that diverge while others do not are left to the
      outer step (it excludes them and restarts them from x); the record
      then averages the finite islands and counts the others.
      """
      nonlocal stop_agreed
      # One exchange per step carries the metrics and the stop requests.
      step_metrics, stop_agreed = multihost.fetch_and_any(step_metrics,
                                                          signals.requested)
      losses = np.atleast_1d(step_metrics["loss"])
      norms = np.atleast_1d(step_metrics["grad_norm"])
      finite = np.isfinite(losses) & np.isfinite(norms)
      some_diverged = syncs and 0 < finite.sum() < finite.size
      kept = finite if some_diverged else np.ones_like(finite)
      # Wall-clock since this process's loop started, when the step's
      # metrics (and, at a round's end, its syncs and eval) were done.
      record["elapsed_s"] = time.perf_counter() - train_start
      record["train_loss"] = float(np.mean(losses[kept]))
      record["grad_norm"] = float(np.mean(norms[kept]))
      if some_diverged:
        record["diverged_islands"] = int((~finite).sum())
        diverged_this_round.update(np.flatnonzero(~finite).tolist())
      writer.write(record)
      problem = guards.eval_problem(record["step"],
                                    record.get("eval_loss", 0.0))
      if not some_diverged:
        problem = problem or guards.step_problem(record["step"], losses, norms)
      if problem:
        raise problem

    def roll_back(error: guards.NonFiniteError, step: int):
      """Restores the last good state; the data stream goes on from where it
      is, so the batches of steps after that state are skipped."""
      nonlocal saved_step
      rollbacks = progress.rollbacks
      if config.nonfinite != "rollback":
        raise error
      if len(rollbacks) >= config.max_rollbacks:
        raise guards.NonFiniteError(
            f"{error} (after {len(rollbacks)} rollbacks, config.max_rollbacks)",
            error.step) from error
      checkpointer.wait()
      restored = restore(compare_config=False)
      if restored is None:
        to_step, _, state, new_progress = first_state()
      else:
        to_step, meta, state = restored
        new_progress = accounting.Progress.from_meta(meta, islands)
      kept_changes = progress.config_changes
      new_progress.config_changes = kept_changes
      new_progress.rollbacks = rollbacks + [{
          "step": error.step, "to_step": to_step,
          "skipped_batches": step - to_step, "error": str(error)}]
      writer.truncate(to_step)
      saved_step = to_step if restored else None
      logging.warning("%s; rolled back to step %d, skipping the %d batches "
                      "taken since (rollback %d of at most %d)", error, to_step,
                      step - to_step, len(new_progress.rollbacks),
                      config.max_rollbacks)
      return to_step, islands_side(state), new_progress

    island_mean_loss = rank = None
    participants = _participants(config, islands)
    diverged_this_round = set()  # islands the round's outer step excludes
    check_islands = (jax.jit(diloco.islands_finite) if syncs
                     else None)
    nan_island = (participation.parse_nan_island(config.testing.nan_island,
                                                 islands)
                  if config.get("testing", {}).get("nan_island") else None)
    data_state = batches.state()
    start_tokens = progress.tokens_seen  # what this process trains from here
    writer.start_clock(progress.tokens_seen)
    train_start = time.perf_counter()
    pending = None  # the previous step's record, finished one step late
    # Whether a process was asked to stop, as the processes agreed in the
    # last exchange since the loop's last check (None: none since).
    stop_agreed = None
    eval_loss = float("nan")
    startup_s = None
    step = start_step
    while step < total_steps:
      if stop_agreed is None:
        stop_agreed = multihost.any_process(signals.requested)
      stop, stop_agreed = stop_agreed, None
      if stop:
        if pending is not None:
          finish_record(*pending)
        # A checkpoint never holds a diverged island's NaN: mid-round, the
        # outer step that restarts it has not run yet.
        if step > start_step and saved_step != step and not diverged_this_round:
          save(step)
        checkpointer.wait()
        raise stops.StopRequested(
            signals.signal_name, step, saved=saved_step == step,
            unsaved_reason=(f"island(s) {sorted(diverged_this_round)} had "
                            "diverged in this round" if diverged_this_round
                            else ""),
            last_saved=saved_step)
      step += 1
      try:
        if next_batch is None:  # the prepared one was used before a rollback
          next_batch = place_batch(batches.next_batch())
        if nan_island and step == (nan_island[1] - 1) * inner_steps + 1:
          state = jax.jit(diloco.poison_island, static_argnums=1,
                          out_shardings=diloco.state_shardings(
                              state, mesh, fsdp))(state, nan_island[0])
        state, step_metrics = inner_step(state, next_batch)
        next_batch = None
        if startup_s is None:  # launch to the first inner step's result
          jax.block_until_ready(step_metrics)
          startup_s = time.time() - launch_time
          logging.info("first inner step done %.1fs after launch (compile "
                       "%.1fs)", startup_s, compile_s)
        data_state = batches.state()  # the position after the batch used
        progress.island_round_steps += 1
        synced = participants(step)
        # An idle island's work is discarded: its tokens do not count.
        progress.tokens_seen += tokens_per_island_step * (
            int(synced.sum()) if config.diloco.dropped_islands == "idle"
            else islands)
        link_bytes.count_step(progress)
        if step < total_steps:  # prepare the next batch while this step runs
          next_batch = place_batch(batches.next_batch())
        if pending is not None:
          finish_record(*pending)
          pending = None
        round_ended = _round_ends(step, inner_steps, total_steps)
        evaluating = _eval_due(step, inner_steps, total_steps,
                               config.eval.every_rounds)
        if evaluating and evaluate_island_mean is not None:
          # Before the outer step resets them, the islands' plain average.
          island_mean_loss = float(evaluate_island_mean(state,
                                                        tuple(eval_arrays)))
        actions = sync_schedule.after(step)
        excluded = np.zeros(islands, bool)
        if actions:
          # Islands are weighted by the tokens they processed this round
          # (the same for every island) times their share of the corpus;
          # those not synced this round get weight 0. Islands that diverged
          # are left out too (the programs mask them on the device; this
          # counts them).
          weights = _place((progress.island_round_steps
                            * tokens_per_island_step * island_shares
                            * synced).astype(np.float32),
                           weights_shape.sharding)
          excluded = synced & ~multihost.fetch(check_islands(state))
          rank_indices = _rank_indices(
              state if host_outer is None else host_outer.outer_state)
          rank = _mean_rank(compression, rank_indices)
          sending = int((synced & ~excluded).sum())
          state = _run_sync_actions(actions, state, programs, weights,
                                    host_outer)
          link_bytes.count_syncs(progress, actions, rank_indices, sending)
        if round_ended:
          progress.rounds_done += 1
          progress.island_round_steps[:] = 0
        record = {
            "step": step, "round": math.ceil(step / inner_steps),
            "learning_rate": float(learning_rates[step - 1]),
            "tokens_seen": progress.tokens_seen,
            "comm_bytes": progress.comm_bytes,
            "ddp_comm_bytes": progress.ddp_comm_bytes,
            "compression_vs_ddp": _ratio(progress.ddp_comm_bytes,
                                         progress.comm_bytes),
        }
        if config.pretrain_steps:  # the pretraining records say 'pretrain'
          record["phase"] = mode
        pending = (record, step_metrics)
        if evaluating:
          eval_loss = _mean_loss(evaluate, evaluated(state), eval_arrays)
          record.update(_eval_record(eval_loss, byte_level))
          if evaluate_island_mean is not None:
            record["eval_loss_island_mean"] = island_mean_loss
        if round_ended:
          if syncs and rank is not None:
            record["codec_mean_rank"] = rank
          if syncs:
            record["active_islands"] = int(synced.sum())
            record["excluded_islands"] = int(excluded.sum())
        checkpoint_due = _checkpoint_due(step, round_ended,
                                         progress.rounds_done, total_steps,
                                         config.checkpoint)
        if round_ended or checkpoint_due:  # its record goes out first
          pending = None
          finish_record(record, step_metrics)
        if checkpoint_due and diverged_this_round and not round_ended:
          logging.info("step %d: no checkpoint while island(s) %s are "
                       "diverged; the round's outer step restarts them",
                       step, sorted(diverged_this_round))
        elif checkpoint_due:
          save(step)
        if round_ended:
          diverged_this_round.clear()
      except guards.NonFiniteError as error:
        pending = None
        step, state, progress = roll_back(error, step)
        eval_loss = float("nan")
    if pending is not None:
      finish_record(*pending)
    if math.isnan(eval_loss):  # resumed from the final checkpoint
      eval_loss = _mean_loss(evaluate, evaluated(state), eval_arrays)
    jax.block_until_ready(state)
    train_s = time.perf_counter() - train_start
    checkpointer.close()
    writer.close()
  except BaseException:
    _close_after_error(checkpointer, writer)
    raise

  summary = _summary(
      config, progress, num_params=num_params, start_step=start_step,
      start_tokens=start_tokens,
      timings={"compile_s": compile_s, "startup_s": startup_s,
               "train_s": train_s,
               "wall_s": time.perf_counter() - wall_start},
      flops_per_token=flops_per_token, mesh=mesh, eval_loss=eval_loss,
      island_mean_loss=(island_mean_loss if evaluate_island_mean is not None
                        else None),
      entropy_rate=batches.info.entropy_rate)
  if step > start_step:  # the step time of this process's steps
    summary.update(network_model.run_estimate(
        config, step_time_s=train_s / (step - start_step),
        bandwidth_bits_per_s=config.network.bandwidth_bits_per_s,
        latency_s=config.network.latency_s, params=param_shapes))
  if jax.process_index() == 0:
    metrics_lib.write_json_atomically(summary_path, summary)
  logging.info("done: final eval loss %.4f, %.0f tokens/s, %.1f MB sent",
               eval_loss, summary["tokens_per_s"], progress.comm_bytes / 1e6)
  return summary
