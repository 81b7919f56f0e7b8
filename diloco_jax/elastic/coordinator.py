"""The elastic run's coordinator: not an island; it keeps x, the outer
state, each island's data position and the rounds, closes each round on
the params of the islands that made it, and checkpoints all of it.

The outer step is the run's outer object (algorithm/outer.py, the
library's `diloco(...)`) over the k islands stacked, weight 0 for those
left out: the same collective, outer optimizer and overlap as the SPMD
runs, run where the islands' params meet. Under the overlaps that keep
each island's own progress (the delay with rebase, eager updates) each
island starts its next round from its own point (`start`), not x.
"""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from diloco_jax.algorithm import library
from diloco_jax.algorithm import library_diloco
from diloco_jax.algorithm import outer as outer_lib
from diloco_jax.config import run_config as run_config_lib
from diloco_jax.elastic import payloads
from diloco_jax.model import transformer as model_lib
from diloco_jax.run import state_spec as state_spec_lib


# What the checkpoints' "outer" item holds: the outer object's state.
_OUTER_FORMAT = "diloco_jax.OuterState/1"


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
    outer = spec.outer
    self._own_starts = outer.keeps_island_points
    # Islands that encode their own pseudo-gradients keep their residuals;
    # where each island keeps its own point, they send their params and
    # the collective runs here (its rebase or own step needs them).
    self._island_encoded = payloads.encoded_on_island(outer)
    if self._island_encoded:
      outer = outer.without_error_feedback()
    self._outer = outer
    self.x = jax.device_get(jax.jit(functools.partial(
        model_lib.new_params, config.model))(config.seed))
    self._state = jax.device_get(outer.init(self.x, self._islands,
                                            seed=spec.seed))
    self._rounding_seed = run_config.diloco.rounding_seed
    self.rounds_done = 0
    self.round_bytes = 0
    self.data_states: list[dict | None] = [None] * self._islands
    self._stale_rounds = config.elastic.stale_rounds
    self._starts_of_round = {}  # round -> the points it started from
    self._update = jax.jit(outer.update)
    self._apply = jax.jit(outer.apply)
    self._finish = jax.jit(outer.finish)
    self._model = jax.jit(outer.model)
    self._checkpoints = ocp.CheckpointManager(
        pathlib.Path(workdir).resolve() / "coordinator",
        options=ocp.CheckpointManagerOptions(max_to_keep=2))

  @property
  def shared_start(self) -> bool:
    """Whether every island starts its next round from x."""
    return not self._own_starts

  def start(self, island: int):
    """What `island` starts its next round from: x, or its own point."""
    if not self._own_starts:
      return self.x
    return jax.tree.map(lambda a: a[island], self._state.anchors)

  def model(self):
    """The params the run is judged by: x, or under eager updates the
    islands' average point."""
    return jax.device_get(self._model(self.x, self._state))

  def finish(self) -> None:
    """The run's end: the mean still in flight applied, or the eager
    islands settled on their average (again on a rerun: the same)."""
    x, _, state = self._finish(self.x, self._state)
    self.x, self._state = jax.device_get((x, state))

  def close_round(self, results: dict[int, dict],
                  round_number: int) -> np.ndarray:
    """Round `round_number`'s outer step on the params of the islands in
    `results` (island -> IslandProgram.train_round's result), each weighted
    by its share of the corpus times the tokens it trained; the others
    (dead, late, not members) are left out and keep their data position.

    A result of an earlier round (a late island's, kept by the staleness
    rule) counts with its pseudo-gradient against the point it started
    from, its weight divided by 1 + its staleness in rounds. Returns which
    islands took part."""
    self._starts_of_round[round_number] = self._points()
    weights = np.zeros(self._islands, np.float32)
    for i, result in results.items():
      staleness = round_number - result["round"]
      weights[i] = result["share"] * result["tokens"] / (1 + staleness)
    # What one island's payload costs over the link, as the SPMD runs
    # count it (the codec's bytes at this round's ranks).
    self.round_bytes = library.bytes_sent(self.x, self._islands,
                                          self._outer.codec,
                                          self._state.codec_state)
    if self._island_encoded:
      step = self._step_on_payloads(results, weights)
    else:
      step = self._step_on_params(results, weights, round_number)
    self.x, self._state = jax.device_get((step.params, step.state))
    included = np.asarray(self._state.included)
    for i in np.flatnonzero(included):
      self.data_states[i] = results[int(i)]["data_state"]
    self.rounds_done += 1
    # The points each round started from, kept while a late result of
    # that round could still be applied.
    self._starts_of_round = {
        r: points for r, points in self._starts_of_round.items()
        if r > round_number - self._stale_rounds}
    return included

  def _points(self):
    """The islands' points now: their anchors, or x for every one."""
    if self._own_starts:
      return self._state.anchors
    return jax.tree.map(lambda a: np.broadcast_to(a, (self._islands,)
                                                  + a.shape), self.x)

  def _step_on_params(self, results, weights, round_number):
    """The outer step through the codec's collective over the islands'
    params stacked (a late island's moved onto its point now)."""
    now = self._points()
    params = []
    for i in range(self._islands):
      result = results.get(i)
      point = jax.tree.map(lambda a, i=i: a[i], now)
      if result is None:
        params.append(point)
      elif result["round"] == round_number:
        params.append(result["params"])
      else:
        then = jax.tree.map(lambda a, i=i: a[i],
                            self._starts_of_round[result["round"]])
        params.append(_rebased(point, then, result["params"]))
    islands = jax.tree.map(lambda *leaves: np.stack(leaves), *params)
    key = None
    if self._rounding_seed is not None:
      key = jax.random.fold_in(jax.random.key(self._rounding_seed),
                               round_number)
    return self._update(self.x, islands, self._state,
                        weights=jnp.asarray(weights), key=key)

  def _step_on_payloads(self, results, weights):
    """The outer step on the islands' encoded pseudo-gradients: decoded,
    their weighted mean in float32, then the outer object's step on it (a
    late island's is against the x it started from already)."""
    codec = self._outer.codec.dense
    size = sum(leaf.size for leaf in jax.tree.leaves(self.x))
    decoded = np.zeros((self._islands, size), np.float32)
    for i, result in results.items():
      decoded[i] = payloads.decode(result["payload"], codec, size)
    return self._apply(self.x, None, self._state, _decoded_mean(
        jnp.asarray(decoded), jnp.asarray(weights), self.x,
        self._state.codec_state))

  def save(self) -> None:
    """Checkpoints x, the outer state, the data positions and the round
    (orbax; a save interrupted by a kill leaves the previous one)."""
    self._checkpoints.save(self.rounds_done, args=ocp.args.Composite(
        x=ocp.args.StandardSave(self.x),
        outer=ocp.args.StandardSave(self._state),
        progress=ocp.args.JsonSave({"rounds_done": self.rounds_done,
                                    "data_states": self.data_states,
                                    "outer_format": _OUTER_FORMAT})))
    self._checkpoints.wait_until_finished()

  def restore(self) -> bool:
    """Resumes from the last checkpoint, if any; whether one was read. A
    checkpoint of an older coordinator (its outer state the library's
    DiLoCoState, before the outer object; its progress says no format) is
    read and converted."""
    latest = self._checkpoints.latest_step()
    if latest is None:
      return False
    progress = self._checkpoints.restore(latest, args=ocp.args.Composite(
        progress=ocp.args.JsonRestore())).progress
    legacy = progress.get("outer_format") != _OUTER_FORMAT
    restored = self._checkpoints.restore(latest, args=ocp.args.Composite(
        x=ocp.args.StandardRestore(self.x),
        outer=ocp.args.StandardRestore(
            _legacy_state(self._state) if legacy else self._state)))
    self.x = jax.device_get(restored.x)
    self._state = (_from_legacy(restored.outer, self._state) if legacy
                   else restored.outer)
    self.rounds_done = int(progress["rounds_done"])
    self.data_states = list(progress["data_states"])
    return True

  def close(self) -> None:
    self._checkpoints.close()


