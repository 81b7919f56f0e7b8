"""Checks a config once, before anything is compiled or written.

`validate_config(config, num_devices)` runs every check, collects every
problem (each one line naming its field) and raises them together in one
`ConfigError`, so a bad command costs one try rather than one per field,
and the workdir is left untouched. A config that passes comes back as a
`run_config.RunConfig`: frozen, with what it stands for parsed once, for
the layers below to take as it is. Checks that depend on a field run only
when that field passed its own. The DiLoCo section's checks are
diloco_checks.py's.
"""

from diloco_jax.algorithm import guards
from diloco_jax.config import changes as config_changes
from diloco_jax.config import diloco_checks
from diloco_jax.config import outer_mode_checks
from diloco_jax.config import overlap_defaults
from diloco_jax.config import pipeline_checks
from diloco_jax.config.problems import ConfigError, Problems
from diloco_jax.config import run_config
from diloco_jax.config import schema as config_schema
from diloco_jax.data import errors as data_errors
from diloco_jax.data import settings as data_settings
from diloco_jax.model import transformer as model_lib

__all__ = ["ConfigError", "validate_config"]

_POSITIVE_INTS = (
    "total_steps", "diloco.islands", "diloco.inner_steps", "mesh.data",
    "mesh.stage", "data.batch_size", "data.microbatches",
    "data.sequence_length", "eval.batch_size", "eval.num_batches",
    "model.num_layers", "model.d_model", "model.num_heads", "model.head_dim",
    "model.mlp_dim", "model.vocab_size", "model.max_sequence_length")

_INF = float("inf")
# Every other numeric field with a meaningful range: (field, low, high,
# which bounds are included, whether it is an integer).
_RANGES = (
    ("seed", 0, 2**31 - 1, "[]", True),
    ("log_every_seconds", 0, _INF, "[)", False),
    ("inner_optimizer.learning_rate", 0, _INF, "()", False),
    ("inner_optimizer.warmup_steps", 0, _INF, "[)", True),
    ("inner_optimizer.final_learning_rate_fraction", 0, 1, "[]", False),
    ("inner_optimizer.weight_decay", 0, _INF, "[)", False),
    ("inner_optimizer.b1", 0, 1, "[)", False),
    ("inner_optimizer.b2", 0, 1, "[)", False),
    ("inner_optimizer.eps", 0, _INF, "[)", False),
    ("inner_optimizer.grad_clip_norm", 0, _INF, "[)", False),
    ("diloco.outer_optimizer.learning_rate", 0, _INF, "()", False),
    ("diloco.outer_optimizer.momentum", 0, 1, "[)", False),
    ("diloco.outer_optimizer.b1", 0, 1, "[)", False),
    ("diloco.outer_optimizer.b2", 0, 1, "[)", False),
    ("diloco.outer_optimizer.eps", 0, _INF, "[)", False),
    ("diloco.sparseloco.beta", 0, 1, "[)", False),
    ("diloco.sparseloco.alpha", 0, _INF, "()", False),
    ("diloco.sparseloco.density", 0, 1, "()", False),
    ("diloco.sparseloco.chunk_size", 2, 2**24, "[]", True),
    ("diloco.sparseloco.bits", 2, 8, "[]", True),
    ("inner_optimizer.muon.momentum", 0, 1, "[)", False),
    ("inner_optimizer.muon.ns_steps", 1, 20, "[]", True),
    ("inner_optimizer.muon.consistent_rms", 0, _INF, "()", False),
    ("model.rope_base", 0, _INF, "()", False),
    ("checkpoint.max_to_keep", 1, _INF, "[)", True),
    ("checkpoint.every_rounds", 0, _INF, "[)", True),
    ("checkpoint.every_steps", 0, _INF, "[)", True),
)
_FLAGS = ("model.tie_embeddings", "model.remat", "mesh.fsdp",
          "checkpoint.async_save", "diloco.stochastic_rounding",
          "diloco.error_feedback", "resume.from_scratch_if_unreadable",
          "network.link_per_stage")


