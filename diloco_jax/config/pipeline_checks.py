"""Checks of pipeline-parallel islands (config.mesh.stage > 1 and
config.pipeline): what the stages split, what the microbatches divide, and
what the stages cannot be combined with (validation.py collects them)."""

from diloco_jax.config import run_config
from diloco_jax.config.problems import Problems
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
        "consecutive layers")
  if problems.ok("model.d_model"):
    problems.require(
        model.d_model % stages == 0, "model.d_model",
        f"config.model.d_model={model.d_model} is not divisible by "
        f"config.mesh.stage={stages} (the embedding, final norm and head "
        "are cut into one piece per stage along it)")


def _check_batches(config, problems: Problems) -> None:
  """The batches cut into microbatches split over the 'data' devices."""
  if not problems.ok("data.batch_size", "data.microbatches", "mesh.data",
                     "eval.batch_size", "diloco.islands", "mode"):
    return
  microbatches = run_config.pipeline_microbatches(config)
  parts = config.data.microbatches * microbatches * config.mesh.data
  problems.require(
      config.data.batch_size % parts == 0, "pipeline.microbatches",
      f"config.data.batch_size={config.data.batch_size} (per island) is not "
      "divisible by data.microbatches x pipeline microbatches x mesh.data = "
      f"{config.data.microbatches} x {microbatches} x {config.mesh.data}")
  # DiLoCo scores x on the whole eval batch; ddp and single score each
  # island's share with its own params.
  per_model = (config.eval.batch_size if config.mode == "diloco" else
               config.eval.batch_size // run_config.effective_islands(config))
  problems.require(
      per_model % (microbatches * config.mesh.data) == 0, "eval.batch_size",
      f"config.eval.batch_size={config.eval.batch_size} gives {per_model} "
      "sequences per evaluated model, not divisible by pipeline "
      f"microbatches x mesh.data = {microbatches} x {config.mesh.data}")


def _check_composes(config, problems: Problems) -> None:
  """What pipelined islands cannot be combined with."""
  stages, diloco = config.mesh.stage, config.diloco
  problems.require(
      diloco.outer_placement != "host", "diloco.outer_placement",
      f"config.diloco.outer_placement='host' gathers each island's whole "
      f"model on one outer device; config.mesh.stage={stages} splits it "
      "over the stages (use outer_placement='device': each stage's outer "
      "step runs on its own devices)")
  problems.require(
      not run_config.is_streaming(diloco), "diloco.fragments",
      "config.diloco.fragments, fragment_delay and fragment_alpha (Streaming "
      f"DiLoCo) are not implemented for config.mesh.stage={stages}; use "
      "mesh.stage=1, or DiLoCo with overlap='one_step_delay'")
