"""Which islands are members of an elastic run in each round.

The run's `config.diloco.islands` are its slots: each slot has its own
rows of the data, its own stream position and (with error feedback) its
own residual at the coordinator. A member is a slot with a process
training it. Membership changes only at round boundaries and comes from,
in this order:

1. the control file `WORKDIR/members.json`, written while the run trains
   by `python -m diloco_jax.elastic.members --workdir=DIR --islands=0,2`;
2. else `config.diloco.island_schedule` ('A->B' ramps from A to B
   members, 'A<->B' alternates), the first N slots being the members;
3. else every slot.

A slot that joins gets a fresh process, which starts from the round's x
on the batches after its slot's stream position; a slot that leaves has
its process ended (its position and residual wait at the coordinator).
"""

import json
import os
import pathlib

from diloco_jax.algorithm import participation

CONTROL_FILE = "members.json"


def members(workdir: str, slots: int, schedule: str, round_index: int,
            rounds: int) -> tuple[list[int], str | None]:
  """The members of round `round_index` (0-based) of `rounds`, and why the
  control file was not used when it exists but cannot be (else None): a
  bad file must not stop a run that is training, so it is reported and
  the schedule holds until the file is fixed."""
  path = pathlib.Path(workdir) / CONTROL_FILE
  problem = None
  if path.exists():
    try:
      return parse(json.loads(path.read_text())["islands"], slots), None
    except (ValueError, KeyError, TypeError) as error:
      problem = f"{path} ignored: {error}"
  count = participation.active_count(schedule, slots, round_index, rounds)
  return list(range(count)), problem


def parse(islands, slots: int) -> list[int]:
  """A sorted list of distinct slot indices in [0, slots), at least one;
  ValueError naming what is wrong."""
  given = islands
  if isinstance(islands, str):
    islands = [part for part in islands.split(",") if part.strip()]
  try:
    chosen = sorted({int(island) for island in islands})
  except (TypeError, ValueError):
    raise ValueError(f"islands {given!r} are not slot numbers") from None
  if not chosen or chosen[0] < 0 or chosen[-1] >= slots:
    raise ValueError(f"islands {given!r} must be one or more of the "
                     f"run's slots 0..{slots - 1} (config.diloco.islands="
                     f"{slots})")
  return chosen


def write(workdir: str, islands: list[int] | None) -> None:
  """Sets the members from the next round on (None: back to the schedule),
  replacing the control file in one rename so the run never reads half."""
  path = pathlib.Path(workdir) / CONTROL_FILE
  if islands is None:
    path.unlink(missing_ok=True)
    return
  partial = path.with_suffix(".partial")
  partial.write_text(json.dumps({"islands": islands}))
  os.replace(partial, path)