def validate_config(
    config, num_devices: int,
    elastic: bool = False) -> run_config.RunConfig:
  """The checked `config` as a RunConfig; ConfigError listing every problem.

  The RunConfig holds `config` with the outer optimizer's unset learning
  rate and momentum filled in (overlap_defaults.resolve); `config` itself
  is not changed. A field means the same whoever set it, a config file or
  a --config.* flag: what the config sets is used as it is.

  Args:
    config: a config built from `config_schema.base_config()`.
    num_devices: how many devices the mesh can be built from.
    elastic: whether the run is on elastic islands (python -m
      diloco_jax.elastic), the only runs whose islands the testing hooks
      kill_island, slow_island and island_speeds reach.
  """
  outer = config.diloco.outer_optimizer
  set_outer = {"learning_rate": outer.learning_rate,
               "momentum": outer.momentum}
  config = overlap_defaults.resolve(config)
  problems = Problems()
  problems.require(
      config.mode in config_schema.MODES, "mode",
      f"config.mode={config.mode!r} is not one of {config_schema.MODES}")
  for name in _POSITIVE_INTS:
    problems.positive_int(config, name)
  for name, low, high, bounds, integer in _RANGES:
    problems.number_in(config, name, low, high, bounds, integer)
  for name in _FLAGS:
    problems.one_of(config, name, (True, False))
  _check_mesh(config, num_devices, problems)
  _check_eval(config, problems)
  _check_network(config, problems)
  _check_start(config, problems)
  _check_safety(config, problems)
  _check_elastic_hooks(config, elastic, problems)
  _check_optimizers(config, problems)
  _check_model(config, problems)
  data = _check_data(config, problems)
  diloco_checks.check(config, problems)
  outer_mode_checks.check(config, problems, set_outer)
  pipeline_checks.check(config, problems)
  problems.raise_if_any()
  return run_config.build(
      config, data,
      outer_step=overlap_defaults.describe(config, set_outer))


def _check_elastic_hooks(config, elastic: bool, problems: Problems) -> None:
  """The elastic runs' failure hooks, refused where they would do nothing:
  an SPMD run's islands are one program, so one island cannot die alone."""
  for name in ("kill_island", "slow_island", "island_speeds"):
    problems.require(
        elastic or not config.testing[name], f"testing.{name}",
        f"config.testing.{name}={config.testing[name]!r} is for elastic "
        "islands (python -m diloco_jax.elastic); an SPMD run's islands are "
        "one program")


def _check_mesh(config, num_devices: int, problems: Problems) -> None:
  """The devices an island needs, and the batch's split over them."""
  mesh, batch = config.mesh, config.data.batch_size
  if not problems.ok("mesh.data", "mesh.stage"):
    return
  needed = run_config.devices_per_island(config)
  # Too many devices per island is a problem of mesh.data: what it would
  # split (the batches) is not checked against it again.
  problems.require(
      needed <= num_devices, "mesh.data",
      f"config.mesh.data x config.mesh.stage = {mesh.data} x {mesh.stage} = "
      f"{needed} devices per island, but only {num_devices} are available")
  if not problems.ok("mesh.data", "data.batch_size", "data.microbatches"):
    return
  # A batch that does not split over the devices is one problem, however
  # many microbatches it is cut into.
  if problems.require(
      batch % mesh.data == 0, "data.batch_size",
      f"config.data.batch_size={batch} (per island) is not divisible by "
      f"config.mesh.data={mesh.data}"):
    problems.require(
        batch % (config.data.microbatches * mesh.data) == 0,
        "data.batch_size",
        f"config.data.batch_size={batch} (per island) is not divisible by "
        f"config.data.microbatches x config.mesh.data = "
        f"{config.data.microbatches} x {mesh.data}")


def _check_eval(config, problems: Problems) -> None:
  eval_config = config.eval
  if problems.ok("eval.batch_size", "diloco.islands", "mesh.data", "mode"):
    shards = run_config.effective_islands(config) * config.mesh.data
    problems.require(
        eval_config.batch_size % shards == 0, "eval.batch_size",
        f"config.eval.batch_size={eval_config.batch_size} is not divisible "
        f"by islands x mesh.data = {shards}")
  problems.require(
      _is_int(eval_config.every_rounds) and eval_config.every_rounds >= 0,
      "eval.every_rounds",
      f"config.eval.every_rounds={eval_config.every_rounds!r} must be an "
      "integer >= 0 (0: evaluate at the last step only)")
  problems.require(
      isinstance(eval_config.island_mean, bool), "eval.island_mean",
      f"config.eval.island_mean={eval_config.island_mean!r} must be True or "
      "False")


def _check_network(config, problems: Problems) -> None:
  network = config.network
  problems.require(
      isinstance(network.bandwidth_bits_per_s, (int, float))
      and network.bandwidth_bits_per_s > 0, "network.bandwidth_bits_per_s",
      "config.network.bandwidth_bits_per_s="
      f"{network.bandwidth_bits_per_s!r} must be a number > 0")
  problems.require(
      isinstance(network.latency_s, (int, float)) and network.latency_s >= 0,
      "network.latency_s",
      f"config.network.latency_s={network.latency_s!r} must be a number >= 0")


