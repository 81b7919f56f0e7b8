"""Checks a config before anything is compiled or written.

Each check raises `ConfigError` with one line that names the offending field,
so a bad flag costs a second rather than a compile, and the workdir is left
untouched.
"""

from diloco_jax.codecs import dense as codecs
from diloco_jax.algorithm import compression
from diloco_jax.config import changes as config_changes
from diloco_jax.config import schema as config_schema
from diloco_jax.algorithm import overlap as overlap_lib
from diloco_jax.algorithm import guards
from diloco_jax.model import transformer as model_lib
from diloco_jax.parallel import outer_devices
from diloco_jax.algorithm import participation
from diloco_jax.algorithm import schedule as schedule_lib
from diloco_jax.data import corpus as corpus_lib


class ConfigError(ValueError):
  """An invalid config; the message names the field."""


def _require(condition: bool, message: str) -> None:
  if not condition:
    raise ConfigError(message)


def _positive_int(config, dotted_name: str) -> int:
  value = config
  for part in dotted_name.split("."):
    value = value[part]
  _require(
      isinstance(value, int) and not isinstance(value, bool) and value >= 1,
      f"config.{dotted_name}={value!r} must be an integer >= 1",
  )
  return value


def effective_islands(config) -> int:
  """Islands actually used: `single` mode is one worker whatever the config says."""
  return 1 if config.mode == "single" else config.diloco.islands


def devices_per_island(config) -> int:
  """data x stage: the devices one island needs (islands fold onto them)."""
  return config.mesh.data * config.mesh.stage


def _validate_participation(config) -> None:
  diloco_config = config.diloco
  if diloco_config.island_schedule:
    try:
      participation.parse_schedule(diloco_config.island_schedule,
                                   diloco_config.islands)
    except ValueError as e:
      raise ConfigError(f"config.diloco.island_schedule: {e}") from None
  _require(0 <= diloco_config.drop_probability < 1,
           f"config.diloco.drop_probability={diloco_config.drop_probability}"
           " must be in [0, 1)")
  _require(diloco_config.dropped_islands in participation.DROPPED_ISLANDS,
           f"config.diloco.dropped_islands={diloco_config.dropped_islands!r}"
           f" is not one of {participation.DROPPED_ISLANDS}")
  nan_island = config.get("testing", {}).get("nan_island", "")
  if nan_island:
    _require(config.mode == "diloco",
             f"config.testing.nan_island is for DiLoCo runs; config.mode="
             f"{config.mode!r}")
    try:
      participation.parse_nan_island(nan_island, diloco_config.islands)
    except ValueError as e:
      raise ConfigError(f"config.testing.nan_island: {e}") from None
  _require(diloco_config.overlap in overlap_lib.OVERLAPS,
           f"config.diloco.overlap={diloco_config.overlap!r} is not one of "
           f"{overlap_lib.OVERLAPS}")
  _require(diloco_config.outer_placement in outer_devices.PLACEMENTS,
           "config.diloco.outer_placement="
           f"{diloco_config.outer_placement!r} is not one of "
           f"{outer_devices.PLACEMENTS}")
  if diloco_config.outer_placement == "host":
    _require(config.mode == "diloco",
             "config.diloco.outer_placement='host' places DiLoCo's outer "
             f"step; config.mode={config.mode!r} has none")
  _require(config.mode == "diloco" or diloco_config.overlap == "none",
           f"config.diloco.overlap={diloco_config.overlap!r} overlaps DiLoCo's"
           f" outer steps; config.mode={config.mode!r} has none")
  _validate_streaming(config)
  _require(config.mode == "diloco" or not (
      diloco_config.island_schedule or diloco_config.drop_probability),
           f"config.diloco.island_schedule and drop_probability are DiLoCo's"
           f" (islands that skip outer steps); config.mode={config.mode!r}")