def _decoded_mean(decoded, weights, x, codec_state):
  """The round's mean as the outer object takes it, from the islands'
  decoded pseudo-gradients [k, n] (traceable; dense codecs keep no codec
  state, and the residuals stay on the islands)."""
  mean, included, anyone = payloads.weighted_mean(decoded, weights)
  return library_diloco.IslandMean(
      mean=payloads.unflatten(mean, x), residuals=None,
      codec_state=codec_state, included=included,
      finite=jnp.all(jnp.isfinite(decoded), axis=1), anyone=anyone)


def _legacy_state(state: outer_lib.OuterState) -> library_diloco.DiLoCoState:
  """The outer state's shapes as a coordinator before the outer object
  saved them (overlap 'none': the only one it ran)."""
  return library_diloco.DiLoCoState(
      outer_opt_state=state.outer_opt_state, codec_state=state.codec_state,
      residuals=state.residuals, round=state.round)


def _from_legacy(old: library_diloco.DiLoCoState,
                 like: outer_lib.OuterState) -> outer_lib.OuterState:
  return like.replace(outer_opt_state=old.outer_opt_state,
                      codec_state=old.codec_state, residuals=old.residuals,
                      round=old.round)


def _rebased(point, start_then, y_then):
  """Params whose pseudo-gradient against `point` is y_then's against
  `start_then`: a late island's update, moved onto its point now."""
  return jax.tree.map(lambda a, b, c: a - (b - c), point, start_then,
                      y_then)