def _check_start(config, problems: Problems) -> None:
  """pretrain_steps, init_from and the learning rate schedule's length."""
  pretrain = config.pretrain_steps
  if problems.ok("total_steps"):
    problems.require(
        _is_int(pretrain) and 0 <= pretrain < config.total_steps,
        "pretrain_steps",
        f"config.pretrain_steps={pretrain!r} must be an integer in [0, "
        f"config.total_steps={config.total_steps}) (total_steps counts both "
        "phases)")
  problems.require(
      not (pretrain and config.init_from), "init_from",
      "config.pretrain_steps and config.init_from both choose the starting "
      "model; set one")
  schedule_steps = config.inner_optimizer.schedule_steps
  problems.require(
      _is_int(schedule_steps) and schedule_steps >= 0,
      "inner_optimizer.schedule_steps",
      f"config.inner_optimizer.schedule_steps={schedule_steps!r} must be an "
      "integer >= 0 (0: total_steps)")


def _check_safety(config, problems: Problems) -> None:
  """The non-finite policy and the fields a resume may change."""
  problems.require(
      config.nonfinite in guards.POLICIES, "nonfinite",
      f"config.nonfinite={config.nonfinite!r} is not one of "
      f"{guards.POLICIES}")
  problems.require(
      _is_int(config.max_rollbacks) and config.max_rollbacks >= 0,
      "max_rollbacks",
      f"config.max_rollbacks={config.max_rollbacks!r} must be an integer "
      ">= 0")
  names = config_changes.parse_allowed(config.resume.allow_changes)
  problems.require(
      not any(name in config_changes.NEVER_ALLOWED for name in names),
      "resume.allow_changes",
      "config.resume.allow_changes cannot allow 'mode': a checkpoint of "
      "another mode cannot be resumed in place")
  unknown = config_changes.unknown_fields(names, config.to_dict())
  problems.require(
      not unknown, "resume.allow_changes",
      f"config.resume.allow_changes names {', '.join(map(repr, unknown))}, "
      "which is not a config field (use dotted names such as "
      "'total_steps,diloco.codec')")


def _check_optimizers(config, problems: Problems) -> None:
  outer = config.diloco.outer_optimizer
  problems.require(
      outer.name in config_schema.OUTER_OPTIMIZERS,
      "diloco.outer_optimizer.name",
      f"config.diloco.outer_optimizer.name={outer.name!r} is not one of "
      f"{config_schema.OUTER_OPTIMIZERS}")
  inner = config.inner_optimizer
  problems.require(
      inner.name in config_schema.INNER_OPTIMIZERS, "inner_optimizer.name",
      f"config.inner_optimizer.name={inner.name!r} is not one of "
      f"{config_schema.INNER_OPTIMIZERS}")


def _check_model(config, problems: Problems) -> None:
  model = config.model
  problems.one_of(config, "model.dtype", model_lib.DTYPES)
  problems.one_of(config, "model.param_dtype", model_lib.DTYPES)
  if problems.ok("data.sequence_length", "model.max_sequence_length"):
    problems.require(
        config.data.sequence_length <= model.max_sequence_length,
        "data.sequence_length",
        f"config.data.sequence_length={config.data.sequence_length} exceeds "
        f"config.model.max_sequence_length={model.max_sequence_length}")
  name = model.attention
  problems.require(
      name in model_lib.ATTENTION_IMPLEMENTATIONS, "model.attention",
      f"config.model.attention={name!r} is not one of "
      f"{model_lib.ATTENTION_IMPLEMENTATIONS}")
  # cuDNN's other needs matter only where there is cuDNN.
  if name != "cudnn" or not problems.require(
      model_lib.on_nvidia_gpu(), "model.attention",
      "config.model.attention='cudnn' needs an NVIDIA GPU; use 'auto' or "
      "'xla'"):
    return
  problems.require(model.dtype == "bfloat16", "model.attention",
                   "config.model.attention='cudnn' needs config.model.dtype="
                   f"'bfloat16', not {model.dtype!r}")
  problems.require(model.head_dim % 8 == 0 and model.head_dim <= 128,
                   "model.attention",
                   "config.model.attention='cudnn' needs config.model."
                   f"head_dim a multiple of 8 up to 128, not {model.head_dim}")


def _check_data(config, problems: Problems
                ) -> data_settings.DataSettings | None:
  """config.data's settings (None if they have a problem), and the model's
  vocabulary against the corpus's."""
  try:
    data = data_settings.from_config(config.data)
  except data_errors.DataError as e:
    problems.require(False, "data", str(e))
    return None
  if problems.ok("model.vocab_size"):
    problems.require(
        config.model.vocab_size >= data.vocab_size, "model.vocab_size",
        f"config.model.vocab_size={config.model.vocab_size} is smaller than "
        f"the corpus vocabulary ({data.vocab_size} for corpus "
        f"{data.corpus!r})")
  return data


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)
