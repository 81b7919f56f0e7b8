"""One elastic round, closed on the quorum rule: every member's call
started (or, pipelined, already sent while the round before ran), the
results collected until the quorum and its grace window, the outer step
taken on those that came back.

The asynchronous mode's rounds (arrivals.py) hand the driver the same
`Closed`.
"""

import dataclasses

import numpy as np
import ray

from diloco_jax.elastic import quorum


@dataclasses.dataclass
class Closed:
  """What a closed round hands the driver.

  Attributes:
    came_back: the round's results (island -> its last result), failures
      and late islands.
    included: per slot, whether a result of it reached x this round.
    run_steps: island-steps the round's calls set out to run.
    applied_steps: island-steps whose work reached x.
    sent_bytes: what the results took through Ray.
    record: more fields of the round's metrics.jsonl line.
  """
  came_back: quorum.RoundResults
  included: np.ndarray
  run_steps: int
  applied_steps: int
  sent_bytes: int
  record: dict


class QuorumRounds:
  """Rounds that close on the quorum rule (config.elastic.min_islands,
  grace_seconds), each member's steps from its speed under round_budget
  'time'. Pipelined under the one-step delay (config.elastic.
  overlap_rounds): each round's calls are sent while the round before it
  runs (fleet.start_ahead)."""

  def __init__(self, coordinator, fleet, round_steps_of, settings,
               round_ends: list[int]):
    self._coordinator = coordinator
    self._fleet = fleet
    self._round_steps_of = round_steps_of
    self._settings = settings
    self._ends = round_ends
    self.pipelined = bool(coordinator.starts_early
                          and settings.overlap_rounds
                          and not settings.stale_rounds)
    # The time-budgeted steps the calls sent ahead were given (False:
    # none sent ahead).
    self._ahead_plan = False

  def run(self, round_number: int, members: list[int], first_step: int,
          steps: int) -> Closed:
    """Round `round_number` (its `steps` inner steps after the run's
    `first_step`) of `members`, closed."""
    coordinator, fleet = self._coordinator, self._fleet
    starts = start_refs(coordinator, members)
    island_steps = (self._ahead_plan if self._ahead_plan is not False
                    else self._round_steps_of.plan(fleet, starts, steps))
    calls = fleet.start_round(starts, round_number, coordinator.data_states,
                              steps, first_step, island_steps)
    self._ahead_plan = False
    if self.pipelined and round_number < len(self._ends):
      # The next round's calls now, queued behind this one's: each
      # island goes on without waiting for the round to close.
      next_steps = self._ends[round_number] - self._ends[round_number - 1]
      self._ahead_plan = self._round_steps_of.plan(fleet, starts, next_steps)
      fleet.start_ahead(ray.put(coordinator.early_start()), round_number + 1,
                        next_steps, self._ends[round_number - 1],
                        self._ahead_plan)
    came_back = quorum.collect(calls, self._settings.min_islands,
                               self._settings.grace_seconds, fleet.fetches)
    included = coordinator.close_round(came_back.results, round_number)
    fleet.settle(came_back, included, round_number)
    self._round_steps_of.measured(came_back.results)
    # Island-steps this round's calls set out to run, and those whose
    # work reached x (a late result's counted in the round it lands in).
    run_steps = sum((island_steps or {}).get(i, steps)
                    for i in fleet.new_calls(round_number))
    applied_steps = sum(len(result["losses"]) for i, result in
                        came_back.results.items() if included[i])
    return Closed(came_back, included, run_steps, applied_steps,
                  sum(r["sent_bytes"] for r in came_back.results.values()),
                  {"pipelined": self.pipelined})


def start_refs(coordinator, members: list[int]) -> dict:
  """island -> the Ray object its round starts from: x put once for all,
  or each member's own point."""
  if coordinator.shared_start:
    x = ray.put(coordinator.x)
    return {i: x for i in members}
  return {i: ray.put(coordinator.start(i)) for i in members}
