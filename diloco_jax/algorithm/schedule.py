"""The host-side schedule: what runs after each inner step.

DiLoCo, its one-step-delay overlap and Streaming DiLoCo differ in when the
islands' work is averaged and folded back, not in the programs that do it.
A run's `Schedule` answers, for each inner step, the synchronization
actions to run after it, whether the step ends a round, is evaluated, or is
checkpointed, as pure functions of the step (and the rounds done), so a
resumed run replays the same actions from any checkpoint:

  OUTER       DiLoCo's outer step (all params; with one-step delay it applies
              the previous round's mean and leaves this round's in flight)
  FLUSH       one-step delay, at the last step: apply the mean in flight
  SEND p      Streaming DiLoCo: average fragment p and step its x
  MERGE p     Streaming DiLoCo: fold fragment p's x into the islands

Evaluation and checkpoints follow config.eval and config.checkpoint, at
rounds' ends (and every N steps for checkpoints), and always at the last
step.
"""

import dataclasses

OUTER, FLUSH, SEND, MERGE = "outer", "flush", "send", "merge"


@dataclasses.dataclass(frozen=True)
class Action:
  """One program to run: `kind`, and the fragment for SEND and MERGE."""
  kind: str
  fragment: int | None = None


@dataclasses.dataclass(frozen=True)
class Schedule:
  """When a run synchronizes.

  Attributes:
    mode: 'diloco', 'ddp' or 'single' (only DiLoCo synchronizes here; ddp
      averages gradients inside its inner step).
    inner_steps: H.
    total_steps: the run's last step.
    overlap: config.diloco.overlap ('none', or a delayed one whose last
      mean is flushed after the last outer step).
    fragments: P; streaming when `streaming` is set.
    fragment_delay: tau, inner steps between a fragment's send and merge.
    streaming: whether fragments are synced on their own schedules.
    eval_every_rounds: evaluate the end of every N-th round (0: only the
      last step).
    checkpoint_every_rounds: checkpoint after every N-th round done (0:
      off).
    checkpoint_every_steps: also checkpoint every N inner steps (0: off).
  """
  mode: str
  inner_steps: int
  total_steps: int
  overlap: str = "none"
  fragments: int = 1
  fragment_delay: int = 0
  streaming: bool = False
  eval_every_rounds: int = 1
  checkpoint_every_rounds: int = 1
  checkpoint_every_steps: int = 0

  def ends_round(self, step: int) -> bool:
    """Whether `step` is the last of a round (or of the run)."""
    return step % self.inner_steps == 0 or step == self.total_steps

  def evaluates(self, step: int) -> bool:
    """Whether the params after `step` (and its syncs) are evaluated."""
    if step == self.total_steps:
      return True
    every = self.eval_every_rounds
    return bool(every and step % self.inner_steps == 0
                and (step // self.inner_steps) % every == 0)

  def checkpoints(self, step: int, rounds_done: int) -> bool:
    """Whether the state after `step` is saved, `rounds_done` rounds
    counted with it."""
    if step == self.total_steps:
      return True
    every_rounds = self.checkpoint_every_rounds
    every_steps = self.checkpoint_every_steps
    return ((self.ends_round(step) and every_rounds
             and rounds_done % every_rounds == 0)
            or bool(every_steps and step % every_steps == 0))

  def offset(self, fragment: int) -> int:
    """Fragment p syncs at the steps t with t = p * H / P (mod H)."""
    return fragment * self.inner_steps // self.fragments

  def sends_at(self, step: int) -> list[int]:
    """The fragments sent after `step`: those at their offset, and at the
    last step every fragment not sent there yet, so the final x holds all
    of the islands' work."""
    if step == self.total_steps:
      return list(range(self.fragments))
    return [p for p in range(self.fragments)
            if step % self.inner_steps == self.offset(p) % self.inner_steps]

  def merges_at(self, step: int) -> list[int]:
    """With tau > 0, the fragments folded back after `step`: those sent tau
    steps before, and at the last step those still in flight."""
    if self.fragment_delay == 0:
      return []  # every send merges at once
    sent = step - self.fragment_delay
    merges = set(self.sends_at(sent)) if sent > 0 else set()
    if step == self.total_steps:
      for early in range(max(1, sent + 1), step):
        merges.update(self.sends_at(early))
    return sorted(merges)

  def after(self, step: int) -> list[Action]:
    """The actions to run after inner step `step` (1-based), in order."""
    if self.mode != "diloco":
      return []
    if not self.streaming:
      actions = []
      if step % self.inner_steps == 0 or step == self.total_steps:
        actions.append(Action(OUTER))
        if self.overlap != "none" and step == self.total_steps:
          actions.append(Action(FLUSH))
      return actions
    # Pending merges first, so a fragment sent again at the last step
    # sends from its merged params; a send with tau = 0 (or at the end)
    # merges at once.
    actions = [Action(MERGE, p) for p in self.merges_at(step)]
    for p in self.sends_at(step):
      actions.append(Action(SEND, p))
      if self.fragment_delay == 0 or step == self.total_steps:
        actions.append(Action(MERGE, p))
    return actions
