"""Island batches read from pre-tokenized shards.

The "tokens" corpus: a directory `python -m diloco_jax.data.prepare` wrote
(token_shards). Islands own its train shards as they own streamed C4
shards (sharded_batches.iid_shards: island i reads shards i, i + k, ...)
and visit them in the same seeded order every epoch
(sharded_batches.shard_order). An island's stream is its shards' tokens
end to end, and each batch row is its next sequence_length + 1 tokens. A
shard holds its source's documents in order, each followed by EOS, so the
batches are bit for bit those the c4 corpus streams from the same shards
with the same tokenizer, without tokenizing anything.

Resuming: an island's position is three integers, (epoch, shard_position,
token_offset): restoring recomputes the epoch's shard order and maps one
shard, whatever the position.

Only the shard an island is reading is open (a corpus of a thousand
shards would otherwise hold a thousand file descriptors), and a batch row
is read from it by position in one read, or a few where it crosses
shards, converted to int32 on the way: the pages come from the OS's file
cache, nothing of the corpus is loaded into the process. The first time
this source opens a shard it reads it whole to check its checksum
(shard_files.ShardFile), and every batch's ids are checked against the
vocabulary (a max over the batch: microseconds), so no id the model
cannot embed ever reaches it.
"""
import numpy as np

from diloco_jax.data import errors
from diloco_jax.data import shard_files
from diloco_jax.data import sharded_batches
from diloco_jax.data import token_shards

_STATE_KEYS = ("epoch", "shard_position", "token_offset")


class _TokenStream:
  """One island's endless token stream over its shards, and its position."""

  def __init__(self, index: token_shards.TokenIndex, owned: range,
               island: int, seed: int, verified: set):
    self._index = index
    self._verified = verified  # identities of the shards checked already
    self._shards = index.splits["train"]
    self._owned = np.asarray(owned, dtype=np.int64)
    self._island = island
    self._seed = seed
    if sum(self._shards[shard].tokens for shard in owned) == 0:
      # An epoch without a token would loop forever.
      raise errors.DataError(
          f"config.data.path: island {island}'s {len(owned)} shard(s) of "
          f"{index.directory} hold no tokens")
    self._file = None
    self.restore({key: 0 for key in _STATE_KEYS})

  def _shard(self, position: int) -> token_shards.Shard:
    return self._shards[int(self._order[position])]

  def take_into(self, out: np.ndarray) -> None:
    """Fills the 1-D `out` with the stream's next out.size tokens."""
    filled = 0
    while filled < out.size:
      shard = self._shard(self._position)
      if self._offset == shard.tokens:
        self._next_shard()
        continue
      if self._file is None:
        self._file = self._open(shard)
      count = min(shard.tokens - self._offset, out.size - filled)
      out[filled:filled + count] = self._file.read(self._offset, count)
      filled += count
      self._offset += count

  def _open(self, shard: token_shards.Shard) -> shard_files.ShardFile:
    """The shard, its content checked the first time this source opens
    it (again if the file changed since: another inode, size or mtime)."""
    shard_file = shard_files.ShardFile(self._index, shard, verify=False)
    if shard_file.identity not in self._verified:
      shard_file.check_content()
      self._verified.add(shard_file.identity)
    return shard_file

  def reading(self) -> str:
    """The shard the stream reads now, for messages."""
    return str(self._index.directory / self._shard(self._position).file)

  def _close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None

  def _next_shard(self) -> None:
    self._position += 1
    self._offset = 0
    self._close()
    if self._position == self._owned.size:
      self._epoch, self._position = self._epoch + 1, 0
      self._order = sharded_batches.shard_order(self._owned, self._seed,
                                                self._island, self._epoch)

  def state(self) -> dict:
    """The position of the next token, as plain ints."""
    return {"epoch": self._epoch, "shard_position": self._position,
            "token_offset": self._offset}

  def restore(self, state: dict) -> None:
    """Continues from a position `state()` returned."""
    values = {key: state.get(key) if isinstance(state, dict) else None
              for key in _STATE_KEYS}
    if not all(isinstance(value, (int, np.integer))
               and not isinstance(value, bool) and value >= 0
               for value in values.values()):
      raise errors.DataError(
          f"data state of island {self._island} must hold integers >= 0 "
          f"{', '.join(_STATE_KEYS)}, got {state!r}")
    values = {key: int(value) for key, value in values.items()}
    if values["shard_position"] >= self._owned.size:
      raise errors.DataError(
          f"data state shard_position {values['shard_position']} is beyond "
          f"island {self._island}'s {self._owned.size} shards")
    self._epoch = values["epoch"]
    self._position = values["shard_position"]
    self._order = sharded_batches.shard_order(self._owned, self._seed,
                                              self._island, self._epoch)
    tokens = self._shard(self._position).tokens
    if values["token_offset"] > tokens:
      raise errors.DataError(
          f"data state token_offset {values['token_offset']} is beyond the "
          f"{tokens} tokens of island {self._island}'s shard")
    self._offset = values["token_offset"]
    self._close()


