"""Which islands take part in each round: schedules and dropped syncs.

The DiLoCo paper varies the number of islands over training (its
adaptive-compute study) and drops islands' outer gradients at random (its
dropped-communication study). Both are a per-round mask over the islands,
a pure function of (config, round), so a resumed run draws the same masks.

- `config.diloco.island_schedule`: "A->B" ramps the active count linearly
  from A islands in the first round to B in the last (e.g. "1->8", "8->1");
  "A<->B" alternates A and B round by round, starting with A (islands
  leaving and joining again and again). The active islands are the first
  n. Empty: every island, every round.
- `config.diloco.drop_probability`: each active island's sync is dropped
  with this probability, independently per (round, island), seeded by
  config.seed.
- `config.diloco.dropped_islands`: 'train' (an inactive island trains the
  round and its pseudo-gradient is not sent; it restarts from x with the
  others, keeping its inner optimizer state) or 'idle' (its round's work is
  discarded and it rejoins from x with a fresh inner optimizer state; it is
  still computed, since islands run as one SPMD program, but its tokens do
  not count).
"""

import re

import numpy as np

DROPPED_ISLANDS = ("train", "idle")
_RAMP = re.compile(r"^\s*(\d+)\s*->\s*(\d+)\s*$")
_ALTERNATE = re.compile(r"^\s*(\d+)\s*<->\s*(\d+)\s*$")


def parse_schedule(schedule: str, num_islands: int) -> tuple[str, int, int]:
  """("ramp" | "alternate", A, B) of a schedule string; ValueError naming
  what is wrong (the caller adds the field's name)."""
  for kind, pattern in (("ramp", _RAMP), ("alternate", _ALTERNATE)):
    match = pattern.match(schedule)
    if match:
      first, last = int(match.group(1)), int(match.group(2))
      for count in (first, last):
        if not 1 <= count <= num_islands:
          raise ValueError(
              f"{schedule!r} asks for {count} islands; the run has "
              f"{num_islands} (config.diloco.islands), so counts must be "
              f"in 1..{num_islands}")
      return kind, first, last
  raise ValueError(f"{schedule!r} is not 'A->B' (a ramp from A to B active "
                   "islands) or 'A<->B' (A and B alternating), e.g. '1->8'")


def active_count(schedule: str, num_islands: int, round_index: int,
                 num_rounds: int) -> int:
  """How many islands the schedule makes active in round `round_index`
  (0-based) of `num_rounds`."""
  if not schedule:
    return num_islands
  kind, first, last = parse_schedule(schedule, num_islands)
  if kind == "alternate":
    return first if round_index % 2 == 0 else last
  if num_rounds <= 1:
    return first
  # Linear in the round, rounded half up, so A->B and B->A mirror.
  fraction = round_index / (num_rounds - 1)
  return int(np.floor(first + (last - first) * fraction + 0.5))


def round_mask(num_islands: int, round_index: int, num_rounds: int,
               schedule: str = "", drop_probability: float = 0.0,
               seed: int = 0) -> np.ndarray:
  """[num_islands] bool: the islands whose sync counts in this round."""
  mask = np.zeros(num_islands, bool)
  mask[:active_count(schedule, num_islands, round_index, num_rounds)] = True
  if drop_probability > 0:
    draws = np.random.default_rng([seed, round_index]).random(num_islands)
    mask &= draws >= drop_probability
  return mask


def step_masks(config, num_islands: int):
  """participants(step) -> [num_islands] bool: the islands synced at the end
  of `step`'s round under `config`. Rounds count from the end of the
  pretraining (config.pretrain_steps); outside DiLoCo every island takes
  part."""
  inner_steps = config.diloco.inner_steps
  first_round = -(-config.pretrain_steps // inner_steps)
  num_rounds = -(-config.total_steps // inner_steps) - first_round

  def participants(step: int) -> np.ndarray:
    if config.mode != "diloco":
      return np.ones(num_islands, bool)
    round_index = -(-step // inner_steps) - 1 - first_round
    return round_mask(num_islands, round_index, num_rounds,
                      config.diloco.island_schedule,
                      config.diloco.drop_probability, config.seed)
  return participants


def parse_nan_island(spec: str, num_islands: int) -> tuple[int, int]:
  """(island, round) of config.testing.nan_island 'ISLAND@ROUND' (round
  1-based); ValueError naming what is wrong."""
  match = re.match(r"^\s*(\d+)\s*@\s*(\d+)\s*$", spec)
  if not match:
    raise ValueError(f"{spec!r} is not 'ISLAND@ROUND', e.g. '1@3'")
  island, round_number = int(match.group(1)), int(match.group(2))
  if island >= num_islands or round_number < 1:
    raise ValueError(f"{spec!r}: the island must be in 0..{num_islands - 1} "
                     "and the round >= 1")
  return island, round_number