def _validate_streaming(config) -> None:
  """fragments, fragment_delay and fragment_alpha (Streaming DiLoCo)."""
  diloco_config = config.diloco
  fragments, delay = diloco_config.fragments, diloco_config.fragment_delay
  alpha = diloco_config.fragment_alpha
  _positive_int(config, "diloco.fragments")
  _require(fragments <= config.model.num_layers,
           f"config.diloco.fragments={fragments} exceeds config.model."
           f"num_layers={config.model.num_layers} (fragments are groups of "
           "consecutive blocks)")
  _require(fragments <= diloco_config.inner_steps,
           f"config.diloco.fragments={fragments} exceeds config.diloco."
           f"inner_steps={diloco_config.inner_steps} (each fragment syncs at "
           "its own step of the round)")
  _require(isinstance(delay, int) and not isinstance(delay, bool)
           and 0 <= delay < diloco_config.inner_steps,
           f"config.diloco.fragment_delay={delay!r} must be an integer in "
           f"[0, config.diloco.inner_steps={diloco_config.inner_steps})")
  _require(isinstance(alpha, (int, float)) and 0 <= alpha < 1,
           f"config.diloco.fragment_alpha={alpha!r} must be in [0, 1)")
  streaming = schedule_lib.is_streaming(diloco_config)
  _require(config.mode == "diloco" or not streaming,
           "config.diloco.fragments, fragment_delay and fragment_alpha are "
           f"Streaming DiLoCo's; config.mode={config.mode!r}")
  _require(not (streaming and diloco_config.overlap != "none"),
           f"config.diloco.overlap={diloco_config.overlap!r} and Streaming "
           "DiLoCo (fragments, fragment_delay, fragment_alpha) are two ways to "
           "overlap; choose one (fragment_delay overlaps a fragment's sync)")
  _require(not (streaming and diloco_config.dropped_islands == "idle"),
           "config.diloco.dropped_islands='idle' restarts whole islands at "
           "an outer step; Streaming DiLoCo has none (use 'train')")
  _require(not (streaming and config.mesh.fsdp
                and diloco_config.codec not in codecs.DENSE_CODECS),
           "Streaming DiLoCo with config.mesh.fsdp needs a dense codec")