class TokenIslandBatches:
  """Batches [islands, batch_size, sequence_length + 1] int32 of a
  prepared corpus.

  Implements the batch-source protocol of `sources`: next_batch, state,
  restore, island_token_weights. With `islands` (a process's own, in a
  multi-process run) only those islands' streams are read; their batches
  and positions are those a single process would have for them.
  """

  def __init__(self, index: token_shards.TokenIndex, num_islands: int,
               batch_size: int, sequence_length: int, seed: int,
               islands: range | None = None):
    if num_islands < 1 or batch_size < 1:
      raise ValueError(f"num_islands ({num_islands}) and batch_size "
                       f"({batch_size}) must be positive")
    owned = sharded_batches.iid_shards(len(index.splits["train"]),
                                       num_islands)
    self._num_islands = num_islands
    self._vocab_size = index.vocab_size
    self._held = range(num_islands) if islands is None else islands
    self._row_shape = (batch_size, sequence_length + 1)
    verified = set()
    self._islands = [_TokenStream(index, owned[island], island, seed,
                                  verified)
                     for island in self._held]

  def next_batch(self) -> np.ndarray:
    """The next batch of every island held."""
    batch = np.empty((len(self._islands), *self._row_shape), np.int32)
    for island, rows in zip(self._islands, batch):
      island.take_into(rows.reshape(-1))  # a view: rows is contiguous
      # The checksum vouches for a shard as it was opened; this catches
      # bytes changed under the run since, before the model sees them.
      largest = int(rows.max())
      if largest >= self._vocab_size:
        raise errors.DataError(
            f"config.data.path: shard {island.reading()} gave token id "
            f"{largest}, beyond the tokenizer's {self._vocab_size} ids "
            "(changed while the run read it?)")
    return batch

  def reading(self) -> str:
    """The shard each island held reads now, for messages."""
    return "; ".join(f"island {number}: {island.reading()}"
                     for number, island in zip(self._held, self._islands))

  def state(self) -> dict:
    """JSON-serializable: {"islands": [position of each island held]}."""
    return {"islands": [island.state() for island in self._islands]}

  def restore(self, state: dict) -> None:
    """Continues exactly where the source that returned `state` was (the
    positions of every island, or of the islands held)."""
    positions = sharded_batches.held_positions(state, self._num_islands,
                                               self._held)
    for island, position in zip(self._islands, positions):
      island.restore(position)

  def island_token_weights(self) -> np.ndarray:
    """[num_islands] float64: 1 / num_islands, as for iid streamed shards
    (statistically alike, and every island reads as many tokens a step)."""
    return np.full(self._num_islands, 1.0 / self._num_islands)


def eval_sequences(index: token_shards.TokenIndex, sequence_length: int,
                   num_sequences: int) -> np.ndarray:
  """The first `num_sequences` sequences of the validation shards, read in
  order and only as far as needed: [num_sequences, L+1] int32."""
  out = np.empty(num_sequences * (sequence_length + 1), np.int32)
  if index.tokens("validation") < out.size:
    raise errors.DataError(
        f"config.eval: eval needs {num_sequences} sequences of "
        f"{sequence_length + 1} tokens, but the validation split holds only "
        f"{index.tokens('validation') // (sequence_length + 1)}")
  filled = 0
  for shard in index.splits["validation"]:
    count = min(shard.tokens, out.size - filled)
    shard_file = shard_files.ShardFile(index, shard)
    out[filled:filled + count] = shard_file.read(0, count)
    shard_file.close()
    filled += count
    if filled == out.size:
      break
  return out.reshape(num_sequences, sequence_length + 1)
