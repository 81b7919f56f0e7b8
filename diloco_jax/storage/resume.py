"""Resuming a run: its newest readable checkpoint, checked against the
config, at the island count there is now, and its data streams' positions.

A checkpoint written under a config that changes the run's meaning is
refused (ConfigChangedError) unless config.resume.allow_changes names the
changes, before any array is read; one of another model or state layout
can never be resumed in place.
"""

import json

import jax
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax.algorithm import state as state_lib
from diloco_jax.config import changes as config_changes
from diloco_jax.config import run_config as run_config_lib
from diloco_jax.config import schema as config_schema
from diloco_jax.parallel import placement
from diloco_jax.storage import checkpoints as checkpointing
from diloco_jax.storage import layout_records


class ConfigChangedError(checkpointing.IncompatibleCheckpointError):
  """Resuming under a config that changes the run's meaning, not allowed."""


def refuse_config_changes(path: str, meta: dict, config,
                          streaming: bool) -> None:
  """Raises ConfigChangedError for changes resume.allow_changes lacks.

  Args:
    path: the checkpoint's directory (WORKDIR/checkpoints/STEP).
    streaming: whether this run is Streaming DiLoCo (its fragments follow
      config.mesh.stage).
  """
  where = f"checkpoint {path}"
  if "config" not in meta:
    return
  refused = config_changes.refused(
      config_changes.changes(meta["config"], config_record(config)),
      config.resume.allow_changes)
  if any(c["field"] in config_changes.NEVER_ALLOWED for c in refused):
    raise ConfigChangedError(
        f"{where} was written by a {meta['config']['mode']!r} run; a "
        f"checkpoint of another mode cannot be resumed as config.mode="
        f"{config.mode!r} in place (ddp and single runs never update the "
        "global params that every island would start from); to start from "
        f"its model, use another --workdir with --config.init_from={path}")
  saved_stages = meta["config"].get("mesh", {}).get("stage", 1)
  if streaming and saved_stages != config.mesh.stage:
    # Fragment s is stage s, with an outer state per stage: another stage
    # count is another split of the model into fragments.
    raise ConfigChangedError(
        f"{where} was written by Streaming DiLoCo with config.mesh.stage="
        f"{saved_stages}; its fragments (one per stage on pipelined "
        "islands) and their outer states do not carry over to config.mesh."
        f"stage={config.mesh.stage}: resume with --config.mesh.stage="
        f"{saved_stages}, or start another --workdir with --config.init_from="
        f"{path}")
  if refused:
    names = ",".join(c["field"] for c in refused)
    raise ConfigChangedError(
        f"{where} was written with another config: "
        f"{config_changes.describe(refused)}; rerun with the checkpoint's "
        f"values, use another workdir, or allow the change with "
        f"--config.resume.allow_changes={names}")


def config_record(config) -> dict:
  return json.loads(config.to_json_best_effort())


def restore_latest(checkpointer, config, abstract_state, mesh, spec,
                   islands: int, compare_config: bool = True):
  """Restores the newest readable checkpoint, adapting the island count
  and the pipeline stages (`spec`: this run's state_spec.StateSpec).

  Checkpoints hold the logical state, whatever the stages, except the
  codec's state, which is per stage: resumed with another
  config.mesh.stage, a codec that keeps state (the low-rank bases and
  ranks) starts it afresh.

  Returns:
    (step, meta, state), or None when there is no checkpoint (or none
    reads back, under config.resume.from_scratch_if_unreadable).

  Raises:
    checkpointing.UnreadableCheckpointsError: checkpoints exist but none
      reads back.
    checkpointing.IncompatibleCheckpointError: the checkpoint was written for
      a model of another shape, or (ConfigChangedError) with a config whose
      meaning differs, when compare_config (checked before any array is
      read).
  """
  current_shapes = layout_records.param_shapes_record(
      abstract_state.global_params)
  target_shardings = state_lib.state_shardings(abstract_state, mesh,
                                               config.mesh.fsdp, staged=False)

  def restore(step, meta):
    path = f"{checkpointer.directory}/{step}"
    where = f"checkpoint {path}"
    if compare_config:
      refuse_config_changes(path, meta, config,
                            streaming=bool(spec.fragments))
    mismatch = layout_records.shape_mismatch(meta["param_shapes"],
                                            current_shapes)
    if mismatch:
      raise checkpointing.IncompatibleCheckpointError(
          f"{where} was written for another model: {mismatch} "
          "(config.model differs)")
    # The codec state as the checkpoint's stages shaped it.
    saved_codec = _saved_codec_state(meta, abstract_state, spec)
    expected = _with_codec_state(abstract_state, saved_codec)
    mismatch = layout_records.layout_mismatch(
        meta["state_layout"], layout_records.state_layout_record(expected))
    if mismatch:
      raise checkpointing.IncompatibleCheckpointError(
          f"{where} has another state layout: {mismatch} (config.diloco."
          "outer_optimizer, config.inner_optimizer, config.diloco.codec "
          "settings, config.diloco.error_feedback or config.diloco.overlap "
          "differ)")
    if saved_codec is abstract_state.outer.codec_state:
      return _restore_islands(checkpointer, step, meta, abstract_state, mesh,
                              spec.inner_opt, islands, target_shardings)
    saved_shardings = _with_codec_state(target_shardings, jax.tree.map(
        lambda _: NamedSharding(mesh, P()), saved_codec))
    state = _restore_islands(checkpointer, step, meta, expected, mesh,
                             spec.inner_opt, islands, saved_shardings)
    return _with_fresh_codec_state(state, spec, target_shardings)

  return checkpointer.latest_readable(
      restore, start_over_if_unreadable=(
          config.resume.from_scratch_if_unreadable))


