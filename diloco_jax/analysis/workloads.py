"""The network model's workloads from what a run sends: the bytes per sync
of a params tree through a codec, DDP's and DiLoCo's workloads, those of a
run's config, and the estimate summary.json reports."""

import dataclasses

import jax
import jax.numpy as jnp

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.analysis.network_model import (Link, Workload,
                                               bandwidth_for_utilization,
                                               end_of_run_s, is_int, require,
                                               timing)
from diloco_jax.codecs import dense as codecs
from diloco_jax.config import overlap_defaults
from diloco_jax.config import run_config as run_config_lib
from diloco_jax.model import transformer as model_lib
from diloco_jax.parallel import stages as stages_lib


def _params_tree(params):
  """A params tree of abstract leaves: `params` itself, or one flat leaf of
  that many float32 values for a count."""
  if is_int(params):
    require(params >= 0, "num_params", params, "must be >= 0")
    return {"params": jax.ShapeDtypeStruct((params,), jnp.float32)}
  return params


def bytes_per_sync(params, islands: int, codec="fp32", *,
                   compression_ratio: float | None = None,
                   block_size: int = 256, stripes: int = 1,
                   stages: int = 1) -> float:
  """Bytes one island sends to all-reduce the whole model once.

  Dense codecs count exactly what the training run counts
  (compression.mean_bytes): a float32 ring all-reduce sends 2(k-1)/k of the
  payload per island; the other dense codecs run the same two phases with
  encoded chunks (values plus one float32 scale per block). An island of
  pipeline stages sends each stage's share in a collective of its own: the
  sum over its stages.

  Args:
    params: the parameter count, or a params tree (arrays or
      jax.ShapeDtypeStruct leaves), whose per-leaf rounding is then exact.
    islands: k.
    codec: a dense codec name, a structured codec name or a
      compression.Compression; None for a codec this project does not have,
      given by `compression_ratio` alone.
    compression_ratio: float32 bytes / bytes sent. Required for structured
      codecs (sign_prune, topk, lowrank, adaptive_lowrank) given a count,
      since their bytes depend on each matrix's shape, and for codec None;
      refused for dense codecs, whose bytes are exact.
    block_size: values per scale of the blockwise dense codecs.
    stripes: FSDP devices per island (each sends its shards' part).
    stages: S, pipeline stages per island (a params tree's layers split
      into S equal blocks, its other leaves into S pieces; a count into S
      equal shares).

  Returns:
    Bytes (0 for one island).
  """
  require(is_int(islands) and islands >= 1, "islands", islands,
          "must be an integer >= 1")
  require(is_int(stages) and stages >= 1, "stages", stages,
          "must be an integer >= 1")
  tree = _params_tree(params)
  if stages > 1:
    return stages * bytes_per_sync(
        _stage_share(params, stages), islands, codec,
        compression_ratio=compression_ratio, block_size=block_size,
        stripes=stripes)
  if isinstance(codec, compression_lib.Compression):
    compression = codec
  elif codec is None:
    compression = None
  else:
    require(codec in compression_lib.CODECS, "codec", codec,
            f"is not one of {compression_lib.CODECS} (or None with a "
            "compression_ratio)")
    compression = (compression_lib.Compression(
        codec, codecs.make_codec(codec, block_size))
                   if codec in codecs.DENSE_CODECS else None)
  name = compression.name if compression else codec
  if compression_ratio is not None:
    require(compression_ratio > 0, "compression_ratio", compression_ratio,
            "must be > 0")
    require(name not in codecs.DENSE_CODECS, "compression_ratio",
            compression_ratio,
            f"is for structured codecs; codec={name!r}'s bytes are exact")
    return bytes_per_sync(tree, islands, "fp32",
                          stripes=stripes) / compression_ratio
  require(compression is not None, "compression_ratio", None,
          f"is needed for codec={name!r}: it gives that codec's bytes")
  # A structured Compression over a real params tree is exact (at the top of
  # an adaptive codec's rank ladder); over a count it has no matrices.
  require(compression.is_dense or not is_int(params), "compression_ratio",
          None, f"is needed for codec={name!r} given a parameter count: its"
          " bytes depend on each matrix's shape")
  return float(compression_lib.mean_bytes(tree, islands, compression,
                                          stripes=stripes))


