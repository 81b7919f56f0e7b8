"""What a config stands for, as typed values built once.

validation.validate_config checks a config and returns a `RunConfig`: the
config frozen, with what the layers below need already parsed from it: the
islands, the codec, the schedule of syncs, the participating islands, the
data settings. The run layer hands those down; nothing below re-reads
strings from the config. The builders here also serve configs that are not
a run's own (a warm start's source, experiments, benchmarks).
"""

import dataclasses

import ml_collections

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import library
from diloco_jax.algorithm import optimizers
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.algorithm import participation as participation_lib
from diloco_jax.algorithm import schedule as schedule_lib
from diloco_jax.config import overlap_defaults
from diloco_jax.data import settings as data_settings
from diloco_jax.parallel import stages as stages_lib


@dataclasses.dataclass(frozen=True)
class DiLoCoSettings:
  """config.diloco as the run layer reads it, typed once.

  Attributes:
    inner_steps: H, the inner steps of a round.
    overlap: the outer object's overlap (outer_overlaps.py; Streaming
      DiLoCo's fragments included).
    overlap_mode: config.diloco.overlap, 'none' outside 'diloco' (for
      records, logs and telemetry/rising_loss.py's warning).
    codec: config.diloco.codec, 'fp32' outside 'diloco' (for records and
      logs).
    outer_placement: 'device' or 'host'.
    fragments: Streaming DiLoCo's P, or None outside streaming.
    fragment_alpha: the islands' own weight in a fragment's merge.
    rounding_seed: the codec's stochastic rounding seed, or None (round to
      nearest).
    restart_dropped: an island left out of a round restarts its inner
      state (config.diloco.dropped_islands='idle').
    dropped_islands: config.diloco.dropped_islands (for messages;
      restart_dropped is what it decides).
    reset_inner: every island restarts its inner state each round
      (config.diloco.inner_state='reset').
    island_schedule: config.diloco.island_schedule ('' for every island).
    outer_optimizer: config.diloco.outer_optimizer, its unset fields
      filled in (overlap_defaults.resolve).
  """
  inner_steps: int
  overlap: outer_overlaps.Overlap
  overlap_mode: str
  codec: str
  outer_placement: str
  fragments: int | None
  fragment_alpha: float
  rounding_seed: int | None
  restart_dropped: bool
  dropped_islands: str
  reset_inner: bool
  island_schedule: str
  outer_optimizer: optimizers.OuterSettings


