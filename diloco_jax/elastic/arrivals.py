"""Asynchronous elastic rounds (config.elastic.asynchronous): no island
waits for another. The coordinator applies each island's result the
moment it arrives, and that island's next call starts at once from the x
its result made.

A round is a window of results: it closes once the results applied in it
hold a round's island-steps (each member's steps of a call, planned now;
what the last result adds beyond them counts in the next window), so the
run trains the tokens rounds would. The window is then recorded,
evaluated where the schedule says and checkpointed on a thread of its own
while the islands train on. Under round_budget 'time' each island's call
takes as many steps as fit in the fastest's H (speeds.py), so every
island sends about once a window.

Each result is the outer object's window step (algorithm/outer_windows.py,
Coordinator.apply_arrival): its pseudo-gradient, against the x its call
started from, times its share of a window (its tokens, times its corpus
share, over those of the members' calls together; `arrival_scale`, with
the staleness rule of late results), joins the window's sum, and x at
once becomes the outer step over that sum from the window's first x; the
optimizer's state moves on once a window. A window in which each member
sent once thus moves x exactly as a synchronous round's token-weighted
mean does.

Data positions move on by the batches of each result that reached x; an
island whose call failed (its process died) starts its next call from
its last applied position, waiting for Ray's restart. No call is started
beyond the island-steps the run still needs, and the last window waits
for the calls still running and applies them: a run's only lost work is
that of failed calls.
"""

import dataclasses
import time

import numpy as np
import ray
import ray.exceptions

from diloco_jax.algorithm import outer_windows
from diloco_jax.elastic import quorum
from diloco_jax.elastic import rounds as rounds_lib


@dataclasses.dataclass(frozen=True)
class _Call:
  """An island's call in flight."""
  island: int
  start: object  # the x it started from (host arrays)
  applied_before: int  # results the run had applied when it started
  steps: int


# A call that fails this often in one window waits for the next window
# (a process Ray no longer restarts fails at once, every time).
_FAILURES_PER_WINDOW = 2


@dataclasses.dataclass
class _Window:
  """What one window's results added up to."""
  slots: int
  results: dict = dataclasses.field(default_factory=dict)  # last per island
  failed: dict = dataclasses.field(default_factory=dict)  # island -> why
  failures: dict = dataclasses.field(default_factory=dict)  # island -> count
  arrivals: list = dataclasses.field(default_factory=list)
  run_steps: int = 0
  applied_steps: int = 0
  applied: int = 0  # results that reached x
  sent_bytes: int = 0

  def closed(self, seconds: float) -> rounds_lib.Closed:
    included = np.zeros(self.slots, bool)
    steps_taken = {}
    for arrival in self.arrivals:
      i = arrival["island"]
      steps_taken[i] = steps_taken.get(i, 0) + arrival["steps"]
      included[i] |= arrival["applied"]
    return rounds_lib.Closed(
        quorum.RoundResults(self.results, self.failed, [], [], seconds),
        included, self.run_steps, self.applied_steps, self.sent_bytes,
        {"asynchronous": True, "arrivals": self.arrivals,
         "steps_taken": steps_taken, "stale": {}})


