"""Starting a run from another run's model: config.init_from and
config.pretrain_steps (the DiLoCo paper's protocol).

The model a checkpoint holds is its evaluation params: x for a DiLoCo run,
the worker's params for `single` and `ddp`. A run started from it gives that
model to x and to every island. Every island also gets the source's inner
optimizer state (island 0's) when its structure and shapes match this
config's; otherwise a fresh one, with its step counts set to the
checkpoint's step so the learning rate schedule goes on where it was. The
outer optimizer state, error-feedback residuals and codec state start fresh.
The step count continues too: the run takes steps N+1 .. total_steps, and
the data streams continue from the source's positions where they map onto
this run's islands.

`pretrain_steps = N` is `init_from` of a `single` run of N steps on the same
schedule: that run lives in WORKDIR/pretrain, so either phase resumes on its
own and the result equals running the two by hand.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax.algorithm import optimizers
from diloco_jax.algorithm import state as state_lib
from diloco_jax.config import run_config
from diloco_jax.config import schema as config_schema
from diloco_jax.config import state_spec
from diloco_jax.config import validation
from diloco_jax.model import transformer as model_lib
from diloco_jax.storage import checkpoints as checkpointing
from diloco_jax.storage import layout_records

PRETRAIN_DIR = "pretrain"  # under the workdir


@dataclasses.dataclass(frozen=True)
class Source:
  """A checkpoint to start from: a workdir and a step (None: the newest)."""
  workdir: str
  step: int | None = None

  def __str__(self) -> str:
    where = os.path.join(self.workdir, "checkpoints")
    return where if self.step is None else os.path.join(where, str(self.step))


def parse_source(init_from: str) -> Source:
  """The Source config.init_from names: WORKDIR or WORKDIR/checkpoints/STEP.

  Raises:
    validation.ConfigError: the path holds no checkpoints.
  """
  path = os.path.abspath(init_from)
  parent, name = os.path.split(path)
  if name.isdigit() and os.path.basename(parent) == "checkpoints":
    source = Source(os.path.dirname(parent), int(name))
    found = os.path.isdir(path)
  else:
    source = Source(path)
    found = any(entry.isdigit() for entry in _listdir(
        os.path.join(path, "checkpoints")))
  if not found:
    raise validation.ConfigError(
        f"config.init_from={init_from!r}: no checkpoint there (give a run's "
        "workdir, or WORKDIR/checkpoints/STEP for one step)")
  return source


def _listdir(path: str) -> list[str]:
  return os.listdir(path) if os.path.isdir(path) else []


def has_checkpoints(workdir: str) -> bool:
  """Whether workdir/checkpoints holds a finalized step (orbax names steps
  in progress with a suffix, so only all-digit names are finished)."""
  return any(entry.isdigit()
             for entry in _listdir(os.path.join(workdir, "checkpoints")))


def pretrain_workdir(workdir: str) -> str:
  return os.path.join(workdir, PRETRAIN_DIR)


def pretrain_config(config):
  """The `single` run of the first config.pretrain_steps steps.

  One worker with the per-island batch, on the whole run's learning rate
  schedule, so that its last step is step N of the full run.
  """
  pretrain = config.copy_and_resolve_references()
  pretrain.mode = "single"
  pretrain.total_steps = config.pretrain_steps
  pretrain.pretrain_steps = 0
  pretrain.init_from = ""
  pretrain.diloco.island_schedule = ""  # one worker: no islands to drop
  pretrain.diloco.drop_probability = 0.0
  # One worker has no outer step to overlap, stream or place.
  pretrain.diloco.overlap = "none"
  pretrain.diloco.eager_own_weight = None
  pretrain.diloco.overlap_warmup_rounds = None
  pretrain.diloco.fragments = 1
  pretrain.diloco.fragment_delay = 0
  pretrain.diloco.fragment_alpha = 0.0
  pretrain.diloco.outer_placement = "device"
  pretrain.inner_optimizer.schedule_steps = optimizers.schedule_length(
      run_config.inner_optimizer(config.inner_optimizer), config.total_steps)
  return pretrain


@dataclasses.dataclass(frozen=True)
class WarmStart:
  """A run's first state, made from a source checkpoint's model."""
  step: int
  meta: dict  # the source checkpoint's record (progress, data positions)
  state: state_lib.TrainState
  inner_state_carried: bool

  def record(self, source: Source) -> dict:
    """What summary.json says about where the run started."""
    return {"path": str(source), "step": self.step,
            "mode": self.meta["config"]["mode"],
            "inner_opt_state": ("carried" if self.inner_state_carried
                                else "fresh")}


def _same_per_island(a, b) -> bool:
  """Whether two stacked per-island abstract trees have the same structure
  and, without the island axis, the same shapes and dtypes."""
  island_view = lambda tree: [(x.shape[1:], x.dtype)
                              for x in jax.tree.leaves(tree)]
  return (jax.tree.structure(a) == jax.tree.structure(b)
          and island_view(a) == island_view(b))


def warm_state(source_state: state_lib.TrainState, source_mode: str,
               spec: state_spec.StateSpec, carry_inner_state: bool,
               param_dtypes) -> state_lib.TrainState:
  """The state of `spec` started from `source_state`'s model (traceable).

  Args:
    source_state: the source run's state, at its own island count.
    source_mode: its config.mode (which params are its model).
    spec: this run's state.
    carry_inner_state: give every island the source's island-0 inner
      optimizer state (its structure must match spec.inner_opt's).
    param_dtypes: this run's param dtypes (a tree like the params).
  """
  params = jax.tree.map(lambda p, dtype: p.astype(dtype),
                        state_lib.evaluation_params(source_state, source_mode),
                        param_dtypes)
  state = spec.init(params)
  if carry_inner_state:
    inner = jax.tree.map(
        lambda s: jnp.broadcast_to(s[0], (spec.islands,) + s.shape[1:]),
        source_state.inner_opt_state)
  else:
    inner = optimizers.with_step_counts(state.inner_opt_state,
                                        source_state.step)
  return state.replace(step=source_state.step, inner_opt_state=inner,
                       outer=state.outer.replace(round=source_state.round))


def _newest_readable(source: Source, read_fn):
  """(step, meta, read_fn(step, meta, where)) of the newest checkpoint of
  `source` that reads back; unreadable newer ones are passed over (the
  source's files are never moved).

  Raises:
    checkpointing.UnreadableCheckpointsError: none reads back.
    what read_fn raises to refuse one (another model, no steps left).
  """
  checkpointer = checkpointing.Checkpointer(source.workdir, read_only=True)
  try:
    steps = checkpointer.steps()
    if source.step is not None:
      steps = [s for s in steps if s == source.step]
    found = checkpointer.latest_readable(
        lambda step, meta: read_fn(
            checkpointer, step, meta,
            f"config.init_from: checkpoint {checkpointer.directory}/{step}"),
        steps=steps, refusals=(validation.ConfigError,),
        what="config.init_from")
  finally:
    checkpointer.close()
  if found is None:
    raise checkpointing.IncompatibleCheckpointError(
        f"config.init_from: no checkpoint in {source}")
  return found


def _check_record(step: int, meta: dict, where: str, config) -> None:
  if "config" not in meta:
    raise checkpointing.IncompatibleCheckpointError(
        f"{where} records no config (written by an older version)")
  mismatch = layout_records.shape_mismatch(
      meta["param_shapes"], layout_records.param_shapes_record(
          model_lib.param_shapes(config.model)))
  if mismatch:
    raise checkpointing.IncompatibleCheckpointError(
        f"{where} holds another model: {mismatch} (config.model differs)")
  if step >= config.total_steps:
    raise validation.ConfigError(
        f"config.total_steps={config.total_steps} leaves nothing to train "
        f"after step {step} of {where}")


def check(source: Source, config) -> None:
  """Reads only the records of the checkpoints `source` names and refuses
  what cannot start this run (cheap: for before anything is written).

  Raises:
    checkpointing.IncompatibleCheckpointError: another model, no config
      record; (UnreadableCheckpointsError) no readable record.
    validation.ConfigError: the checkpoint's step leaves no steps to train.
  """
  _newest_readable(source, lambda _, step, meta, where: _check_record(
      step, meta, where, config))


def load(source: Source, spec: state_spec.StateSpec, config, mesh,
         target_shardings) -> WarmStart:
  """Reads `source` and builds this run's first state from it.

  Args:
    spec, config: this run's state and config.
    mesh, target_shardings: where this run's state lives.

  Falls back to the newest checkpoint of `source` whose arrays read back.

  Raises:
    what `check` raises; UnreadableCheckpointsError when no checkpoint's
    arrays read back.
  """
  def read(checkpointer, step, meta, where):
    _check_record(step, meta, where, config)
    return _build(checkpointer, step, meta, where, source, spec,
                  config.model, mesh, target_shardings)

  return _newest_readable(source, read)[2]


def _build(checkpointer, step, meta, where, source, spec, model_config, mesh,
           target_shardings) -> WarmStart:
  target = spec.abstract(model_config)
  source_config = config_schema.from_record(meta["config"])
  source_spec = state_spec.for_config(source_config, islands=meta["islands"])
  source_abstract = source_spec.abstract(source_config.model)
  mismatch = layout_records.layout_mismatch(
      meta["state_layout"], layout_records.state_layout_record(source_abstract))
  if mismatch:
    raise checkpointing.IncompatibleCheckpointError(
        f"{where} cannot be read back from its own config: {mismatch}")
  replicated = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                     sharding=NamedSharding(mesh, P())),
      source_abstract)
  saved = checkpointer.restore_state(step, replicated,
                                     meta.get(checkpointing.CHECKSUMS))
  carried = _same_per_island(source_abstract.inner_opt_state,
                             target.inner_opt_state)
  param_dtypes = jax.tree.map(lambda a: a.dtype, target.global_params)
  state = jax.jit(
      lambda s: warm_state(s, source_spec.mode, spec, carried, param_dtypes),
      out_shardings=target_shardings)(saved)
  logging.info(
      "starting from %s (a %r run at step %d): its model for x and every "
      "island; inner optimizer state %s", source, source_spec.mode, step,
      "carried from its island 0" if carried else
      "fresh (another structure in this config), schedule at its step")
  return WarmStart(step, meta, state, carried)
