"""What a run is built from before its first step.

`build` makes a run's mesh, data streams, state layout and (with
config.diloco.outer_placement='host') the outer side, as a `RunSetup`;
start.py gives the state it starts from. `check_processes` refuses, on
every process alike, a multi-process run that would leave a process idle.
"""

import dataclasses
import functools
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from diloco_jax.algorithm import state as state_lib
from diloco_jax.compiled import host_outer as host_outer_lib
from diloco_jax.compiled import model_loss
from diloco_jax.compiled import programs as programs_lib
from diloco_jax.config import run_config as run_config_lib
from diloco_jax.config import state_spec as state_spec_lib
from diloco_jax.config import validation
from diloco_jax.data import sources
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel import multihost
from diloco_jax.parallel import outer_devices as outer_devices_lib
from diloco_jax.parallel import pipeline
from diloco_jax.parallel import placement


@dataclasses.dataclass(frozen=True)
class Data:
  """A run's data on this process.

  Attributes:
    held: the islands whose data this process reads.
    batches: this process's islands' training batches.
    eval_set: the eval batches (host arrays).
    island_shares: each island's share of the corpus, times k (1 for iid
      islands): the outer mean weights islands by it.
  """
  held: range
  batches: sources.BatchSource
  eval_set: list
  island_shares: np.ndarray


