"""One elastic island: its own JAX program, training a round from the x it
is given on its own rows of the run's data.

An island keeps only its inner optimizer state between rounds. Everything
else it is handed each round by the coordinator: x, and where its data
stream stands (the position after the last round it contributed to), so a
restarted island, or one whose round was left out, trains on exactly the
batches it has not contributed yet. A restarted island's inner optimizer
state starts fresh: its process's memory is gone, and a state from its
own last checkpoint would be rounds older than the x it rejoins at.
"""

import dataclasses
import os
import pathlib
import signal
import time

import jax
import numpy as np

from diloco_jax.algorithm import inner_step as inner_step_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.config import run_config as run_config_lib
from diloco_jax.data import sources
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.run import setup as setup_lib
from diloco_jax.run import state_spec as state_spec_lib


class IslandProgram:
  """Island `island` of an elastic run (a Ray actor's body).

  Args:
    run_config: the run's validated config (all islands).
    island: this island's index.
    workdir: the run's directory (for the kill markers of tests).
    kill_steps: {1-based round: inner step}: this island's process kills
      itself before that step of that round, once per run (tests and
      benchmarks of failures).
    slow_rounds: {1-based round: seconds}: this island sleeps that long
      before that round's first step (a straggler).
  """

  def __init__(self, run_config: run_config_lib.RunConfig, island: int,
               workdir: str, kill_steps: dict[int, int] | None = None,
               slow_rounds: dict[int, float] | None = None):
    config = run_config.config
    self.island = island
    self._kill_steps = kill_steps or {}
    self._slow_rounds = slow_rounds or {}
    self._workdir = pathlib.Path(workdir)
    # One island's state: no codec state or residuals (the coordinator
    # keeps those), the run's mesh inside the island (data devices, FSDP,
    # pipeline stages), and the inner optimizer the SPMD runs build.
    self._spec = dataclasses.replace(
        state_spec_lib.for_run(run_config), islands=1, compression=None,
        error_feedback=False)
    mesh = config.mesh
    self._mesh = mesh_lib.build_mesh(
        1, mesh.data, mesh.stage, jax.devices()[:mesh.data * mesh.stage])
    self._inner_step = inner_step_lib.make_inner_step(
        setup_lib.loss_function(config, self._mesh), self._spec.inner_opt,
        self._mesh, microbatches=config.data.microbatches, fsdp=mesh.fsdp)
    self._build_conversions(config)
    self._batches = sources.make_batch_source(
        run_config.data, run_config.islands, config.data.batch_size,
        seed=config.data.seed, islands=range(island, island + 1))
    self._batch_sharding = jax.sharding.NamedSharding(self._mesh,
                                                      state_lib.BATCH_SPEC)
    self._state = None  # built at the first round, from that round's x
    self.tokens_per_step = (config.data.batch_size
                            * config.data.sequence_length)
    # This island's share of the corpus (times k: 1 for iid islands).
    weights = self._batches.island_token_weights()
    self.share = float(weights[island] * len(weights))

  def pid(self) -> int:
    """This island's process id (tests kill it)."""
    return os.getpid()

  def train_round(self, x, round_number: int, data_state: dict | None,
                  steps: int) -> dict:
    """`steps` inner steps from x, on the batches after `data_state` (None:
    the stream's start). Returns the island's params y (host arrays), the
    stream position after them, the train losses, the tokens trained and
    the island's share of the corpus."""
    if data_state is not None:
      self._batches.restore(data_state)
    if self._state is None:
      self._state = self._fresh_state(x)
    else:
      self._state = self._state.replace(island_params=self._island_params(x))
    time.sleep(self._slow_rounds.get(round_number, 0))
    losses = []
    for step in range(steps):
      if min(self._kill_steps.get(round_number, -1), steps - 1) == step:
        marker = (self._workdir
                  / f"killed_island_{self.island}_round_{round_number}")
        if not marker.exists():  # once: not again after the restart
          marker.touch()
          os.kill(os.getpid(), signal.SIGKILL)
      batch = jax.device_put(self._batches.next_batch(), self._batch_sharding)
      self._state, metrics = self._inner_step(self._state, batch)
      losses.append(metrics["loss"])
    return {
        "island": self.island, "round": round_number,
        "params": jax.device_get(self._params(self._state.island_params)),
        "data_state": self._batches.state(),
        "losses": [float(np.asarray(loss)[0]) for loss in losses],
        "tokens": steps * self.tokens_per_step, "share": self.share}

  def _build_conversions(self, config) -> None:
    """The compiled moves between the coordinator's x (logical, host) and
    the island's state (staged over its stages, placed on its mesh)."""
    spec, layout = self._spec, self._spec.layout
    logical = spec.abstract(config.model)
    shardings = state_lib.state_shardings(
        jax.eval_shape(spec.staged, logical), self._mesh, config.mesh.fsdp)
    # A fresh state at x: a restarted or joining island's.
    self._fresh_state = jax.jit(lambda x: spec.staged(spec.init(x)),
                                out_shardings=shardings)

    def island_params(x):
      stacked = state_lib.stack_islands(x, 1)
      return stacked if layout is None else jax.vmap(layout.split)(stacked)

    def params(staged):
      one = jax.tree.map(lambda a: a[0], staged)
      return one if layout is None else layout.join(one,
                                                    logical.global_params)

    self._island_params = jax.jit(island_params,
                                  out_shardings=shardings.island_params)
    self._params = jax.jit(params)
