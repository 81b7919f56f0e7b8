"""Which islands take part in each round: schedules and dropped syncs.

The DiLoCo paper varies the number of islands over training (its
adaptive-compute study) and drops islands' outer gradients at random (its
dropped-communication study). Both are a per-round mask over the islands,
a pure function of the round (`Participation`, built once from the
config), so a resumed run draws the same masks.

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

import dataclasses
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


def _active(parsed: tuple[str, int, int] | None, num_islands: int,
            round_index: int, num_rounds: int) -> int:
  """How many islands a parsed schedule (None: all) makes active."""
  if parsed is None:
    return num_islands
  kind, first, last = parsed
  if kind == "alternate":
    return first if round_index % 2 == 0 else last
  if num_rounds <= 1:
    return first
  # Linear in the round, rounded half up, so A->B and B->A mirror.
  fraction = round_index / (num_rounds - 1)
  return int(np.floor(first + (last - first) * fraction + 0.5))


def _mask(active: int, num_islands: int, round_index: int,
          drop_probability: float, seed: int) -> np.ndarray:
  mask = np.zeros(num_islands, bool)
  mask[:active] = True
  if drop_probability > 0:
    draws = np.random.default_rng([seed, round_index]).random(num_islands)
    mask &= draws >= drop_probability
  return mask


def active_count(schedule: str, num_islands: int, round_index: int,
                 num_rounds: int) -> int:
  """How many islands the schedule makes active in round `round_index`
  (0-based) of `num_rounds`."""
  parsed = parse_schedule(schedule, num_islands) if schedule else None
  return _active(parsed, num_islands, round_index, num_rounds)


def round_mask(num_islands: int, round_index: int, num_rounds: int,
               schedule: str = "", drop_probability: float = 0.0,
               seed: int = 0) -> np.ndarray:
  """[num_islands] bool: the islands whose sync counts in this round."""
  return _mask(active_count(schedule, num_islands, round_index, num_rounds),
               num_islands, round_index, drop_probability, seed)


@dataclasses.dataclass(frozen=True)
class Participation:
  """The islands synced at the end of each step's round, for a run whose
  schedule was parsed once (parse_schedule).

  Attributes:
    num_islands: k.
    inner_steps: H.
    schedule: parse_schedule's (kind, A, B), or None: every island.
    drop_probability: each active island's sync dropped with it.
    seed: seeds the drops.
    first_round: rounds before it are the pretraining's (rounds count from
      the end of config.pretrain_steps).
    num_rounds: the rounds after the pretraining.
    synced: False outside DiLoCo: every island takes part every step.
  """
  num_islands: int
  inner_steps: int
  schedule: tuple[str, int, int] | None = None
  drop_probability: float = 0.0
  seed: int = 0
  first_round: int = 0
  num_rounds: int = 1
  synced: bool = True

  def __call__(self, step: int) -> np.ndarray:
    """[num_islands] bool: the islands synced at the end of `step`'s
    round."""
    if not self.synced:
      return np.ones(self.num_islands, bool)
    round_index = -(-step // self.inner_steps) - 1 - self.first_round
    return _mask(_active(self.schedule, self.num_islands, round_index,
                         self.num_rounds),
                 self.num_islands, round_index, self.drop_probability,
                 self.seed)


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
