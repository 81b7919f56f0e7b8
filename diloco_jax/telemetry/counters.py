"""A run's counters: rounds, tokens and bytes, saved with each checkpoint."""

import dataclasses

import numpy as np


@dataclasses.dataclass
class Progress:
  """The run's counters, saved with each checkpoint and restored with it.

  A restart may change the island count, so per-island progress is cut or
  padded to the islands there are now.
  """
  islands: int
  rounds_done: int = 0
  tokens_seen: int = 0
  comm_bytes: int = 0  # what one island has sent
  ddp_comm_bytes: int = 0  # what DDP would have sent for the same steps
  fp32_comm_bytes: int = 0  # what the syncs would have sent uncompressed
  island_round_steps: np.ndarray = None  # steps since each island's last sync
  config_changes: list = dataclasses.field(default_factory=list)
  rollbacks: list = dataclasses.field(default_factory=list)
  initialized_from: dict | None = None  # warm_start.WarmStart.record
  # Each time the run started over because no checkpoint read back
  # (config.resume.from_scratch_if_unreadable): {step: why} set aside.
  started_over: list = dataclasses.field(default_factory=list)

  def __post_init__(self):
    steps = np.zeros(self.islands, np.int64)
    saved = list([] if self.island_round_steps is None
                 else self.island_round_steps)[:self.islands]
    steps[:len(saved)] = saved
    self.island_round_steps = steps

  @classmethod
  def from_meta(cls, meta: dict, islands: int) -> "Progress":
    names = {f.name for f in dataclasses.fields(cls)} - {"islands"}
    return cls(islands, **{k: v for k, v in meta.items() if k in names})

  def to_meta(self) -> dict:
    record = dataclasses.asdict(self)
    record["island_round_steps"] = self.island_round_steps.tolist()
    return record
