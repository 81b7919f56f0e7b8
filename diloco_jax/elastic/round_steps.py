"""Which inner steps each elastic round's call covers, and under Streaming
DiLoCo which of the schedule's actions its islands run in it.

A round is one call to every member island and one close at the
coordinator. Without streaming a round is the run's round, H inner steps
ending in the outer step. Under streaming a round ends at each step after
which the run's schedule (algorithm/schedule.py, the one the SPMD loop
follows) sends a fragment: H / P steps, P rounds per H. The coordinator
runs the sends at the round's end; each island runs the merges itself, on
its own params, at the steps the schedule puts them: those tau steps after
a send inside the round, and a send's merge at once (tau 0) first thing in
the next round, which equals after the send since nothing trains between.
Pure functions of the run's schedule, so a resumed coordinator and every
island agree on them.
"""

from diloco_jax.algorithm import schedule as schedule_lib
from diloco_jax.config import run_config as run_config_lib


def round_ends(run_config: run_config_lib.RunConfig) -> list[int]:
  """The last inner step (1-based) of each elastic round, in order."""
  schedule = run_config.schedule
  total = run_config.config.total_steps
  if not run_config.streaming:
    inner_steps = run_config.diloco.inner_steps
    return [min(step, total) for step in range(inner_steps,
                                               total + inner_steps,
                                               inner_steps)]
  return [step for step in range(1, total + 1)
          if sends(schedule, step)]


def sends(schedule: schedule_lib.Schedule, step: int) -> list[int]:
  """The fragments sent after `step`, in the schedule's order (the
  coordinator's part of the round that ends there)."""
  return [action.fragment for action in schedule.after(step)
          if action.kind == schedule_lib.SEND]


def merges_before_sends(schedule: schedule_lib.Schedule,
                        step: int) -> list[int]:
  """The fragments an island merges after inner `step`: every merge of a
  step inside its round; at the round's last step those before its
  sends (the island's params go out merged)."""
  merges = []
  for action in schedule.after(step):
    if action.kind == schedule_lib.SEND:
      break
    merges.append(action.fragment)
  return merges


def merges_after_sends(schedule: schedule_lib.Schedule,
                       step: int) -> list[int]:
  """The fragments an island merges as its round from `step` starts: the
  merges the schedule puts after step's sends (at once with tau 0), which
  take the x those sends made."""
  actions = schedule.after(step)
  first = next((i for i, action in enumerate(actions)
                if action.kind == schedule_lib.SEND), len(actions))
  return [action.fragment for action in actions[first:]
          if action.kind == schedule_lib.MERGE]