def diloco_settings(config) -> DiLoCoSettings:
  """The DiLoCoSettings of a checked config (its outer step's overlap:
  none outside 'diloco')."""
  d = config.diloco
  diloco_mode = config.mode == "diloco"
  return DiLoCoSettings(
      inner_steps=d.inner_steps,
      overlap=overlap(d) if diloco_mode else outer_overlaps.no_overlap(),
      overlap_mode=d.overlap if diloco_mode else "none",
      codec=d.codec if diloco_mode else "fp32",
      outer_placement=d.get("outer_placement", "device"),
      fragments=(d.fragments if diloco_mode and is_streaming(d) else None),
      fragment_alpha=d.fragment_alpha,
      rounding_seed=config.seed if d.stochastic_rounding else None,
      restart_dropped=d.dropped_islands == "idle",
      dropped_islands=d.dropped_islands,
      reset_inner=d.inner_state == "reset",
      island_schedule=d.island_schedule,
      outer_optimizer=outer_optimizer(d.outer_optimizer))


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A checked config and what it stands for.

  Attributes:
    config: every field, frozen (ml_collections.FrozenConfigDict).
    islands: the logical islands the run uses (1 for `single`).
    compression: the codec of DiLoCo's syncs (None outside 'diloco').
    schedule: what runs after each inner step.
    participation: participation(step) -> the islands synced at the end of
      that step's round.
    nan_island: config.testing.nan_island as (island, 1-based round), or
      None.
    data: config.data's settings.
    streaming: whether the run is Streaming DiLoCo.
    outer_step: the outer step and why, for the log ('' outside DiLoCo;
      overlap_defaults.describe).
    diloco: config.diloco, typed.
  """
  config: ml_collections.FrozenConfigDict
  islands: int
  compression: compression_lib.Compression | None
  schedule: schedule_lib.Schedule
  participation: participation_lib.Participation
  nan_island: tuple[int, int] | None
  data: data_settings.DataSettings
  streaming: bool
  outer_step: str = ""
  diloco: DiLoCoSettings | None = None

  @property
  def host_outer(self) -> bool:
    """Whether the outer step runs on devices of its own."""
    return self.diloco.outer_placement == "host"


def build(config, data: data_settings.DataSettings,
          outer_step: str = "") -> RunConfig:
  """The RunConfig of a config validation has checked (`outer_step`: its
  line for the log)."""
  frozen = ml_collections.FrozenConfigDict(config)
  islands = effective_islands(frozen)
  nan_island = frozen.testing.nan_island
  return RunConfig(
      config=frozen, islands=islands,
      compression=(compression(frozen.diloco) if frozen.mode == "diloco"
                   else None),
      schedule=schedule(frozen), participation=participation(frozen, islands),
      nan_island=(participation_lib.parse_nan_island(nan_island, islands)
                  if nan_island else None),
      data=data, streaming=is_streaming(frozen.diloco),
      outer_step=outer_step, diloco=diloco_settings(frozen))


def effective_islands(config) -> int:
  """Islands actually used: `single` mode is one worker whatever the
  config says."""
  return 1 if config.mode == "single" else config.diloco.islands


def devices_per_island(config) -> int:
  """data x stage: the devices one island needs (islands fold onto them)."""
  return config.mesh.data * config.mesh.stage


def pipeline_microbatches(config) -> int:
  """M, the microbatches an island's pipeline runs per inner step:
  config.pipeline.microbatches, or where it is 0 the largest count up to
  2 x mesh.stage that splits both pipeline_rows evenly.

  A count is a multiple of mesh.stage (each stage scores the head of M /
  stage of them), so the default is 2 x stage where that fits and stage
  otherwise; where stage does not divide the rows either, no count does
  (validation refuses the batch, naming it), and this gives 2 x stage.
  """
  if config.pipeline.microbatches:
    return config.pipeline.microbatches
  stages = config.mesh.stage
  rows = pipeline_rows(config)
  for count in (2 * stages, stages):
    if all(r % count == 0 for r in rows):
      return count
  return 2 * stages


def pipeline_rows(config) -> tuple[int, int]:
  """The sequences a pipeline pass cuts into microbatches: (training:
  the island's batch per data.microbatches part and mesh.data device,
  evaluation: the batch per evaluated model and mesh.data device). DiLoCo
  scores x on the whole eval batch; ddp and single score each island's
  share with its own params."""
  data = config.mesh.data
  per_model = (config.eval.batch_size if config.mode == "diloco" else
               config.eval.batch_size // effective_islands(config))
  return (config.data.batch_size // (config.data.microbatches * data),
          per_model // data)


def pipeline_repeats(config) -> int:
  """R, the passes around the stages: config.pipeline.repeats for the
  circular schedule, 1 for GPipe."""
  return (config.pipeline.repeats if config.pipeline.schedule == "circular"
          else 1)


def stage_layout(config) -> stages_lib.StageLayout | None:
  """The pipeline stages config.mesh.stage and config.pipeline ask for,
  or None for islands of one stage."""
  if config.mesh.stage == 1:
    return None
  return stages_lib.StageLayout(config.mesh.stage, pipeline_repeats(config),
                                config.model.num_layers)


def is_streaming(diloco_config) -> bool:
  """Whether config.diloco asks for Streaming DiLoCo: several fragments, a
  delayed merge or a blended one (one fragment with tau = 0 and alpha = 0
  is DiLoCo's own outer step)."""
  return (diloco_config.fragments > 1 or diloco_config.fragment_delay > 0
          or diloco_config.fragment_alpha > 0)


def overlap(diloco_config) -> outer_overlaps.Overlap:
  """The outer object's overlap config.diloco describes: Streaming
  DiLoCo's fragments, or config.diloco.overlap with eager updates' own
  weight and warm-up rounds (their defaults where unset)."""
  d = diloco_config
  if is_streaming(d):
    return outer_overlaps.streaming(d.fragments, d.fragment_delay,
                                    d.fragment_alpha)
  return outer_overlaps.from_mode(d.overlap, d.get("eager_own_weight"),
                                  overlap_defaults.warmup_rounds(d))


def compression(diloco_config) -> compression_lib.Compression:
  """The Compression config.diloco describes (codec and settings), built
  as the library builds one (library.codec)."""
  c = diloco_config
  if c.outer_optimizer.name == compression_lib.SPARSELOCO:
    s = c.sparseloco
    return library.codec(compression_lib.SPARSELOCO,
                         block_size=c.codec_block_size,
                         chunk_size=s.chunk_size, density=s.density,
                         bits=s.bits, beta=s.beta)
  return library.codec(
      c.codec, block_size=c.codec_block_size, fallback=c.fallback_codec,
      prune_rate=c.prune_rate, topk_fraction=c.topk_fraction,
      rank=(c.lowrank.max_rank if c.codec == "adaptive_lowrank"
            else c.lowrank.rank),
      min_rank=c.lowrank.min_rank, energy_fraction=c.lowrank.energy_fraction,
      factor_codec=c.lowrank.factor_codec)


def inner_optimizer(inner_config) -> optimizers.InnerSettings:
  """The InnerSettings of config.inner_optimizer."""
  muon = inner_config.muon
  return _typed(optimizers.InnerSettings, inner_config,
                muon=optimizers.MuonSettings(
                    momentum=muon.momentum, ns_steps=muon.ns_steps,
                    consistent_rms=muon.consistent_rms))


def outer_optimizer(outer_config) -> optimizers.OuterSettings:
  """The OuterSettings of config.diloco.outer_optimizer, once
  overlap_defaults.resolve has filled in its unset fields (momentum may
  stay unset, read as 0, for an optimizer without one)."""
  if outer_config.learning_rate is None:
    raise ValueError("config.diloco.outer_optimizer.learning_rate is unset; "
                     "overlap_defaults.resolve(config) fills it in")
  return _typed(optimizers.OuterSettings, outer_config,
                momentum=outer_config.momentum or 0.0)


def _typed(settings_class, section, **given):
  """settings_class built from the section's fields of the same names,
  with `given` in place of the section's."""
  return settings_class(**{
      field.name: given[field.name] if field.name in given
      else section[field.name]
      for field in dataclasses.fields(settings_class)})


def keeps_residuals(diloco_config) -> bool:
  """Whether islands keep what the codec did not send (error feedback):
  asked for, or SparseLoCo's (its residual is the outer momentum)."""
  return bool(diloco_config.error_feedback
              or diloco_config.outer_optimizer.name
              == compression_lib.SPARSELOCO)


def schedule(config) -> schedule_lib.Schedule:
  """The Schedule of a run's config."""
  d = config.diloco
  return schedule_lib.Schedule(
      mode=config.mode, inner_steps=d.inner_steps,
      total_steps=config.total_steps, overlap=d.overlap,
      fragments=d.fragments, fragment_delay=d.fragment_delay,
      streaming=is_streaming(d), eval_every_rounds=config.eval.every_rounds,
      checkpoint_every_rounds=config.checkpoint.every_rounds,
      checkpoint_every_steps=config.checkpoint.every_steps)


def participation(config, islands: int
                  ) -> participation_lib.Participation:
  """Which of `islands` take part in each round under `config`. Rounds
  count from the end of the pretraining (config.pretrain_steps); outside
  DiLoCo every island takes part."""
  d = config.diloco
  first_round = -(-config.pretrain_steps // d.inner_steps)
  return participation_lib.Participation(
      num_islands=islands, inner_steps=d.inner_steps,
      schedule=(participation_lib.parse_schedule(d.island_schedule, islands)
                if d.island_schedule else None),
      drop_probability=d.drop_probability, seed=config.seed,
      first_round=first_round,
      num_rounds=-(-config.total_steps // d.inner_steps) - first_round,
      synced=config.mode == "diloco")
