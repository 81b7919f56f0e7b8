"""The elastic run's coordinator: not an island; it keeps x, the outer
state, each island's data position and the rounds, closes each round on
the params of the islands that made it, and checkpoints all of it.

The outer step is the run's outer object (algorithm/outer.py, the
library's `diloco(...)`) over the k islands stacked, weight 0 for those
left out: the same collective, outer optimizer and overlap as the SPMD
runs, run where the islands' params meet. Under the overlaps that keep
each island's own progress (the delay with rebase, eager updates) each
island starts its next round from its own point (`start`), not x. Under
Streaming DiLoCo a round ends at each fragment's send (round_steps.py): the
object's update of that fragment (`fragment=p`) on what the islands sent
of it, x's other fragments untouched; each island merges it itself.
Under the asynchronous mode (arrivals.py) each result joins its window's
sum as it arrives (the object's `add_arrival`), and a round is counted
per window.
"""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.algorithm import island_sync
from diloco_jax.algorithm import library
from diloco_jax.algorithm import library_diloco
from diloco_jax.algorithm import outer as outer_lib
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.config import run_config as run_config_lib
from diloco_jax.config import state_spec as state_spec_lib
from diloco_jax.elastic import payloads
from diloco_jax.elastic import round_steps
from diloco_jax.model import transformer as model_lib


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
    round_ends: each round's last inner step (round_steps.round_ends).
    counters: what the driver counts over the run's rounds (a JSON
      dict), checkpointed with them; None if the checkpoint restored
      holds none (written before they were kept) or there is none.
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
    self._schedule = run_config.schedule
    self._streaming = run_config.streaming
    self.round_ends = round_steps.round_ends(run_config)
    self.rounds_done = 0
    self.round_bytes = 0
    self.data_states: list[dict | None] = [None] * self._islands
    self.counters: dict | None = None
    self._stale_rounds = config.elastic.stale_rounds
    self._starts_of_round = {}  # round -> the points it started from
    self._update = jax.jit(outer.update, static_argnames="fragment")
    self._apply = jax.jit(outer.apply, static_argnames="fragment")
    # The asynchronous mode's open window (outer_windows.Window), or None.
    self._window = None
    self._arrival_mean = jax.jit(outer.arrival_mean)
    self._add_arrival = jax.jit(outer.add_arrival)
    self._finish = jax.jit(outer.finish)
    self._land = jax.jit(outer.land)
    self._model = jax.jit(outer.model)
    self._checkpoints = ocp.CheckpointManager(
        pathlib.Path(workdir).resolve() / "coordinator",
        options=ocp.CheckpointManagerOptions(max_to_keep=2))

  @property
  def shared_start(self) -> bool:
    """Whether every island starts its next round from x."""
    return not self._own_starts

  @property
  def starts_early(self) -> bool:
    """Whether the x a round starts from is known a round early: under
    the one-step delay (without rebase) round r + 2 starts from x with
    round r's mean applied, known once round r closed."""
    return (isinstance(self._outer.overlap, outer_overlaps.OneStepDelay)
            and not self._own_starts)

  def early_start(self):
    """Under `starts_early`, with rounds 1..r closed: the x round r + 2
    starts from (x with the mean in flight applied, `outer.land`: what
    closing round r + 1 will make x, before its own mean)."""
    x, _ = self._land(self.x, self._state)
    return jax.device_get(x)

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
    weights = np.zeros(self._islands, np.float32)
    for i, result in results.items():
      staleness = round_number - result["round"]
      weights[i] = result["share"] * result["tokens"] / (1 + staleness)
    if self._streaming:
      return self._closed(results, self._send_fragments(results, weights,
                                                        round_number))
    self._starts_of_round[round_number] = self._points()
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
    # The points each round started from, kept while a late result of
    # that round could still be applied.
    self._starts_of_round = {
        r: points for r, points in self._starts_of_round.items()
        if r > round_number - self._stale_rounds}
    return self._closed(results, np.asarray(self._state.included))

  def apply_arrival(self, island: int, result: dict, start,
                    scale: float, arrival: tuple[int, int]) -> bool:
    """The asynchronous mode's outer step (arrivals.py) on one island's
    result the moment it arrives: the outer object's window step
    (`arrival_mean`, `add_arrival`: its pseudo-gradient against `start`,
    the x its call started from, times `scale`, joins its window's sum;
    the optimizer state moves once a window, at `count_round`). The
    island's data position moves on. `arrival`: (the round, how many of
    its results came before), its rounding key's. Returns whether the
    result was applied (a non-finite one is not)."""
    self.round_bytes = library.bytes_sent(self.x, self._islands,
                                          self._outer.codec,
                                          self._state.codec_state)
    if self._island_encoded:
      weights = np.zeros(self._islands, np.float32)
      weights[island] = 1.0
      synced = self._decoded_mean({island: result["payload"]}, weights,
                                  self.x, scales={island: scale})
    else:
      synced = self._arrival_mean(
          self.x, self._state, island, result["params"], start,
          scale=np.float32(scale),
          key=island_sync.rounding_key(self._rounding_seed, *arrival))
    if not bool(np.asarray(synced.included)[island]):
      return False
    if self._window is None:
      self._window = self._outer.open_window(self.x, self._state)
    x, state, self._window = self._add_arrival(self._window, synced)
    self.x, self._state = jax.device_get((x, state))
    self.data_states[island] = result["data_state"]
    return True

  def count_round(self) -> None:
    """One more round done (the asynchronous mode's window of results):
    the next result opens a window from x and the state as they stand."""
    self.rounds_done += 1
    self._window = None

  def _closed(self, results, included) -> np.ndarray:
    """The round counted, each included island's data position moved on;
    returns `included`."""
    for i in np.flatnonzero(included):
      self.data_states[i] = results[int(i)]["data_state"]
    self.rounds_done += 1
    return included

  def _send_fragments(self, results, weights, round_number) -> np.ndarray:
    """Streaming: the sends the schedule puts at the round's end, in its
    order, each the object's update of that fragment on what the islands
    sent of it (its params, or its pseudo-gradient encoded). Returns the
    islands included in every one."""
    step = self.round_ends[round_number - 1]
    assignment = self._state.recipe.assignment
    included = np.ones(self._islands, bool)
    self.round_bytes = 0
    for p in round_steps.sends(self._schedule, step):
      x_p = fragments_lib.select(self.x, assignment, p)
      self.round_bytes += library.bytes_sent(
          x_p, self._islands, self._outer.codec,
          self._fragment_codec_state(p))
      if self._island_encoded:
        sent = self._apply(self.x, None, self._state, self._decoded_mean(
            {i: r["payload"][p] for i, r in results.items()}, weights, x_p),
                           fragment=p)
      else:
        # Every island's params with its fragment p (x's elsewhere: the
        # send reads fragment p's leaves only).
        islands = jax.tree.map(lambda *leaves: np.stack(leaves), *[
            fragments_lib.replace(self.x, assignment, p,
                                  results[i]["params"][p])
            if i in results else self.x for i in range(self._islands)])
        key = island_sync.rounding_key(
            self._rounding_seed, fragments_lib.send_index(
                step, self._outer.overlap.num_fragments, p))
        sent = self._update(self.x, islands, self._state,
                            weights=jnp.asarray(weights), key=key,
                            fragment=p)
      self.x, self._state = jax.device_get((sent.params, sent.state))
      included &= np.asarray(self._state.included)
    return included

  def _fragment_codec_state(self, fragment: int):
    """The codec state's entries of `fragment`'s matrices (low rank's
    ranks), or None."""
    if self._state.codec_state is None:
      return None
    return tuple(self._state.codec_state[i] for i in
                 fragments_lib.codec_positions(
                     self.x, self._outer.codec, self._state.recipe.assignment,
                     fragment))

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
    key = island_sync.rounding_key(self._rounding_seed, round_number)
    return self._update(self.x, islands, self._state,
                        weights=jnp.asarray(weights), key=key)

  def _step_on_payloads(self, results, weights):
    """The outer step on the islands' encoded pseudo-gradients: decoded,
    their weighted mean in float32, then the outer object's step on it (a
    late island's is against the x it started from already)."""
    return self._apply(self.x, None, self._state, self._decoded_mean(
        {i: result["payload"] for i, result in results.items()}, weights,
        self.x))

  def _decoded_mean(self, sent: dict, weights, like, scales=None):
    """The islands' payloads (island -> payload) of a tree shaped like
    `like` (x, or a fragment's leaves) as the mean the outer object
    takes: decoded (times `scales`' factor, island -> float, where
    given), their weighted mean in float32 (dense codecs keep no codec
    state, and the residuals stay on the islands)."""
    codec = self._outer.codec.dense
    size = sum(leaf.size for leaf in jax.tree.leaves(like))
    decoded = np.zeros((self._islands, size), np.float32)
    for i, payload in sent.items():
      decoded[i] = payloads.decode(payload, codec, size) * (
          1.0 if scales is None else scales[i])
    decoded = jnp.asarray(decoded)
    mean, included, anyone = payloads.weighted_mean(decoded,
                                                    jnp.asarray(weights))
    return library_diloco.IslandMean(
        mean=payloads.unflatten(mean, like), residuals=None,
        codec_state=None if self._streaming else self._state.codec_state,
        included=included, finite=jnp.all(jnp.isfinite(decoded), axis=1),
        anyone=anyone)

  def snapshot(self) -> dict:
    """What a checkpoint of now holds (x, the outer state, the data
    positions, the round, the counters), for `save` to write later while
    the coordinator goes on (the asynchronous mode: its arrays are
    replaced, never changed in place, so they stay as they are)."""
    progress = {"rounds_done": self.rounds_done,
                "data_states": list(self.data_states),
                "outer_format": _OUTER_FORMAT}
    if self.counters is not None:
      progress["counters"] = self.counters
    return {"x": self.x, "outer": self._state, "progress": progress}

  def save(self, snapshot: dict | None = None) -> None:
    """Checkpoints `snapshot` (default: now; orbax; a save interrupted by
    a kill leaves the previous one)."""
    snapshot = snapshot or self.snapshot()
    self._checkpoints.save(
        snapshot["progress"]["rounds_done"], args=ocp.args.Composite(
            x=ocp.args.StandardSave(snapshot["x"]),
            outer=ocp.args.StandardSave(snapshot["outer"]),
            progress=ocp.args.JsonSave(snapshot["progress"])))
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
    self.counters = progress.get("counters")
    return True

  def close(self) -> None:
    self._checkpoints.close()


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
  return jax.tree.map(lambda a, b, c: a - (b - c), point, start_then, y_then)
