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
    self._spec = state_spec_lib.for_run(run_config)
    data_devices = config.mesh.data
    self._mesh = mesh_lib.build_mesh(1, data_devices, 1,
                                     jax.devices()[:data_devices])
    self._inner_step = inner_step_lib.make_inner_step(
        setup_lib.loss_function(config, self._mesh), self._spec.inner_opt,
        self._mesh, microbatches=config.data.microbatches)
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
      self._state = self._state.replace(island_params=jax.device_put(
          state_lib.stack_islands(x, 1),
          self._shardings().island_params))
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
        "params": jax.device_get(
            jax.tree.map(lambda a: a[0], self._state.island_params)),
        "data_state": self._batches.state(),
        "losses": [float(np.asarray(loss)[0]) for loss in losses],
        "tokens": steps * self.tokens_per_step, "share": self.share}

  def _shardings(self):
    return state_lib.state_shardings(self._state, self._mesh)

  def _fresh_state(self, x):
    state = state_lib.init_state(x, self._spec.inner_opt,
                                 self._spec.outer_opt, 1)
    return jax.device_put(state, state_lib.state_shardings(state,
                                                           self._mesh))