@dataclasses.dataclass(frozen=True)
class RunSetup:
  """A run's mesh, data, state layout and outer side.

  Attributes:
    run_config: the run's validated config.
    mesh: the compute mesh ('island', 'data', 'stage').
    batch_shape, eval_shape, weights_shape: abstract training batch, eval
      batch and outer-mean island weights, with their shardings.
    data: this process's batches and the eval set.
    spec: the state's optimizers, codec and pipeline stages.
    abstract_state: the whole state's shapes, as checkpoints hold it
      (logical: one entry per layer, whatever the stages).
    state_shardings: where that state lives on `mesh`.
    steps_state: the state the compiled steps take (abstract, with its
      shardings): with pipeline stages, staged (spec.staged), else the
      same as abstract_state.
    loss_fn: loss_fn(params, batch) of the model (pipelined over the
      stages, of staged params, when there are stages).
    host_outer: the outer side with outer_placement='host', else None.
  """
  run_config: run_config_lib.RunConfig
  mesh: jax.sharding.Mesh
  batch_shape: jax.ShapeDtypeStruct
  eval_shape: jax.ShapeDtypeStruct
  weights_shape: jax.ShapeDtypeStruct
  data: Data
  spec: state_spec_lib.StateSpec
  abstract_state: state_lib.TrainState
  state_shardings: Any
  steps_state: state_lib.TrainState
  loss_fn: Any
  host_outer: host_outer_lib.OuterSide | None

  @property
  def config(self):
    """The run's config fields (frozen)."""
    return self.run_config.config

  @property
  def islands(self) -> int:
    """k, the logical islands."""
    return self.run_config.islands

  @property
  def num_params(self) -> int:
    return sum(int(np.prod(x.shape))
               for x in jax.tree.leaves(self.abstract_state.global_params))

  def place_batch(self, batch: np.ndarray) -> jax.Array:
    """The global training batch from this process's islands' rows."""
    return multihost.global_batch(batch, self.batch_shape.sharding,
                                  self.batch_shape.shape)

  def islands_side(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """The state the islands train, from the whole state (staged over the
    pipeline stages; with 'host', the outer fields go to the outer
    devices)."""
    if self.spec.layout is not None:
      state = self._to_stages(state)
    return state if self.host_outer is None else self.host_outer.load(state)

  def whole(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """The whole state, as checkpoints hold it."""
    if self.host_outer is not None:
      state = self.host_outer.assemble(state)
    if self.spec.layout is not None:
      state = self._from_stages(state)
    return state

  @functools.cached_property
  def _to_stages(self):
    return jax.jit(self.spec.staged,
                   out_shardings=jax.tree.map(lambda a: a.sharding,
                                              self.steps_state))

  @functools.cached_property
  def _from_stages(self):
    return jax.jit(lambda s: self.spec.logical(s, self.abstract_state),
                   out_shardings=self.state_shardings)

  def evaluated(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """The state to evaluate: with the outer side's current x."""
    return (state if self.host_outer is None
            else self.host_outer.current(state))

  def compile_in_background(self):
    """Starts compiling the run's programs from shapes; .result() gives
    programs.Programs (the outer side's programs compile alongside)."""
    whole_abstract = placement.with_shardings(self.abstract_state,
                                              self.state_shardings)
    compiling = programs_lib.compile_in_background(
        self.run_config, self.mesh, self.loss_fn, self.spec,
        (self.steps_state if self.host_outer is None
         else host_outer_lib.strip(self.steps_state)), self.batch_shape,
        self.eval_shape, self.weights_shape, whole_abstract,
        num_eval_batches=len(self.data.eval_set))
    if self.host_outer is not None:
      # The outer side holds the state as the islands' side does (staged
      # over pipeline stages; the same as whole_abstract without them).
      self.host_outer.compile_in_background(self.steps_state)
    return compiling

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
    layout = self.spec.layout
    if layout is not None:
      microbatches = run_config_lib.pipeline_microbatches(config)
      bubble = pipeline.bubble_fraction(layout.stages, microbatches,
                                        layout.repeats)
      line += (f", {layout.stages} pipeline stages "
               f"({config.pipeline.schedule}, {microbatches} microbatches, "
               f"{layout.repeats} pass(es), bubble {bubble:.0%})")
    return line + (", FSDP over 'data'" if config.mesh.fsdp else "")


def build(run_config: run_config_lib.RunConfig, devices,
          outer_devices=None) -> RunSetup:
  """A run's RunSetup on `devices` (and `outer_devices` for the outer side
  with outer_placement='host'); reads the data, compiles nothing."""
  config, islands = run_config.config, run_config.islands
  mesh = mesh_lib.build_mesh(islands, config.mesh.data, config.mesh.stage,
                             devices)
  batch_shape, eval_shape, weights_shape = programs_lib.batch_shapes(
      mesh, islands, config.data.batch_size, config.data.sequence_length,
      config.eval.batch_size)
  spec = state_spec_lib.for_run(run_config)
  abstract_state = spec.abstract(config.model)
  steps_state = jax.eval_shape(spec.staged, abstract_state)
  return RunSetup(
      run_config=run_config, mesh=mesh, batch_shape=batch_shape,
      eval_shape=eval_shape, weights_shape=weights_shape,
      data=_read_data(run_config, batch_shape), spec=spec,
      abstract_state=abstract_state,
      state_shardings=state_lib.state_shardings(
          abstract_state, mesh, config.mesh.fsdp, staged=False),
      steps_state=placement.with_shardings(
          steps_state, state_lib.state_shardings(steps_state, mesh,
                                                 config.mesh.fsdp)),
      loss_fn=model_loss.loss_function(config, mesh),
      host_outer=(None if outer_devices is None else _host_outer(
          run_config, spec, mesh, outer_devices)))



def _read_data(run_config: run_config_lib.RunConfig, batch_shape) -> Data:
  """This process's islands' batches (each process reads the data of its
  own islands only) and the eval set."""
  phase_start = time.perf_counter()
  config, islands = run_config.config, run_config.islands
  held = multihost.local_islands(batch_shape.sharding, batch_shape.shape)
  batches = sources.make_batch_source(run_config.data, islands,
                                      config.data.batch_size,
                                      seed=config.data.seed, islands=held)
  eval_set = sources.make_eval_batches(run_config.data,
                                       config.eval.batch_size,
                                       config.eval.num_batches)
  logging.info("data ready in %.1fs (islands %d..%d on this process)",
               time.perf_counter() - phase_start, held.start, held.stop - 1)
  # The outer mean weights island i by the tokens it processed this round
  # times its cluster's share of the corpus (uniform for iid islands), so the
  # averaged update stands for the whole data distribution.
  return Data(held=held, batches=batches, eval_set=eval_set,
              island_shares=batches.island_token_weights() * islands)


def _host_outer(run_config: run_config_lib.RunConfig,
                spec: state_spec_lib.StateSpec, mesh,
                outer_devices) -> host_outer_lib.OuterSide:
  settings = run_config.diloco
  return host_outer_lib.build(
      outer_devices, run_config.islands, mesh, spec.outer, spec.inner_opt,
      rounding_seed=settings.rounding_seed,
      restart_dropped=settings.restart_dropped,
      fsdp=run_config.config.mesh.fsdp, reset_inner=settings.reset_inner)


def check_processes(run_config: run_config_lib.RunConfig, devices) -> None:
  """ConfigError (on every process alike) if a process of a multi-process
  run would have no device in the mesh of the run or of its pretraining,
  or could not gather its FSDP islands for outer_placement='host'."""
  if jax.process_count() == 1:
    return
  config, islands = run_config.config, run_config.islands
  mesh = mesh_lib.build_mesh(islands, config.mesh.data, config.mesh.stage,
                             devices)
  idle = multihost.idle_processes(mesh)
  if idle:
    raise validation.ConfigError(
        f"{islands} island(s) x mesh.data={config.mesh.data} x mesh.stage="
        f"{config.mesh.stage} use {mesh.devices.size} of the "
        f"{len(devices)} devices, leaving process(es) {idle} of "
        f"{jax.process_count()} without any: use more islands or spread "
        "each island over the processes with config.mesh.data")
  split = (outer_devices_lib.islands_across_processes(mesh)
           if run_config.host_outer and (config.mesh.fsdp
                                         or config.mesh.stage > 1) else [])
  if split:
    raise validation.ConfigError(
        "config.diloco.outer_placement='host' with config.mesh.fsdp or "
        "config.mesh.stage > 1 copies each island to its own process's "
        f"outer devices, but island slot(s) {split} span processes "
        f"(config.mesh.data={config.mesh.data}, config.mesh.stage="
        f"{config.mesh.stage}); keep each island's devices in one process, "
        "or use outer_placement='device'")
  if config.pretrain_steps and len(multihost.idle_processes(
      mesh_lib.build_mesh(1, config.mesh.data, config.mesh.stage,
                          devices))):
    raise validation.ConfigError(
        f"config.pretrain_steps={config.pretrain_steps}: the pretraining is "
        f"one worker, on mesh.data x mesh.stage = {config.mesh.data} x "
        f"{config.mesh.stage} devices, which leaves processes of this "
        f"{jax.process_count()}-process run idle; pretrain in a run of its "
        "own (e.g. one process, config.mode=single) and start this one "
        "from it with config.init_from=THAT_WORKDIR")