def validate_config(config, num_devices: int) -> None:
  """Raises ConfigError naming the first invalid field of `config`.

  Args:
    config: a config built from `config_schema.base_config()`.
    num_devices: how many devices the mesh can be built from.
  """
  _require(
      config.mode in config_schema.MODES,
      f"config.mode={config.mode!r} is not one of {config_schema.MODES}",
  )
  for name in ("total_steps", "diloco.islands", "diloco.inner_steps",
               "mesh.data", "mesh.stage", "data.batch_size",
               "data.microbatches",
               "data.sequence_length", "eval.batch_size", "eval.num_batches",
               "model.num_layers", "model.d_model", "model.num_heads",
               "model.head_dim", "model.mlp_dim", "model.vocab_size",
               "model.max_sequence_length"):
    _positive_int(config, name)

  needed = devices_per_island(config)
  _require(
      needed <= num_devices,
      f"config.mesh.data x config.mesh.stage = {config.mesh.data} x "
      f"{config.mesh.stage} = {needed} devices per island, but only "
      f"{num_devices} are available",
  )

  _require(
      config.mesh.stage == 1,
      f"config.mesh.stage={config.mesh.stage}: pipeline stages are not "
      "implemented yet; use 1",
  )
  _require(
      config.data.batch_size % config.mesh.data == 0,
      f"config.data.batch_size={config.data.batch_size} (per island) is not "
      f"divisible by config.mesh.data={config.mesh.data}",
  )
  microbatch = config.data.microbatches * config.mesh.data
  _require(
      config.data.batch_size % microbatch == 0,
      f"config.data.batch_size={config.data.batch_size} (per island) is not "
      f"divisible by config.data.microbatches x config.mesh.data = "
      f"{config.data.microbatches} x {config.mesh.data}",
  )
  eval_shards = effective_islands(config) * config.mesh.data
  _require(
      config.eval.batch_size % eval_shards == 0,
      f"config.eval.batch_size={config.eval.batch_size} is not divisible by "
      f"islands x mesh.data = {eval_shards}",
  )
  every_rounds = config.eval.every_rounds
  _require(isinstance(every_rounds, int) and not isinstance(every_rounds, bool)
           and every_rounds >= 0,
           f"config.eval.every_rounds={every_rounds!r} must be an integer "
           ">= 0 (0: evaluate at the last step only)")
  _require(isinstance(config.eval.island_mean, bool),
           f"config.eval.island_mean={config.eval.island_mean!r} must be "
           f"True or False")

  _validate_compression(config)
  _validate_safety(config)
  network = config.network
  _require(isinstance(network.bandwidth_bits_per_s, (int, float))
           and network.bandwidth_bits_per_s > 0,
           "config.network.bandwidth_bits_per_s="
           f"{network.bandwidth_bits_per_s!r} must be a number > 0")
  _require(isinstance(network.latency_s, (int, float))
           and network.latency_s >= 0,
           f"config.network.latency_s={network.latency_s!r} must be a "
           "number >= 0")
  _validate_start(config)
  _require(
      not config.mesh.fsdp or config.diloco.codec in codecs.DENSE_CODECS,
      f"config.mesh.fsdp needs a dense codec {codecs.DENSE_CODECS}; "
      f"config.diloco.codec={config.diloco.codec!r} works on whole matrices",
  )
  _validate_participation(config)
  outer = config.diloco.outer_optimizer
  _require(
      outer.name in config_schema.OUTER_OPTIMIZERS,
      f"config.diloco.outer_optimizer.name={outer.name!r} is not one of "
      f"{config_schema.OUTER_OPTIMIZERS}",
  )
  _require(outer.learning_rate > 0,
           "config.diloco.outer_optimizer.learning_rate must be > 0")
  _require(0 <= outer.momentum < 1,
           "config.diloco.outer_optimizer.momentum must be in [0, 1)")
  inner = config.inner_optimizer
  _require(
      inner.name in config_schema.INNER_OPTIMIZERS,
      f"config.inner_optimizer.name={inner.name!r} is not one of "
      f"{config_schema.INNER_OPTIMIZERS}",
  )
  _require(inner.learning_rate > 0,
           "config.inner_optimizer.learning_rate must be > 0")
  _require(inner.warmup_steps >= 0,
           "config.inner_optimizer.warmup_steps must be >= 0")
  _require(inner.grad_clip_norm >= 0,
           "config.inner_optimizer.grad_clip_norm must be >= 0 (0 disables)")

  _require(
      config.model.dtype in ("float32", "bfloat16"),
      f"config.model.dtype={config.model.dtype!r} is not 'float32' or "
      "'bfloat16'",
  )
  _validate_attention(config.model)
  _require(
      config.data.sequence_length <= config.model.max_sequence_length,
      f"config.data.sequence_length={config.data.sequence_length} exceeds "
      f"config.model.max_sequence_length={config.model.max_sequence_length}",
  )
  try:
    corpus_lib.validate_data_config(config.data)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  corpus_vocab = corpus_lib.corpus_vocab_size(config.data)
  _require(
      config.model.vocab_size >= corpus_vocab,
      f"config.model.vocab_size={config.model.vocab_size} is smaller than the"
      f" corpus vocabulary ({corpus_vocab} for corpus "
      f"{config.data.corpus!r})",
  )


