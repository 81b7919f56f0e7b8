"""Checks of pipeline-parallel islands (config.mesh.stage > 1 and
config.pipeline): what the stages split, what the microbatches divide, and
what the stages cannot be combined with (validation.py collects them)."""

from diloco_jax.config.problems import Problems
from diloco_jax.config import run_config
from diloco_jax.parallel import pipeline


def check(config, problems: Problems) -> None:
  """Every check of config.pipeline and of what mesh.stage asks of others."""
  if not problems.ok("mesh.stage"):
    return
  if config.mesh.stage == 1:
    _check_unused(config, problems)
    return
  if _check_fields(config, problems):
    _check_splits(config, problems)
    _check_batches(config, problems)
  _check_composes(config, problems)


def _check_unused(config, problems: Problems) -> None:
  """Pipeline settings without stages would be ignored: refused."""
  settings = config.pipeline
  for field, default in (("schedule", "gpipe"), ("repeats", 1),
                         ("microbatches", 0)):
    problems.require(
        settings[field] == default, f"pipeline.{field}",
        f"config.pipeline.{field}={settings[field]!r} applies to islands of "
        "several pipeline stages; config.mesh.stage=1 (set mesh.stage, or "
        f"leave pipeline.{field} at {default!r})")


def _check_fields(config, problems: Problems) -> bool:
  """The fields' own values; whether they all passed."""
  settings = config.pipeline
  ok = problems.one_of(config, "pipeline.schedule", pipeline.SCHEDULES)
  ok &= problems.positive_int(config, "pipeline.repeats")
  ok &= problems.number_in(config, "pipeline.microbatches", 0, float("inf"),
                           "[)", integer=True)
  if not ok:
    return False
  if settings.schedule == "gpipe":
    ok &= problems.require(
        settings.repeats == 1, "pipeline.repeats",
        f"config.pipeline.repeats={settings.repeats} is the circular "
        "schedule's; config.pipeline.schedule='gpipe' passes once (set "
        "schedule='circular' or repeats=1)")
  else:
    ok &= problems.require(
        settings.repeats >= 2, "pipeline.repeats",
        f"config.pipeline.schedule='circular' needs pipeline.repeats >= 2 "
        f"(got {settings.repeats}; 1 is 'gpipe')")
  stages, microbatches = config.mesh.stage, run_config.pipeline_microbatches(
      config)
  ok &= problems.require(
      microbatches % stages == 0, "pipeline.microbatches",
      f"config.pipeline.microbatches={microbatches} is not a multiple of "
      f"config.mesh.stage={stages} (each stage scores the head of "
      "microbatches / stage of them)")
  return ok


def _check_splits(config, problems: Problems) -> None:
  """Layers into stage x repeats chunks; the other leaves into pieces."""
  model, stages = config.model, config.mesh.stage
  repeats = run_config.pipeline_repeats(config)
  if problems.ok("model.num_layers"):
    problems.require(
        model.num_layers % (stages * repeats) == 0, "model.num_layers",
        f"config.model.num_layers={model.num_layers} does not split into "
        f"config.mesh.stage x repeats = {stages} x {repeats} chunks of "
        "consecutive layers (set --config.model.num_layers to a multiple "
        f"of {stages * repeats})")
  if problems.ok("model.d_model"):
    problems.require(
        model.d_model % stages == 0, "model.d_model",
        f"config.model.d_model={model.d_model} is not divisible by "
        f"config.mesh.stage={stages} (the embedding, final norm and head "
        "are cut into one piece per stage along it)")


def _check_batches(config, problems: Problems) -> None:
  """The batches cut into pipeline microbatches (run_config.pipeline_rows:
  per data.microbatches part and mesh.data device; per evaluated model).

  A count of microbatches is a multiple of mesh.stage, so where stage
  does not divide a batch's rows no count does, and the batch is refused;
  otherwise the default count fits, and only a count set explicitly can
  be refused, naming one that fits.
  """
  if not problems.ok("data.batch_size", "data.microbatches", "mesh.data",
                     "eval.batch_size", "diloco.islands", "mode"):
    return
  stages = config.mesh.stage
  microbatches = run_config.pipeline_microbatches(config)
  rows = run_config.pipeline_rows(config)
  # The counts up to the one set that split both batches' rows.
  fits = [count for count in range(stages, min(microbatches, *rows) + 1,
                                   stages)
          if all(r % count == 0 for r in rows)]
  for field, per, row in zip(
      ("data.batch_size", "eval.batch_size"),
      ("island per data.microbatches part and mesh.data device",
       "evaluated model and mesh.data device"), rows):
    value = config[field.split(".")[0]].batch_size
    if row % stages:
      problems.require(
          False, field,
          f"config.{field}={value} gives {row} sequences per {per}, which "
          f"no count of pipeline microbatches divides (a count is a "
          f"multiple of config.mesh.stage={stages}: each stage scores the "
          f"head of count / stage of them); set --config.{field} to a "
          f"multiple of {stages * (value // row)}")
    elif row % microbatches and config.pipeline.microbatches:
      # (The default count fits whatever mesh.stage divides.)
      problems.require(
          False, "pipeline.microbatches",
          f"config.pipeline.microbatches={microbatches} does not divide the "
          f"{row} sequences per {per} (config.{field}={value}); set "
          f"--config.pipeline.microbatches={fits[-1] if fits else stages}, "
          "or 0 for the largest count up to 2 x mesh.stage that fits")


def _check_composes(config, problems: Problems) -> None:
  """What pipelined islands ask of the settings they combine with."""
  stages, diloco = config.mesh.stage, config.diloco
  if run_config.is_streaming(diloco) and problems.ok("diloco.fragments"):
    # Each stage syncs what it holds on its own offset (its layers and its
    # piece of the embedding, norm and head): a fragment is a stage.
    problems.require(
        diloco.fragments == stages, "diloco.fragments",
        f"config.diloco.fragments={diloco.fragments} with config.mesh.stage="
        f"{stages}: on pipelined islands each stage is one Streaming DiLoCo "
        "fragment (its layers and its piece of the embedding, final norm "
        f"and head), so set --config.diloco.fragments={stages}")
