"""What a run reports: each step's metrics record and the run's summary.

A step's record holds what the step trained and sent (and, where it was
evaluated, the eval loss); the summary, written to summary.json at the end,
holds what the whole run trained, sent, measured and changed.
"""

import math

from diloco_jax.analysis import flops
from diloco_jax.telemetry import counters


def ratio(numerator: float, denominator: float) -> float | None:
  """numerator / denominator, or None when nothing was sent (k = 1)."""
  return numerator / denominator if denominator else None


def eval_record(loss: float, byte_level: bool) -> dict:
  """The eval loss, its perplexity and (byte-level tokens) bits per byte."""
  record = {"eval_loss": loss,
            "eval_perplexity": math.exp(min(loss, 80.0))}
  if byte_level:
    record["eval_bits_per_byte"] = loss / math.log(2)
  return record


def step_record(run_config, step: int, progress: counters.Progress,
                learning_rate: float) -> dict:
  """A step's record, before its training metrics and eval are added."""
  config = run_config.config
  record = {
      "step": step, "round": -(-step // run_config.diloco.inner_steps),
      "learning_rate": learning_rate,
      "tokens_seen": progress.tokens_seen,
      "comm_bytes": progress.comm_bytes,
      "ddp_comm_bytes": progress.ddp_comm_bytes,
      "compression_vs_ddp": ratio(progress.ddp_comm_bytes,
                                  progress.comm_bytes),
  }
  if config.pretrain_steps:  # the pretraining records say 'pretrain'
    record["phase"] = config.mode
  return record


def throughput(tokens: int, seconds: float, flops_per_token: float, mesh,
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


def timed_steps(metrics: list[dict]) -> tuple[int, int, float]:
  """(steps, tokens, seconds) the records of metrics.jsonl timed.

  Each record's `elapsed_s` counts from the start of its attempt's loop
  (a resumed run starts again from 0), so a step's time is its record's
  elapsed_s less the previous record's in the same attempt, or its own
  elapsed_s when it starts an attempt. Pretraining records are left out.
  """
  steps, tokens, seconds = 0, 0, 0.0
  previous = None
  for record in metrics:
    if record.get("phase") == "pretrain" or record.get("elapsed_s") is None:
      continue
    if previous is not None and record["step"] == previous["step"] + 1:
      elapsed = record["elapsed_s"]
      same_attempt = elapsed >= previous["elapsed_s"]
      seconds += elapsed - previous["elapsed_s"] if same_attempt else elapsed
      tokens += record["tokens_seen"] - previous["tokens_seen"]
      steps += 1
    previous = record
  return steps, tokens, seconds


def summary(run_config, progress: counters.Progress, *, num_params: int,
            start_step: int, timed: tuple[int, int, float], timings: dict,
            flops_per_token: float, mesh, eval_loss: float,
            island_mean_loss: float | None,
            entropy_rate: float | None) -> dict:
  """The run's summary.json: what was trained, sent, measured and changed.

  Throughput is `timed`'s (steps, tokens, seconds): this process's steps,
  or, for a run resumed at its end, what metrics.jsonl timed
  (timed_steps).
  """
  config, diloco = run_config.config, run_config.diloco
  result = {
      "mode": config.mode,
      "islands": progress.islands,
      "inner_steps": diloco.inner_steps,
      "total_steps": config.total_steps,
      "rounds": progress.rounds_done,
      "corpus": config.data.corpus,
      "num_params": num_params,
      "tokens_seen": progress.tokens_seen,
      "comm_bytes": progress.comm_bytes,
      "ddp_comm_bytes": progress.ddp_comm_bytes,
      "codec": diloco.codec,  # 'fp32' outside 'diloco'
      "overlap": diloco.overlap_mode,  # 'none' outside 'diloco'
      "outer_placement": diloco.outer_placement,
      "fragments": diloco.fragments,  # None outside Streaming DiLoCo
      # What the codec saved on the syncs, and what it saved against DDP.
      "compression_vs_fp32": ratio(progress.fp32_comm_bytes,
                                   progress.comm_bytes),
      "compression_vs_ddp": ratio(progress.ddp_comm_bytes,
                                  progress.comm_bytes),
      **timings,
      "resumed_from_step": start_step,
      "model_flops_per_token": flops_per_token,
      # Fields changed on resume (resume.allow_changes) and NaN rollbacks.
      "config_changes": progress.config_changes,
      "rollbacks": progress.rollbacks,
      # Checkpoints set aside unread when the run started over.
      "started_over": progress.started_over,
      # The model the run started from (init_from, pretrain_steps) or None.
      "pretrain_steps": config.pretrain_steps,
      "initialized_from": progress.initialized_from,
  }
  # Of the loop's time, the share it waited for batches (an upper bound on
  # the devices' idle time for data: a wait overlaps the step in flight).
  result["data_wait_fraction"] = ratio(timings["data_wait_s"],
                                       timings["train_s"])
  result["timed_steps"] = timed[0]
  result.update(throughput(timed[1], timed[2], flops_per_token, mesh,
                           config.model.dtype))
  byte_level = config.data.tokenizer == "byte"
  result.update({"final_" + k: v
                 for k, v in eval_record(eval_loss, byte_level).items()})
  if island_mean_loss is not None:
    result["final_eval_loss_island_mean"] = island_mean_loss
  if entropy_rate is not None:
    result["corpus_entropy_rate"] = entropy_rate
  return result
