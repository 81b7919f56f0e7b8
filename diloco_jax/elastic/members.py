r"""Changes which islands train in a running elastic run, from its next round:

  python -m diloco_jax.elastic.members --workdir=DIR --islands=0,1,3
  python -m diloco_jax.elastic.members --workdir=DIR --islands=schedule

A slot that joins starts a process and trains from the next round's x; one
that leaves has its process ended after its round; `schedule` hands the
membership back to config.diloco.island_schedule (every slot by default).
The slots are checked by membership.parse, as the run checks the file.
"""

import json
import pathlib

from absl import app
from absl import flags

from diloco_jax.elastic import membership

_WORKDIR = flags.DEFINE_string("workdir", None,
                               "The elastic run's directory.")
_ISLANDS = flags.DEFINE_string(
    "islands", None, "Slots to train, comma-separated (e.g. 0,2), or "
    "'schedule'.")
flags.mark_flags_as_required(["workdir", "islands"])


def main(argv):
  del argv
  config_file = pathlib.Path(_WORKDIR.value) / "config.json"
  try:
    slots = json.loads(config_file.read_text())["diloco"]["islands"]
    if type(slots) is not int or slots < 1:
      raise ValueError(f"config.diloco.islands={slots!r}")
  except (OSError, ValueError, KeyError, TypeError) as error:
    raise SystemExit(f"error: --workdir={_WORKDIR.value!r} is not an "
                     f"elastic run's directory ({error})") from None
  if _ISLANDS.value == "schedule":
    membership.write(_WORKDIR.value, None)
    print("members: config.diloco.island_schedule's from the next round")
    return
  try:
    islands = membership.parse(_ISLANDS.value, slots)
  except ValueError as error:
    raise SystemExit(f"error: --islands: {error}") from None
  membership.write(_WORKDIR.value, islands)
  print(f"members from the next round: {islands}")


if __name__ == "__main__":
  app.run(main)
