"""The elastic run's coordinator: not an island; it keeps x, the outer
state, each island's data position and the rounds, closes each round on
the params of the islands that made it, and checkpoints all of it.

The outer step is the library's (library.outer_update over the k islands
stacked, weight 0 for those left out): the same sync_island collective and
outer optimizer as the SPMD runs, run where the islands' params meet.
"""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from diloco_jax.algorithm import library
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.config import run_config as run_config_lib
from diloco_jax.elastic import payloads
from diloco_jax.model import transformer as model_lib
from diloco_jax.run import state_spec as state_spec_lib


class Coordinator:
  """x and the outer state of an elastic run, round by round.

  Attributes:
    x: the global params (host arrays).
    rounds_done: rounds closed so far.
    data_states: per island, its stream position after the last round it
      contributed to (None: the stream's start).
    round_bytes: what one island's payload of the last round costs over
      the link through the codec (library.bytes_sent).
  """

  def __init__(self, run_config: run_config_lib.RunConfig, workdir: str):
    config = run_config.config
    self._islands = run_config.islands
    spec = state_spec_lib.for_run(run_config)
    self._outer_tx = spec.outer_opt
    self._compression = spec.compression
    self.x = jax.device_get(jax.jit(functools.partial(
        model_lib.new_params, config.model))(config.seed))
    # Islands that encode their own pseudo-gradients keep their residuals.
    self._island_encoded = payloads.encoded_on_island(self._compression)
    self._state = library.init(
        self.x, self._outer_tx, self._islands, compression=self._compression,
        error_feedback=spec.error_feedback and not self._island_encoded,
        seed=spec.seed)
    self._rounding_seed = (config.seed if config.diloco.stochastic_rounding
                           else None)
    self.rounds_done = 0
    self.round_bytes = 0
    self.data_states: list[dict | None] = [None] * self._islands
    self._stale_rounds = config.elastic.stale_rounds
    self._x_of_round = {}  # round -> the x it started from
    self._outer = jax.jit(functools.partial(
        library.outer_update, outer_tx=self._outer_tx,
        compression=self._compression))
    self._decoded_step = jax.jit(functools.partial(
        _decoded_step, outer_tx=self._outer_tx))
    self._checkpoints = ocp.CheckpointManager(
        pathlib.Path(workdir).resolve() / "coordinator",
        options=ocp.CheckpointManagerOptions(max_to_keep=2))

  def close_round(self, results: dict[int, dict],
                  round_number: int) -> np.ndarray:
    """Round `round_number`'s outer step on the params of the islands in
    `results` (island -> IslandProgram.train_round's result), each weighted
    by its share of the corpus times the tokens it trained; the others
    (dead, late, not members) are left out and keep their data position.

    A result of an earlier round (a late island's, kept by the staleness
    rule) counts with its pseudo-gradient against the x it started from,
    its weight divided by 1 + its staleness in rounds. Returns which
    islands took part."""
    self._x_of_round[round_number] = self.x
    weights = np.zeros(self._islands, np.float32)
    for i, result in results.items():
      staleness = round_number - result["round"]
      weights[i] = result["share"] * result["tokens"] / (1 + staleness)
    # What one island's payload costs over the link, as the SPMD runs
    # count it (the codec's bytes at this round's ranks).
    self.round_bytes = library.bytes_sent(self.x, self._islands,
                                          self._compression,
                                          self._state.codec_state)
    if self._island_encoded:
      x, included = self._step_on_payloads(results, weights)
    else:
      x, included = self._step_on_params(results, weights, round_number)
    self.x = jax.device_get(x)
    included = np.asarray(included)
    for i in np.flatnonzero(included):
      self.data_states[i] = results[int(i)]["data_state"]
    self.rounds_done += 1
    # The x each round started from, kept while a late result of that
    # round could still be applied.
    self._x_of_round = {r: x for r, x in self._x_of_round.items()
                        if r > round_number - self._stale_rounds}
    return included

  def _step_on_params(self, results, weights, round_number):
    """The outer step through the codec's collective over the islands'
    params stacked (a late island's rebased onto x)."""
    params = []
    for i in range(self._islands):
      result = results.get(i)
      if result is None:
        params.append(self.x)
      elif result["round"] == round_number:
        params.append(result["params"])
      else:
        params.append(_rebased(self.x, self._x_of_round[result["round"]],
                               result["params"]))
    islands = jax.tree.map(lambda *leaves: np.stack(leaves), *params)
    key = None
    if self._rounding_seed is not None:
      key = jax.random.fold_in(jax.random.key(self._rounding_seed),
                               round_number)
    x, self._state, included = self._outer(
        self.x, islands, self._state, weights=jnp.asarray(weights), key=key)
    return x, included

  def _step_on_payloads(self, results, weights):
    """The outer step on the islands' encoded pseudo-gradients: decoded,
    their weighted mean in float32, the outer optimizer (a late island's
    is against the x it started from already)."""
    codec = self._compression.dense
    size = sum(leaf.size for leaf in jax.tree.leaves(self.x))
    decoded = np.zeros((self._islands, size), np.float32)
    for i, result in results.items():
      decoded[i] = payloads.decode(result["payload"], codec, size)
    x, outer_opt_state, included = self._decoded_step(
        self.x, jnp.asarray(decoded), jnp.asarray(weights),
        self._state.outer_opt_state)
    self._state = self._state.replace(outer_opt_state=outer_opt_state,
                                      round=self._state.round + 1)
    return x, included

  def save(self) -> None:
    """Checkpoints x, the outer state, the data positions and the round
    (orbax; a save interrupted by a kill leaves the previous one)."""
    self._checkpoints.save(self.rounds_done, args=ocp.args.Composite(
        x=ocp.args.StandardSave(self.x),
        outer=ocp.args.StandardSave(self._state),
        progress=ocp.args.JsonSave({"rounds_done": self.rounds_done,
                                    "data_states": self.data_states})))
    self._checkpoints.wait_until_finished()

  def restore(self) -> bool:
    """Resumes from the last checkpoint, if any; whether one was read."""
    latest = self._checkpoints.latest_step()
    if latest is None:
      return False
    restored = self._checkpoints.restore(latest, args=ocp.args.Composite(
        x=ocp.args.StandardRestore(self.x),
        outer=ocp.args.StandardRestore(self._state),
        progress=ocp.args.JsonRestore()))
    self.x = jax.device_get(restored.x)
    self._state = restored.outer
    progress = restored.progress
    self.rounds_done = int(progress["rounds_done"])
    self.data_states = list(progress["data_states"])
    return True

  def close(self) -> None:
    self._checkpoints.close()



def _decoded_step(x, decoded, weights, outer_opt_state, *, outer_tx):
  """(x, outer state, included) after the outer step on the weighted mean
  of the islands' decoded pseudo-gradients [k, n] (traceable)."""
  mean, included, anyone = payloads.weighted_mean(decoded, weights)
  x, outer_opt_state = outer_step_lib.outer_update(
      outer_tx, x, outer_opt_state, payloads.unflatten(mean, x), anyone)
  return x, outer_opt_state, included


def _rebased(x, x_then, y_then):
  """Params whose pseudo-gradient against x is y_then's against x_then: a
  late island's update, moved onto the x the round closes on."""
  return jax.tree.map(lambda a, b, c: a - (b - c), x, x_then, y_then)