class ArrivalRounds:
  """Rounds as windows of results, each result applied as it arrives."""

  pipelined = False  # no round waits for another: nothing to pipeline

  def __init__(self, coordinator, fleet, round_steps_of, slots: int,
               rounds: int):
    self._coordinator = coordinator
    self._fleet = fleet
    self._round_steps_of = round_steps_of
    self._slots = slots
    self._rounds = rounds
    self._calls = {}  # ObjectRef -> _Call
    self._applied = 0  # results applied by this command
    self._shares = {}  # island -> its corpus share (times k), from results
    self._call_steps = {}  # island -> the steps of its last call started
    # Island-steps applied beyond the windows closed so far (a window's
    # last result overshoots it): counted in the next.
    self._carried = 0

  def run(self, round_number: int, members: list[int], first_step: int,
          steps: int) -> rounds_lib.Closed:
    """Window `round_number` of `members`: every member without a call
    gets one (`steps` inner steps, or its speed's share of them, its
    schedule at the run's `first_step`), and results are applied as they
    come until the window holds a round's island-steps (its members' own
    steps, planned now; what the last result adds beyond them counts in
    the next window)."""
    started = time.monotonic()
    # A slot that left has no process any more: its call is gone with it.
    self._calls = {ref: call for ref, call in self._calls.items()
                   if call.island in members}
    self._fleet.fetches.keep_only(self._calls)
    x_ref = ray.put(self._coordinator.x)
    # Under round_budget 'time' the members are timed before the first.
    self._round_steps_of.plan(self._fleet, {i: x_ref for i in members},
                              steps)
    need = (sum(self._round_steps_of.steps_of(i, steps) for i in members)
            - self._carried)
    # Island-steps the run needs from here on (later windows taken as
    # this one): no call is started beyond them.
    owed = need + (need + self._carried) * (self._rounds - round_number)
    busy = {call.island for call in self._calls.values()}
    for i in members:
      if i not in busy and self._in_flight() < owed:
        self._start(i, x_ref, round_number, first_step,
                    self._round_steps_of.steps_of(i, steps))
    window = _Window(self._slots)
    while window.applied_steps < need and self._calls:
      call = self._take_next(window, members, steps, round_number)
      # The island's next call (after a failure it waits for Ray's
      # restart of its process), unless it failed twice in the window.
      if (window.failures.get(call.island, 0) < _FAILURES_PER_WINDOW
          and self._in_flight() < owed - window.applied_steps):
        self._start(call.island, ray.put(self._coordinator.x),
                    round_number, first_step,
                    self._round_steps_of.steps_of(call.island, steps))
    if round_number == self._rounds:
      # The run's end: the calls still running were started for steps
      # the run owed (at most one per island), so their results are
      # waited for and applied, and no island's work is thrown away.
      while self._calls:
        self._take_next(window, members, steps, round_number)
    self._carried = max(0, window.applied_steps - need)
    self._coordinator.count_round()
    self._fleet.identify(window.results)
    return window.closed(time.monotonic() - started)

  def _take_next(self, window: _Window, members: list[int], steps: int,
                 round_number: int) -> _Call:
    """Waits for the first of the calls running to end (every call's
    result is pulled from its sending on, fetches.py), applies its result
    (or counts its failure) and returns the call."""
    ref = self._fleet.fetches.wait(list(self._calls))[0]
    call = self._calls.pop(ref)
    window.run_steps += call.steps
    self._take(ref, call, window, members, steps, round_number)
    return call

  def _take(self, ref, call: _Call, window: _Window, members: list[int],
            steps: int, round_number: int) -> None:
    """Applies the result of `call` (its ObjectRef `ref`) to x, or counts
    its failure (the island's process died)."""
    i = call.island
    try:
      result = self._fleet.fetches.take(ref)
    except (ray.exceptions.RayActorError,
            ray.exceptions.RayTaskError) as error:
      window.failed[i] = f"{type(error).__name__}: {str(error)[:200]}"
      window.failures[i] = window.failures.get(i, 0) + 1
      self._fleet.failed(i)
      return
    arrived_at = time.time()
    self._shares[i] = result["share"]
    overtaken = self._applied - call.applied_before
    scale = outer_windows.arrival_scale(
        result["share"] * result["tokens"],
        self._window_weight(members, steps, result), overtaken,
        len(members))
    applied = self._coordinator.apply_arrival(
        i, result, call.start, scale, arrival=(round_number, window.applied))
    self._fleet.answered(i, result, applied)
    self._round_steps_of.measured({i: result})
    window.results[i] = result
    window.sent_bytes += result["sent_bytes"]
    # When the call began and ended on the island, reached the
    # coordinator and was applied (wall clock).
    window.arrivals.append({
        "island": i, "steps": len(result["losses"]),
        "overtaken": overtaken, "scale": round(scale, 6),
        "applied": applied,
        "started_at": result["started_at"],
        "trained_at": result["trained_at"], "arrived_at": arrived_at,
        "applied_at": time.time()})
    if applied:
      window.applied += 1
      window.applied_steps += len(result["losses"])
      self._applied += 1

  def _start(self, i: int, x_ref, round_number: int, first_step: int,
             steps: int) -> None:
    """Island i's next call, from x as it stands."""
    ref = self._fleet.call(i, x_ref, round_number,
                           self._coordinator.data_states[i], steps,
                           first_step, True)
    self._calls[ref] = _Call(i, self._coordinator.x, self._applied, steps)
    self._call_steps[i] = steps

  def _in_flight(self) -> int:
    """Island-steps of the calls running."""
    return sum(call.steps for call in self._calls.values())

  def _window_weight(self, members, steps, result) -> float:
    """The tokens (times each island's corpus share) the window's
    members train in a call each: the steps of each one's call (the one
    this result ends, for its island), or its plan's."""
    tokens_per_step = result["tokens"] / max(1, len(result["losses"]))
    return sum(self._shares.get(i, 1.0) * tokens_per_step
               * self._call_steps.get(i, self._round_steps_of.steps_of(
                   i, steps))
               for i in members)