def _stage_share(params, stages: int):
  """One pipeline stage's share of `params` (a count or a tree)."""
  if is_int(params):
    require(params % stages == 0, "num_params", params,
            f"must split into stages={stages} equal shares")
    return params // stages
  layers = sum(1 for key in params["blocks"])
  return stages_lib.StageLayout(stages, 1, layers).stage_shapes(params)


def ddp_workload(params, islands: int, step_time_s: float, *,
                 inner_steps: int = 1, codec="fp32",
                 hidden_fraction: float = 0.0, stages: int = 1,
                 stage_links: int = 1) -> Workload:
  """DDP: every step all-reduces the gradients (float32 by default, as the
  runs count it), blocking unless `hidden_fraction` of a step hides it.

  `inner_steps` only sets how many steps count as a round. `stages`,
  `stage_links`: an island's pipeline stages and their links (Workload).
  """
  return Workload("ddp", islands, step_time_s,
                  bytes_per_sync(params, islands, codec, stages=stages),
                  inner_steps=inner_steps,
                  ddp_hidden_fraction=hidden_fraction,
                  stage_links=stage_links)


def diloco_workload(params, islands: int, step_time_s: float,
                    inner_steps: int, *, codec="fp32",
                    compression_ratio: float | None = None,
                    overlap: str = "none", fragments: int = 1,
                    fragment_delay: int = 0, apply_time_s: float = 0.0,
                    block_size: int = 256, stripes: int = 1,
                    stages: int = 1, stage_links: int = 1) -> Workload:
  """DiLoCo, with one-step-delay overlap or Streaming DiLoCo's fragments,
  on islands of `stages` pipeline stages with `stage_links` links.

  Args: as Workload's fields and bytes_per_sync's.
  """
  return Workload(
      "diloco", islands, step_time_s,
      bytes_per_sync(params, islands, codec,
                     compression_ratio=compression_ratio,
                     block_size=block_size, stripes=stripes, stages=stages),
      inner_steps=inner_steps, overlap=overlap, fragments=fragments,
      fragment_delay=fragment_delay, apply_time_s=apply_time_s,
      stage_links=stage_links)


def from_config(config, step_time_s: float, bandwidth_bits_per_s: float,
                latency_s: float = 0.0, *, params=None,
                sync_bytes: float | None = None,
                compression_ratio: float | None = None,
                ddp_hidden_fraction: float = 0.0,
                apply_time_s: float = 0.0) -> tuple[Workload, Link]:
  """The workload and link of a run's config (config_schema.base_config).

  Reads config.mode, config.diloco.{islands, inner_steps, codec} and the
  codec's settings, and config.diloco.{overlap, fragments, fragment_delay,
  outer_placement} with defaults ('none', 1, 0, 'device') where the config
  has no such field. With FSDP every device of an island sends its shards'
  part, as the runs count; with pipeline stages (config.mesh.stage) every
  stage its own share, over the island's link or, with
  config.network.link_per_stage, over a link per stage.

  The overlap is modeled only with outer_placement='host': a collective on
  the compute devices runs in their stream, between inner steps, so it
  hides behind none of them (measured on shaped links: Streaming DiLoCo on
  the compute devices takes plain DiLoCo's round time).

  Args:
    config: the run's ml_collections config.
    step_time_s: one inner step's compute time (e.g. train_s / steps).
    bandwidth_bits_per_s: each island's link, bits per second.
    latency_s: one-way latency of one message.
    params: the params tree (e.g. the run's abstract global params) or a
      parameter count; None builds the model's shapes from config.model.
      Structured codecs need a tree (or a compression_ratio).
    sync_bytes: bytes one island sends per sync (per step for ddp), as a
      run measured them (comm_bytes / syncs: an adaptive codec's ranks as
      they were); None counts them from params and the codec.
    compression_ratio: see bytes_per_sync.
    ddp_hidden_fraction: see Workload (ddp only).
    apply_time_s: see Workload (diloco only).

  Returns:
    (workload, link).
  """
  d = config.diloco
  link = Link(bandwidth_bits_per_s, latency_s)
  if config.mode == "single":
    return Workload("single", 1, step_time_s, 0.0,
                    inner_steps=d.inner_steps), link
  stages = config.mesh.get("stage", 1)
  stage_links = (stages if config.network.get("link_per_stage", False)
                 else 1)
  if sync_bytes is None:
    if params is None:
      params = model_lib.param_shapes(config.model)
    stripes = config.mesh.data if config.mesh.fsdp else 1
    # DDP all-reduces float32 gradients, as link_bytes.LinkBytes counts them.
    codec = (run_config_lib.compression(d) if config.mode == "diloco"
             else "fp32")
    sync_bytes = bytes_per_sync(params, d.islands, codec,
                                compression_ratio=compression_ratio,
                                stripes=stripes, stages=stages)
  if config.mode == "ddp":
    return Workload("ddp", d.islands, step_time_s, sync_bytes,
                    inner_steps=d.inner_steps,
                    ddp_hidden_fraction=ddp_hidden_fraction,
                    stage_links=stage_links), link
  overlaps = d.get("outer_placement", "device") == "host"
  # The rebasing delay and eager updates send and wait as the plain
  # delay does.
  delayed = d.get("overlap", "none") != "none"
  return Workload(
      "diloco", d.islands, step_time_s, sync_bytes,
      inner_steps=d.inner_steps,
      overlap="one_step_delay" if overlaps and delayed else "none",
      fragments=d.get("fragments", 1),
      fragment_delay=d.get("fragment_delay", 0) if overlaps else 0,
      apply_time_s=apply_time_s, stage_links=stage_links), link


