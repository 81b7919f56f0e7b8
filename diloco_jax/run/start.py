"""Where a run starts: its newest readable checkpoint (`restore`), or, on a
first start, fresh params or another run's model (`first_start`)."""

import dataclasses

import jax

from diloco_jax.algorithm import state as state_lib
from diloco_jax.model import transformer as model_lib
from diloco_jax.run import setup as setup_lib
from diloco_jax.storage import resume
from diloco_jax.storage import warm_start
from diloco_jax.telemetry import counters as progress_lib


@dataclasses.dataclass
class Start:
  """Where a run's loop starts.

  Attributes:
    step: the last step the state has taken.
    meta: the checkpoint's metadata ({} for a first start).
    state: the whole state, as checkpoints hold it.
    progress: the run's counters at `step`.
    restored: whether `state` is this run's own checkpoint.
  """
  step: int
  meta: dict
  state: state_lib.TrainState
  progress: progress_lib.Progress
  restored: bool


def first_start(setup: setup_lib.RunSetup,
                source: warm_start.Source | None) -> Start:
  """A run's first start (also where a rollback finds no checkpoint):
  fresh params, or `source`'s model."""
  config = setup.config
  if source is None:
    # Params are created on their devices, already sharded.
    with model_lib.fast_init_compile():
      state = jax.jit(
          lambda seed: setup.spec.init(model_lib.new_params(config.model,
                                                            seed)),
          out_shardings=setup.state_shardings)(config.seed)
    return Start(0, {}, state, progress_lib.Progress(setup.islands),
                 restored=False)
  start = warm_start.load(source, setup.spec, config, setup.mesh,
                          setup.state_shardings)
  meta = start.meta
  progress = progress_lib.Progress(
      setup.islands, rounds_done=meta.get("rounds_done", 0),
      tokens_seen=meta.get("tokens_seen", 0),
      initialized_from=start.record(source))
  return Start(start.step, meta, start.state, progress, restored=False)


def restore(setup: setup_lib.RunSetup, checkpointer,
            compare_config: bool = True) -> Start | None:
  """The newest readable checkpoint of this run, or None (see
  resume.restore_latest for what it refuses)."""
  restored = resume.restore_latest(
      checkpointer, setup.config, setup.abstract_state, setup.mesh,
      setup.spec, setup.islands, compare_config=compare_config)
  if restored is None:
    return None
  step, meta, state = restored
  return Start(step, meta, state,
               progress_lib.Progress.from_meta(meta, setup.islands),
               restored=True)