def _validate_safety(config) -> None:
  """The non-finite policy and the fields a resume may change."""
  _require(
      config.nonfinite in guards.POLICIES,
      f"config.nonfinite={config.nonfinite!r} is not one of "
      f"{guards.POLICIES}",
  )
  _require(
      isinstance(config.max_rollbacks, int) and config.max_rollbacks >= 0,
      f"config.max_rollbacks={config.max_rollbacks!r} must be an integer "
      ">= 0",
  )
  names = config_changes.parse_allowed(config.resume.allow_changes)
  _require(
      not any(name in config_changes.NEVER_ALLOWED for name in names),
      "config.resume.allow_changes cannot allow 'mode': a checkpoint of "
      "another mode cannot be resumed in place",
  )
  unknown = config_changes.unknown_fields(names, config.to_dict())
  _require(
      not unknown,
      f"config.resume.allow_changes names {', '.join(map(repr, unknown))}, "
      "which is not a config field (use dotted names such as "
      "'total_steps,diloco.codec')",
  )


def _validate_start(config) -> None:
  """pretrain_steps, init_from and the schedule's length."""
  pretrain = config.pretrain_steps
  _require(
      isinstance(pretrain, int) and not isinstance(pretrain, bool)
      and 0 <= pretrain < config.total_steps,
      f"config.pretrain_steps={pretrain!r} must be an integer in [0, "
      f"config.total_steps={config.total_steps}) (total_steps counts both "
      "phases)")
  _require(
      not (pretrain and config.init_from),
      "config.pretrain_steps and config.init_from both choose the starting "
      "model; set one")
  schedule_steps = config.inner_optimizer.schedule_steps
  _require(
      isinstance(schedule_steps, int) and not isinstance(schedule_steps, bool)
      and schedule_steps >= 0,
      f"config.inner_optimizer.schedule_steps={schedule_steps!r} must be an "
      "integer >= 0 (0: total_steps)")


def _validate_attention(model_config) -> None:
  name = model_config.attention
  _require(
      name in model_lib.ATTENTION_IMPLEMENTATIONS,
      f"config.model.attention={name!r} is not one of "
      f"{model_lib.ATTENTION_IMPLEMENTATIONS}",
  )
  if name != "cudnn":
    return
  _require(model_lib.on_nvidia_gpu(),
           "config.model.attention='cudnn' needs an NVIDIA GPU; use 'auto' "
           "or 'xla'")
  _require(model_config.dtype == "bfloat16",
           "config.model.attention='cudnn' needs config.model.dtype="
           f"'bfloat16', not {model_config.dtype!r}")
  _require(model_config.head_dim % 8 == 0 and model_config.head_dim <= 128,
           "config.model.attention='cudnn' needs config.model.head_dim a "
           f"multiple of 8 up to 128, not {model_config.head_dim}")


def _validate_compression(config) -> None:
  diloco = config.diloco
  _require(
      diloco.codec in compression.CODECS,
      f"config.diloco.codec={diloco.codec!r} is not one of "
      f"{compression.CODECS}",
  )
  _positive_int(config, "diloco.codec_block_size")
  _require(
      diloco.codec_block_size % 2 == 0,
      f"config.diloco.codec_block_size={diloco.codec_block_size} must "
      "be even (int4 and fp4 pack two values per byte)",
  )
  for field in ("fallback_codec", "lowrank.factor_codec"):
    value = diloco.lowrank.factor_codec if "." in field else diloco[field]
    _require(
        value in codecs.DENSE_CODECS,
        f"config.diloco.{field}={value!r} is not one of "
        f"{codecs.DENSE_CODECS}",
    )
  for field, value in (("prune_rate", diloco.prune_rate),
                       ("topk_fraction", diloco.topk_fraction),
                       ("lowrank.energy_fraction",
                        diloco.lowrank.energy_fraction)):
    _require(
        isinstance(value, (int, float)) and 0 < value < 1,
        f"config.diloco.{field}={value!r} must be in (0, 1)",
    )
  for name in ("rank", "min_rank", "max_rank"):
    _positive_int(config, f"diloco.lowrank.{name}")
  _require(
      diloco.lowrank.min_rank <= diloco.lowrank.max_rank,
      f"config.diloco.lowrank.min_rank={diloco.lowrank.min_rank} exceeds "
      f"config.diloco.lowrank.max_rank={diloco.lowrank.max_rank}",
  )