def run_estimate(config, step_time_s: float, bandwidth_bits_per_s: float,
                 latency_s: float = 0.0, *, params=None,
                 sync_bytes: float | None = None,
                 compression_ratio: float | None = None,
                 targets: tuple[float, ...] = (0.9, 0.95)) -> dict:
  """What a run's config would cost over the given link, for summary.json.

  The run's config.total_steps (pretraining steps run as one worker, with
  nothing sent) at the modeled round time.

  Args: as from_config's; `targets`: utilizations to report the bandwidth
  needed for.

  Returns:
    A dict of JSON numbers: the link, the bytes per sync, the modeled round
    time and utilization of a steady round, the utilization over the run's
    rounds and the wall-clock time of the whole run (its rounds, eager
    updates' warm-up rounds at the time of a round without overlap, and
    end_of_run_s), and
    `network_bandwidth_for_utilization` {target: bits/s} (None where latency
    alone forbids the target).
  """
  workload, link = from_config(config, step_time_s, bandwidth_bits_per_s,
                               latency_s, params=params,
                               sync_bytes=sync_bytes,
                               compression_ratio=compression_ratio)
  t = timing(workload, link)
  pretrain = min(config.pretrain_steps, config.total_steps)
  steps = config.total_steps - pretrain
  rounds = steps / workload.inner_steps
  # Eager updates' warm-up rounds wait for their mean as without overlap.
  warmup = (min(overlap_defaults.warmup_rounds(config.diloco), rounds)
            if workload.overlap != "none" else 0)
  waiting = (timing(dataclasses.replace(workload, overlap="none"), link)
             if warmup else t)
  rounds_s = (warmup * waiting.round_s + (rounds - warmup) * t.round_s
              + (end_of_run_s(workload, link) if steps else 0.0))
  needed = {}
  for target in targets:
    try:
      needed[str(target)] = bandwidth_for_utilization(target, workload,
                                                      latency_s)
    except ValueError:
      needed[str(target)] = None
  return {
      "network_bandwidth_bits_per_s": bandwidth_bits_per_s,
      "network_latency_s": latency_s,
      "network_step_time_s": step_time_s,
      "network_sync_bytes": workload.sync_bytes,
      "network_round_s": t.round_s,
      "network_utilization": t.utilization,
      # Over the run's rounds: warm-up and the end's last wait included.
      "network_run_utilization": (steps * step_time_s / rounds_s if steps
                                  else t.utilization),
      "network_wall_s": pretrain * step_time_s + rounds_s,
      "network_bandwidth_for_utilization": needed,
  }
