"""Bytes one island sends over the island link, for each thing a run does.

`LinkBytes` counts a DDP step, a DiLoCo sync of the whole model or of one
Streaming DiLoCo fragment, through the codec (the byte counts mirror the
collectives: compression.mean_bytes), and adds them to a run's progress
counters (anything with comm_bytes, ddp_comm_bytes and fp32_comm_bytes).
"""

import functools

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.algorithm import overlap as overlap_lib
from diloco_jax.algorithm import schedule as schedule_lib
from diloco_jax.parallel import communication


class LinkBytes:
  """Bytes one island sends over the island link.

  DDP all-reduces float32 gradients every step; DiLoCo sends
  pseudo-gradients through the codec (at the round's low-rank ranks, or
  none for codecs without ranks), of every param or of one Streaming
  DiLoCo fragment; with FSDP each device of an island sends its own
  shards' part. With pipeline stages each stage reduces its own layers
  (and its piece of the other leaves) in a collective of its own: the
  island sends the sum over its stages, or with Streaming DiLoCo (a
  fragment per stage) one stage's share per send.
  """

  def __init__(self, config, param_shapes, islands: int, compression,
               layout=None):
    """`param_shapes`: the logical params (abstract); `layout`: the
    islands' stages.StageLayout, or None."""
    self._mode = config.mode
    self._islands = islands
    self._param_shapes = param_shapes
    self._compression = compression
    self._fragments = config.diloco.fragments
    # Eager updates end by averaging the islands' outer points: one float32
    # all-reduce of the params, as DDP's step sends.
    self._eager = (config.mode == "diloco" and overlap_lib.is_eager(
        config.diloco.get("overlap", "none")))
    self._stripes = config.mesh.data if config.mesh.fsdp else 1
    self._stages = 1 if layout is None else layout.stages
    # What one stage reduces (the whole params for one stage).
    self._stage_shapes = (param_shapes if layout is None
                          else layout.stage_shapes(param_shapes))
    self.ddp_step = self._stages * communication.island_mean_bytes(
        self._stage_shapes, islands, stripes=self._stripes)

  @functools.lru_cache(maxsize=None)  # few rank patterns recur
  def sync(self, rank_indices: tuple[int, ...] | None,
           fragment: int | None = None) -> int:
    """One sync through the codec: all params, or fragment `fragment`
    (`rank_indices` as compression.rank_indices gives them)."""
    if self._mode != "diloco":
      return self.ddp_step
    if self._stages > 1:  # Streaming DiLoCo: fragment s is stage s
      return self._stage_syncs(rank_indices, fragment)
    shapes = self._param_shapes
    if fragment is not None:
      assignment = fragments_lib.leaf_fragments(self._param_shapes,
                                                self._fragments)
      shapes = fragments_lib.select(self._param_shapes, assignment, fragment)
      if rank_indices is not None:
        rank_indices = tuple(rank_indices[i] for i in
                             fragments_lib.codec_positions(
                                 self._param_shapes, self._compression,
                                 assignment, fragment))
    return compression_lib.mean_bytes(shapes, self._islands,
                                      self._compression, rank_indices,
                                      self._stripes)

  def _stage_syncs(self, rank_indices, stage: int | None = None) -> int:
    """Every stage's sync of its own params (or only `stage`'s), at its own
    ranks."""
    per_stage = (None if rank_indices is None
                 else len(rank_indices) // self._stages)
    return sum(compression_lib.mean_bytes(
        self._stage_shapes, self._islands, self._compression,
        None if rank_indices is None
        else rank_indices[s * per_stage:(s + 1) * per_stage],
        self._stripes)
               for s in (range(self._stages) if stage is None else (stage,)))

  @functools.lru_cache(maxsize=None)
  def fp32_sync(self, fragment: int | None) -> int:
    """The same sync in float32 (what the codec is measured against)."""
    if fragment is None:
      return self.ddp_step
    if self._stages > 1:
      return self.ddp_step // self._stages  # one stage's share
    assignment = fragments_lib.leaf_fragments(self._param_shapes,
                                              self._fragments)
    return compression_lib.mean_bytes(
        fragments_lib.select(self._param_shapes, assignment, fragment),
        self._islands, compression_lib.as_compression(None), None,
        self._stripes)

  def count_step(self, progress) -> None:
    """An inner step: DDP's gradient all-reduce (what DDP would send, for
    every mode; what ddp does send)."""
    progress.ddp_comm_bytes += self.ddp_step
    if self._mode == "ddp":
      progress.comm_bytes += self.ddp_step
      progress.fp32_comm_bytes += self.ddp_step

  def count_syncs(self, progress, actions,
                  rank_indices: tuple[int, ...] | None, sending: int) -> None:
    """The schedule's `actions` after a step, of which `sending` islands
    took part. Per island, as everywhere: an island that does not take
    part sends nothing (in the SPMD program it sends zeros)."""
    for action in actions:
      if action.kind in (schedule_lib.OUTER, schedule_lib.SEND):
        progress.comm_bytes += (self.sync(rank_indices, action.fragment)
                                * sending // self._islands)
        progress.fp32_comm_bytes += self.fp32_sync(action.fragment)
      elif action.kind == schedule_lib.FLUSH and self._eager:
        progress.comm_bytes += self.ddp_step
        progress.fp32_comm_bytes += self.ddp_step
