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

A control file that cannot be used (anything but `{"islands": [...]}` of
slot numbers the members command accepts: `parse`, the one check of both)
never stops a run: it is reported once per content and ignored as if it
had not been written, the run going on with the members the file last
gave (or the schedule's, if it gave none).

A slot that joins gets a fresh process, which starts from the round's x
on the batches after its slot's stream position; a slot that leaves has
its process ended (its position and residual wait at the coordinator).
"""

import json
import os
import pathlib
import re
import stat

from diloco_jax.algorithm import participation

CONTROL_FILE = "members.json"

# A control file larger than this is not one the command wrote (it writes
# a few bytes a slot): refused unread.
_MAX_BYTES = 1 << 20


class Members:
  """The members of each round of an elastic run of `slots` slots and
  `rounds` rounds, read from WORKDIR/members.json before each round."""

  def __init__(self, workdir: str, slots: int, schedule: str, rounds: int):
    self._path = pathlib.Path(workdir) / CONTROL_FILE
    self._slots = slots
    self._schedule = schedule
    self._rounds = rounds
    self._last_good = None  # the members the file last gave, if any
    self._reported = None  # the bad content last reported

  def of_round(self, round_index: int) -> tuple[list[int], str | None]:
    """The members of round `round_index` (0-based), and why the control
    file was ignored (None when it was not, or when the same content was
    reported already)."""
    content, problem = _read(self._path)
    if content is None and problem is None:  # no file: the schedule's
      self._last_good = self._reported = None
    elif problem is None:
      try:
        self._last_good = from_file(content, self._slots)
        self._reported = None
      except (ValueError, RecursionError) as error:
        problem = _short(str(error)) if isinstance(
            error, RecursionError) else str(error)
    if problem is not None:
      key = content if content is not None else problem
      if key == self._reported:
        problem = None
      else:
        self._reported = key
        problem = (f"{self._path} ignored: {problem}; the run goes on with "
                   + ("the members it last gave, "
                      f"{self._last_good}" if self._last_good is not None
                      else "config.diloco.island_schedule's members"))
    if self._last_good is not None:
      return list(self._last_good), problem
    count = participation.active_count(self._schedule, self._slots,
                                       round_index, self._rounds)
    return list(range(count)), problem


def members(workdir: str, slots: int, schedule: str, round_index: int,
            rounds: int) -> tuple[list[int], str | None]:
  """The members of round `round_index` (0-based) of `rounds` read once
  (Members.of_round of a reader that has seen no file before)."""
  return Members(workdir, slots, schedule, rounds).of_round(round_index)


def parse(islands, slots: int) -> list[int]:
  """The one check of a membership, the members command's and the control
  file's: `islands` as the command takes them (a string of comma-separated
  slot numbers, '0,2') or as the file holds them (a list of JSON
  integers); a sorted list of distinct slot indices in [0, slots), at
  least one. ValueError naming what is wrong."""
  given = islands
  if isinstance(islands, str):
    parts = [part.strip() for part in islands.split(",") if part.strip()]
    if not all(re.fullmatch(r"[0-9]+", part) for part in parts):
      raise ValueError(f"islands {_short(repr(given))} are not slot "
                       "numbers")
    islands = [int(part) for part in parts]
  if not isinstance(islands, list) or not all(
      type(island) is int for island in islands):  # not bool, not float
    raise ValueError(f"islands {_short(repr(given))} are not slot numbers: "
                     "a list of integers, e.g. [0, 2]")
  chosen = sorted(set(islands))
  if not chosen or chosen[0] < 0 or chosen[-1] >= slots:
    raise ValueError(f"islands {_short(repr(given))} must be one or more of "
                     f"the run's slots 0..{slots - 1} "
                     f"(config.diloco.islands={slots})")
  return chosen


def from_file(content: bytes, slots: int) -> list[int]:
  """The members a control file's bytes give ({"islands": [...]}, as
  `write` writes it); ValueError naming what is wrong."""
  try:
    value = json.loads(content.decode("utf-8"))
  except (ValueError, RecursionError) as error:  # RecursionError: nested
    raise ValueError(f"not JSON ({_short(str(error))})") from None
  if not isinstance(value, dict) or not isinstance(value.get("islands"),
                                                   list):
    raise ValueError(f'{_short(repr(value))} is not {{"islands": '
                     '[slot, ...]}')
  return parse(value["islands"], slots)


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


def _read(path: pathlib.Path) -> tuple[bytes | None, str | None]:
  """(the control file's bytes, None), (None, None) without a file, or
  (None, why it cannot be read): a directory, a pipe or a device is not
  read (a pipe's open or read would wait), nor more than _MAX_BYTES."""
  try:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
  except FileNotFoundError:
    return None, None
  except OSError as error:  # a directory, no permission, ...
    return None, f"cannot be read ({error.strerror or error})"
  try:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
      return None, "not a regular file"
    content = b""
    while len(content) <= _MAX_BYTES:
      chunk = os.read(fd, _MAX_BYTES + 1 - len(content))
      if not chunk:
        break
      content += chunk
    if len(content) > _MAX_BYTES:
      return None, f"larger than {_MAX_BYTES} bytes"
    return content, None
  except OSError as error:
    return None, f"cannot be read ({error.strerror or error})"
  finally:
    os.close(fd)


def _short(text: str) -> str:
  """`text` in a log line: cut at 80 characters."""
  return text if len(text) <= 80 else text[:77] + "..."
