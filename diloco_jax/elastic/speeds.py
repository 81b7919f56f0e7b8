"""Islands of unequal speeds: rounds budgeted in time, and a knob that
slows an island for tests and benchmarks.

With config.elastic.round_budget='time' a round is as long as the fastest
island needs for H inner steps, and every island takes as many steps as
fit in that time: H times its speed relative to the fastest's, measured
(each island's median seconds per step, timed before the first round and
in every round after), rounded down, at least one. Steps set from
measured speed rather than a deadline on the clock: the fastest island
always takes its H, and a step's overheads (a batch's transfer, the
round's first step) do not cut an island's work short. The merge weighs
each island by the tokens it trained, its data stream moves on by the
batches it took, and its learning rate schedule is counted in the run's
steps (not its own), so a slow island is not held back in the schedule.
With 'steps' (the default) every island takes H steps and the round
waits for them (or closes on the quorum).

The knob: config.testing.island_speeds 'S0,S1,...' (one per island, each
in (0, 1]) makes island i's inner steps take 1/S_i times as long
(SpeedKnob).
"""

import collections
import statistics
import time

ROUND_BUDGETS = ("steps", "time")


def parse_speeds(spec: str, islands: int) -> tuple[float, ...]:
  """config.testing.island_speeds as one speed per island (all 1.0 when
  `spec` is empty). Raises ValueError naming what is wrong."""
  if not spec.strip():
    return (1.0,) * islands
  parts = [part.strip() for part in spec.split(",")]
  if len(parts) != islands:
    raise ValueError(f"{spec!r} gives {len(parts)} speeds for {islands} "
                     "islands: give one per island, e.g. '1,1,0.5,0.25'")
  speeds = []
  for part in parts:
    try:
      speed = float(part)
    except ValueError:
      raise ValueError(f"{part!r} in {spec!r} is not a number") from None
    if not 0 < speed <= 1:
      raise ValueError(f"{part!r} in {spec!r} must be in (0, 1]: a factor "
                       "by which the island is slowed")
    speeds.append(speed)
  return tuple(speeds)


def slow_down(speed: float, step_seconds: float) -> None:
  """After a step of `step_seconds`, sleep so that it took 1/speed as
  long."""
  if speed < 1:
    time.sleep(step_seconds * (1 / speed - 1))


# The raw steps whose median the knob scales.
_KNOB_STEPS = 20


class SpeedKnob:
  """An island slowed to `speed` of its pace, as a slower accelerator
  would run it: after each inner step it sleeps (1/speed - 1) times the
  median of its recent raw steps. Not the step's own time: a step that
  another island's step on a shared core held up would be slowed 1/speed
  times its delay, and islands sharing a machine would measure that
  jitter, not their speeds. The process's first step, which compiles, is
  left alone: a slower accelerator compiles no slower."""

  def __init__(self, speed: float):
    self.speed = speed
    self._raw = collections.deque(maxlen=_KNOB_STEPS)
    self._compiled = False

  def after_step(self, step_seconds: float) -> None:
    """Sleeps after an inner step of `step_seconds` (raw, before any
    sleep) as the knob says."""
    if not self._compiled:
      self._compiled = True
      return
    if self.speed < 1:
      self._raw.append(step_seconds)
      slow_down(self.speed, statistics.median(self._raw))


def typical_step_seconds(step_seconds: list[float]) -> float | None:
  """An island's seconds per inner step from its step times (the median),
  or None without any."""
  return statistics.median(step_seconds) if step_seconds else None


# The rounds an island's speed is the median of.
_MEASUREMENTS = 3
# Islands measured within this fraction of the fastest take all H steps:
# the same hardware measures a few percent apart from round to round.
_SAME_SPEED = 0.05


def island_steps(seconds_per_step: dict[int, float],
                 inner_steps: int) -> dict[int, int]:
  """island -> the inner steps it takes in a time-budgeted round: H for
  the fastest (`seconds_per_step`: island -> its last measurement), and
  for the others as many as fit in the fastest's H steps, at least one.
  An island not measured yet takes H."""
  if not seconds_per_step:
    return {}
  fastest = min(seconds_per_step.values())
  return {i: max(1, min(inner_steps, int(
      inner_steps * fastest / seconds * (1 + _SAME_SPEED))))
          for i, seconds in seconds_per_step.items()}


class RoundSteps:
  """Each island's inner steps in the run's rounds: H for all under
  round_budget 'steps'; under 'time' from its measured speed (`plan`),
  timed before the first round and again in every round (`measured`)."""

  def __init__(self, round_budget: str):
    self._timed = round_budget == "time"
    # island -> its seconds per inner step: the median of its last
    # _MEASUREMENTS rounds' (one round's can be slowed by another
    # island's compile or the coordinator's step beside it).
    self.seconds_per_step = {}
    self._history = {}

  def plan(self, fleet, starts: dict, steps: int) -> dict[int, int] | None:
    """island -> its steps of a round of H = `steps`, or None (all H);
    `fleet` times its members before the first round (`starts`: island ->
    the params each starts from)."""
    if not self._timed:
      return None
    if not self.seconds_per_step:
      self.seconds_per_step.update(fleet.measure_step_seconds(starts))
    return island_steps(self.seconds_per_step, steps)

  def steps_of(self, island: int, steps: int) -> int:
    """`island`'s steps of a round of H = `steps`, from the speeds
    measured so far (H under 'steps', or before any measurement)."""
    if not self._timed:
      return steps
    return island_steps(self.seconds_per_step, steps).get(island, steps)

  def measured(self, results: dict) -> None:
    """Takes the islands' step times of a round's results."""
    for i, result in results.items():
      if result.get("step_seconds") is None:
        continue
      history = self._history.setdefault(i, [])
      history.append(result["step_seconds"])
      del history[:-_MEASUREMENTS]
      self.seconds_per_step[i] = statistics.median(history)