def _saved_codec_state(meta: dict, abstract_state, spec):
  """The codec state's shapes in the checkpoint: this run's, unless it
  was written with other pipeline stages and the codec keeps state."""
  saved_config = meta.get("config", {})
  saved_stages = saved_config.get("mesh", {}).get("stage", 1)
  stages = 1 if spec.layout is None else spec.layout.stages
  if abstract_state.outer.codec_state is None or saved_stages == stages:
    return abstract_state.outer.codec_state
  saved_layout = run_config_lib.stage_layout(
      config_schema.from_record(saved_config))
  return jax.eval_shape(
      lambda x: state_lib.init_codec_state(x, spec.compression, spec.seed,
                                           saved_layout),
      abstract_state.global_params)


def _with_fresh_codec_state(state, spec, target_shardings):
  """`state` with its codec state initialized for this run's stages (at
  its x), logged."""
  logging.warning("the codec's state (low-rank bases and ranks) is per "
                  "pipeline stage: it starts afresh for this run's stages")
  return jax.jit(lambda s: _with_codec_state(s, state_lib.init_codec_state(
      s.global_params, spec.compression, spec.seed, spec.layout)),
                 out_shardings=target_shardings)(state)


def _with_codec_state(state, codec_state):
  return state.replace(outer=state.outer.replace(codec_state=codec_state))


def _restore_islands(checkpointer, step: int, meta: dict, abstract_state,
                     mesh, inner_opt, islands: int, target_shardings):
  """The checkpoint's state at this run's island count: read as it is,
  or at its own island count and resized."""
  saved_islands = meta["islands"]
  checksums = meta.get(checkpointing.CHECKSUMS)
  if saved_islands == islands:
    return checkpointer.restore_state(
        step, placement.with_shardings(abstract_state, target_shardings),
        checksums)
  # Read at the saved island count, replicated, then resize and reshard.
  saved_abstract = jax.eval_shape(
      lambda s: state_lib.resize_islands(s, saved_islands, inner_opt),
      abstract_state)
  replicated = jax.tree.map(lambda _: NamedSharding(mesh, P()),
                            saved_abstract)
  saved = checkpointer.restore_state(
      step, placement.with_shardings(saved_abstract, replicated), checksums)
  logging.warning(
      "resuming with %d islands from a checkpoint of %d: %s", islands,
      saved_islands,
      f"islands {islands}..{saved_islands - 1} are dropped with their "
      "progress since the last outer step" if islands < saved_islands else
      f"islands {saved_islands}..{islands - 1} start from the global params"
      " with fresh inner optimizer state")
  return jax.jit(lambda s: state_lib.resize_islands(s, islands, inner_opt),
                 out_shardings=target_shardings)(saved)


def restore_data_positions(batches, meta: dict, islands: int) -> None:
  """Puts the data streams where the checkpoint left them, if they map."""
  if "data" not in meta:
    return
  if meta["islands"] == islands or "step" in meta["data"]:
    batches.restore(meta["data"])
  else:  # per-island read positions do not map onto another island count
    logging.warning("data streams restart for the new island count")
