"""What a run is built from before its first step, and where it starts.

`build` makes a run's mesh, data streams, state layout and (with
config.diloco.outer_placement='host') the outer side; a `RunSetup` then
gives the state a run starts from: the newest readable checkpoint
(`restore`), or fresh params or another run's model (`first_start`).
"""

import dataclasses
import functools
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from diloco_jax.run import progress as progress_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.model import transformer as model_lib
from diloco_jax.parallel import multihost
from diloco_jax.run import host_outer as host_outer_lib
from diloco_jax.parallel import placement
from diloco_jax.run import programs as programs_lib
from diloco_jax.run import resume
from diloco_jax.algorithm import schedule as schedule_lib
from diloco_jax.run import state_spec as state_spec_lib
from diloco_jax.config import validation
from diloco_jax.run import warm_start
from diloco_jax.data import sources


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


@dataclasses.dataclass(frozen=True)
class RunSetup:
  """A run's mesh, data, state layout and outer side.

  Attributes:
    config: the run's config.
    islands: k, the logical islands.
    mesh: the compute mesh ('island', 'data', 'stage').
    batch_shape, eval_shape, weights_shape: abstract training batch, eval
      batch and outer-mean island weights, with their shardings.
    held: the islands whose data this process reads.
    batches: this process's islands' training batches.
    eval_set: the eval batches (host arrays).
    island_shares: each island's share of the corpus, times k (1 for iid
      islands): the outer mean weights islands by it.
    spec: the state's optimizers and codec.
    abstract_state: the whole state's shapes.
    state_shardings: where the whole state lives on `mesh`.
    loss_fn: loss_fn(params, batch) of the model.
    host_outer: the outer side with outer_placement='host', else None.
  """
  config: Any
  islands: int
  mesh: jax.sharding.Mesh
  batch_shape: jax.ShapeDtypeStruct
  eval_shape: jax.ShapeDtypeStruct
  weights_shape: jax.ShapeDtypeStruct
  held: range
  batches: sources.BatchSource
  eval_set: list
  island_shares: np.ndarray
  spec: state_spec_lib.StateSpec
  abstract_state: state_lib.TrainState
  state_shardings: Any
  loss_fn: Any
  host_outer: host_outer_lib.OuterSide | None

  @property
  def num_params(self) -> int:
    return sum(int(np.prod(x.shape))
               for x in jax.tree.leaves(self.abstract_state.global_params))

  def place_batch(self, batch: np.ndarray) -> jax.Array:
    """The global training batch from this process's islands' rows."""
    return multihost.global_batch(batch, self.batch_shape.sharding,
                                  self.batch_shape.shape)

  def islands_side(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """The state the islands train (with 'host', the outer fields go to
    the outer devices)."""
    return state if self.host_outer is None else self.host_outer.load(state)

  def whole(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """The whole state, as checkpoints hold it."""
    return (state if self.host_outer is None
            else self.host_outer.assemble(state))

  def evaluated(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """The state to evaluate: with the outer side's current x."""
    return (state if self.host_outer is None
            else self.host_outer.current(state))

  def compile_in_background(self):
    """Starts compiling the run's programs from shapes; .result() gives
    programs.Programs (HostOuter's programs compile alongside)."""
    whole_abstract = placement.with_shardings(self.abstract_state,
                                              self.state_shardings)
    compiling = programs_lib.compile_in_background(
        self.config, self.mesh, self.loss_fn, self.spec.inner_opt,
        self.spec.outer_opt, self.spec.compression,
        (whole_abstract if self.host_outer is None
         else host_outer_lib.strip(whole_abstract)), self.batch_shape,
        self.eval_shape, self.weights_shape, whole_abstract,
        num_eval_batches=len(self.eval_set))
    if self.host_outer is not None:
      self.host_outer.compile_in_background(whole_abstract)
    return compiling

  def first_start(self, source: warm_start.Source | None) -> Start:
    """A run's first start (also where a rollback finds no checkpoint):
    fresh params, or `source`'s model."""
    config = self.config
    if source is None:
      # Params are created on their devices, already sharded.
      with model_lib.fast_init_compile():
        state = jax.jit(lambda seed: self.spec.init(
            model_lib.new_params(config.model, seed)),
                        out_shardings=self.state_shardings)(config.seed)
      return Start(0, {}, state, progress_lib.Progress(self.islands),
                   restored=False)
    start = warm_start.load(source, self.spec, config, self.mesh,
                            self.state_shardings)
    meta = start.meta
    progress = progress_lib.Progress(
        self.islands, rounds_done=meta.get("rounds_done", 0),
        tokens_seen=meta.get("tokens_seen", 0),
        initialized_from=start.record(source))
    return Start(start.step, meta, start.state, progress, restored=False)

  def restore(self, checkpointer, compare_config: bool = True
              ) -> Start | None:
    """The newest readable checkpoint of this run, or None (see
    resume.restore_latest for what it refuses)."""
    restored = resume.restore_latest(
        checkpointer, self.config, self.abstract_state, self.mesh,
        self.spec.inner_opt, self.islands, compare_config=compare_config)
    if restored is None:
      return None
    step, meta, state = restored
    return Start(step, meta, state,
                 progress_lib.Progress.from_meta(meta, self.islands),
                 restored=True)

  def describe_placement(self) -> str:
    """Where the islands run, for the log."""
    config, mesh = self.config, self.mesh
    slots = mesh.shape[mesh_lib.ISLAND]
    folded = mesh_lib.folded_islands(mesh, self.islands)
    line = (f"{self.islands} island(s) on {slots} device slot(s) of "
            f"{config.mesh.data} x {config.mesh.stage} "
            f"{mesh.devices.flat[0].platform} device(s)")
    if folded > 1:
      line += f", {folded} folded per slot"
    return line + (", FSDP over 'data'" if config.mesh.fsdp else "")


def build(config, devices, outer_devices=None) -> RunSetup:
  """A run's RunSetup on `devices` (and `outer_devices` for the outer side
  with outer_placement='host'); reads the data, compiles nothing."""
  phase_start = time.perf_counter()
  islands = validation.effective_islands(config)
  batch_size = config.data.batch_size
  mesh = mesh_lib.build_mesh(islands, config.mesh.data, config.mesh.stage,
                             devices)
  batch_shape, eval_shape, weights_shape = programs_lib.batch_shapes(
      mesh, islands, batch_size, config.data.sequence_length,
      config.eval.batch_size)
  # Each process reads the data of its own islands only.
  held = multihost.local_islands(batch_shape.sharding, batch_shape.shape)
  batches = sources.make_batch_source(config.data, islands, batch_size,
                                      seed=config.data.seed, islands=held)
  eval_set = sources.make_eval_batches(config.data, config.eval.batch_size,
                                       config.eval.num_batches)
  # The outer mean weights island i by the tokens it processed this round
  # times its cluster's share of the corpus (uniform for iid islands), so the
  # averaged update stands for the whole data distribution.
  island_shares = batches.island_token_weights() * islands
  logging.info("data ready in %.1fs (islands %d..%d on this process)",
               time.perf_counter() - phase_start, held.start, held.stop - 1)
  spec = state_spec_lib.for_config(config)
  abstract_state = spec.abstract(config.model)
  host_outer = None
  if outer_devices is not None:
    host_outer = host_outer_lib.build(
        outer_devices, islands, mesh, spec.outer_opt, spec.compression,
        spec.inner_opt,
        rounding_seed=(config.seed if config.diloco.stochastic_rounding
                       else None),
        restart_dropped=config.diloco.dropped_islands == "idle",
        overlap=config.diloco.overlap,
        fragments=(config.diloco.fragments
                   if schedule_lib.is_streaming(config.diloco) else None),
        fsdp=config.mesh.fsdp)
  return RunSetup(
      config=config, islands=islands, mesh=mesh, batch_shape=batch_shape,
      eval_shape=eval_shape, weights_shape=weights_shape, held=held,
      batches=batches, eval_set=eval_set, island_shares=island_shares,
      spec=spec, abstract_state=abstract_state,
      state_shardings=state_lib.state_shardings(abstract_state, mesh,
                                             config.mesh.fsdp),
      loss_fn=functools.partial(model_lib.next_token_loss,
                                model_lib.graphdef(config.model)),
      host_outer=host_outer)
