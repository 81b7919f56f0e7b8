"""What a config's TrainState is made of, and how to build it.

The training loop builds the state it runs; starting from another run's
checkpoint (storage/warm_start.py) rebuilds that run's state from its
saved config to read it back. Both go through `StateSpec`, so the two can never disagree
on the optimizers, codec or island count a config implies.
"""

import dataclasses
from typing import Any

import jax
import optax

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import optimizers
from diloco_jax.algorithm import outer as outer_lib
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.algorithm import stage_fragments
from diloco_jax.algorithm import state as state_lib
from diloco_jax.config import overlap_defaults
from diloco_jax.config import run_config as run_config_lib
from diloco_jax.model import transformer as model_lib
from diloco_jax.parallel.mesh import STAGE
from diloco_jax.parallel import stages as stages_lib


@dataclasses.dataclass(frozen=True)
class StateSpec:
  """A config's optimizers, codec and island count.

  Attributes:
    mode: config.mode.
    islands: the logical islands the state stacks.
    inner_opt: the islands' optimizer (its schedule spans the config's).
    outer_opt: the optimizer of the global params.
    compression: the codec settings (None outside 'diloco').
    error_feedback: whether the state keeps per-island residuals.
    seed: seeds the params and the codec state.
    overlap: one of overlap.OVERLAPS; a delayed one keeps the update in
      flight, and 'one_step_delay_rebase' the islands' anchors too.
    fragments: Streaming DiLoCo's fragment count, or 0 outside streaming
      (the outer optimizer then keeps one state per fragment; with a
      `layout` the fragments are its stages).
    layout: the islands' pipeline stages (config.mesh.stage > 1), or None.
  """
  mode: str
  islands: int
  inner_opt: optax.GradientTransformation
  outer_opt: optax.GradientTransformation
  compression: Any
  error_feedback: bool
  seed: int
  overlap: str = "none"
  fragments: int = 0
  layout: stages_lib.StageLayout | None = None
  outer_overlap: outer_overlaps.Overlap = outer_overlaps.NoOverlap()

  @property
  def outer(self) -> outer_lib.DiLoCo:
    """The run's outer algorithm as the library's object: its outer
    optimizer, codec, error feedback and overlap."""
    return outer_lib.DiLoCo(self.outer_opt,
                            compression_lib.as_compression(self.compression),
                            self.outer_overlap, self.error_feedback)

  def init(self, params) -> state_lib.TrainState:
    """The logical state with every island and x at `params` (traceable)."""
    state = state_lib.init_state(params, self.inner_opt, self.outer,
                                 self.islands, seed=self.seed,
                                 layout=self.layout)
    if self.fragments and self.layout is not None:  # fragment s: stage s
      state = _with_outer_opt_state(state, stage_fragments.init_outer_states(
          params, self.outer_opt, self.layout))
    return state

  def abstract(self, model_config) -> state_lib.TrainState:
    """The logical state's shapes and dtypes, computing nothing."""
    return jax.eval_shape(self.init, model_lib.param_shapes(model_config))

  def staged(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """The state the compiled steps take from a logical one: staged over
    the pipeline stages, or `state` itself (traceable)."""
    if self.layout is None:
      return state
    if not self.fragments:
      return state_lib.stage_state(state, self.layout)
    # One outer state per stage (fragment), stacked along the stage axis.
    staged = state_lib.stage_state(state, self.layout, skip=_OUTER_OPT)
    return _with_outer_opt_state(staged, stage_fragments.stack_outer_states(
        state.outer.outer_opt_state))

  def logical(self, state: state_lib.TrainState,
              logical_shapes: state_lib.TrainState) -> state_lib.TrainState:
    """The logical state checkpoints hold from the steps' one (traceable)."""
    if self.layout is None:
      return state
    if not self.fragments:
      return state_lib.unstage_state(state, self.layout, logical_shapes)
    logical = state_lib.unstage_state(state, self.layout, logical_shapes,
                                      skip=_OUTER_OPT)
    return _with_outer_opt_state(logical, stage_fragments.split_outer_states(
        state.outer.outer_opt_state, self.layout.stages))


# Stage fragments keep one outer state per stage, staged on their own.
_OUTER_OPT = ("outer.outer_opt_state",)


def _with_outer_opt_state(state: state_lib.TrainState,
                          outer_opt_state) -> state_lib.TrainState:
  return state.replace(outer=state.outer.replace(
      outer_opt_state=outer_opt_state))


def for_config(config, islands: int | None = None,
               compression: compression_lib.Compression | None = None
               ) -> StateSpec:
  """The StateSpec of `config` (a run's, or one a checkpoint recorded).

  Args:
    config: a complete config (from base_config, or from_record).
    islands: the logical islands (default: the config's effective count).
    compression: the config's codec if already built (RunConfig's).
  """
  config = overlap_defaults.resolve(config)  # unset outer settings
  mode, diloco = config.mode, config.diloco
  if compression is None and mode == "diloco":
    compression = run_config_lib.compression(diloco)
  layout = run_config_lib.stage_layout(config)
  return StateSpec(
      mode=mode,
      islands=(run_config_lib.effective_islands(config) if islands is None
               else islands),
      inner_opt=optimizers.inner_optimizer(
          run_config_lib.inner_optimizer(config.inner_optimizer),
          config.total_steps, stage_axis=None if layout is None else STAGE),
      outer_opt=optimizers.outer_optimizer(
          run_config_lib.outer_optimizer(diloco.outer_optimizer)),
      compression=compression if mode == "diloco" else None,
      error_feedback=(mode == "diloco"
                      and run_config_lib.keeps_residuals(diloco)),
      seed=config.seed,
      overlap=diloco.overlap if mode == "diloco" else "none",
      fragments=(diloco.fragments if mode == "diloco"
                 and run_config_lib.is_streaming(diloco) else 0),
      layout=layout,
      outer_overlap=(run_config_lib.overlap(diloco) if mode == "diloco"
                     else outer_overlaps.NoOverlap()))



def for_run(run_config: run_config_lib.RunConfig) -> StateSpec:
  """The StateSpec of a validated run config."""
  return for_config(run_config.config, run_config.islands,
                    run_config.compression)
