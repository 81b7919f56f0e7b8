"""A prepared corpus's shard files, read and checked: the digest prepare
records as it writes a shard (ShardDigest), a shard opened for reads by
position whose content is checked against it (ShardFile), and every shard
of a directory checked at once (verify, `prepare --verify`).

Shards are read with pread, never memory-mapped: a mapped file cut under
a process kills it with SIGBUS, where a short read is one line naming the
shard. What is checked when, and its cost: token_shards's docstring.
"""
import dataclasses
import hashlib
import os
import stat

import numpy as np

from diloco_jax.data import errors
from diloco_jax.data import token_shards

_INDEX = token_shards.INDEX_FILE


class ShardDigest:
  """What identifies a shard's content, taken over its ids as they are
  written (prepare) or read back (ShardFile): the sha256 of the bytes and
  the largest id."""

  def __init__(self):
    self._hash = hashlib.sha256()
    self.max_id = -1

  def update(self, ids: np.ndarray) -> None:
    """Adds the next ids, in the shard's dtype, as they lie in the file."""
    self._hash.update(memoryview(np.ascontiguousarray(ids)).cast("B"))
    if ids.size:
      self.max_id = max(self.max_id, int(ids.max()))

  @property
  def sha256(self) -> str:
    return self._hash.hexdigest()


# Bytes read at a time while checking a shard's content.
_VERIFY_CHUNK_BYTES = 8 * 2**20


class ShardFile:
  """One shard, open for reads by position (pread, no memory map).

  Opening it refuses, in one line naming the file, a shard that is gone,
  not a regular file (a FIFO would block every read), or of another size
  than the index says; with `verify`, also one whose bytes are not those
  prepare wrote (sha256 and largest id, read once: ShardDigest). A read
  that comes back short (the file was cut while the run read it) is the
  same one line. Close it, or let it be collected.
  """

  def __init__(self, index: token_shards.TokenIndex,
               shard: token_shards.Shard, verify: bool = True,
               field: str = "config.data.path"):
    self.path = index.directory / shard.file
    self._shard, self._dtype, self._field = shard, index.dtype, field
    self._fd = None
    try:
      # Opening a FIFO would wait for a writer: refused unopened.
      if not stat.S_ISREG(os.stat(self.path).st_mode):
        raise self._error("is not a regular file")
      self._fd = os.open(self.path, os.O_RDONLY)
      info = os.fstat(self._fd)
    except OSError as error:
      self.close()
      raise self._error(f"cannot be opened ({error.strerror}): removed "
                        "while the run read the corpus?") from None
    expected = shard.tokens * self._dtype.itemsize
    if info.st_size != expected:
      self.close()
      raise self._error(
          f"holds {info.st_size} bytes, not the {expected} that "
          f"{_INDEX} says: truncated or overwritten since it was "
          "prepared")
    self.identity = (info.st_dev, info.st_ino, info.st_size,
                     info.st_mtime_ns)
    if verify:
      self.check_content()

  def _error(self, problem: str) -> errors.DataError:
    return errors.DataError(f"{self._field}: shard {self.path} {problem}")

  def digest(self) -> ShardDigest:
    """Reads the whole shard: its bytes' ShardDigest."""
    digest = ShardDigest()
    chunk = _VERIFY_CHUNK_BYTES // self._dtype.itemsize
    for start in range(0, self._shard.tokens, chunk):
      digest.update(self.read(start, min(chunk, self._shard.tokens - start)))
    return digest

  def check_content(self) -> None:
    """Reads the whole shard: DataError (the file closed) unless its
    sha256 and largest id are those the index records."""
    digest = self.digest()
    if (digest.sha256, digest.max_id) != (self._shard.sha256,
                                          self._shard.max_id):
      self.close()
      raise self._error(
          f"is not the shard prepare wrote: its bytes' sha256 is "
          f"{digest.sha256[:16]}.. and its largest id {digest.max_id}, "
          f"where {_INDEX} says {self._shard.sha256[:16]}.. and "
          f"{self._shard.max_id} (overwritten since?); prepare it again")

  def read(self, start: int, count: int) -> np.ndarray:
    """Tokens [start, start + count) of the shard, in its dtype."""
    out = np.empty(count, self._dtype)
    view, offset = memoryview(out).cast("B"), start * self._dtype.itemsize
    done = 0
    while done < view.nbytes:
      try:
        got = os.preadv(self._fd, [view[done:]], offset + done)
      except OSError as error:
        raise self._error(f"cannot be read ({error.strerror})") from None
      if got == 0:
        raise self._error(
            f"ended at byte {offset + done}, before the "
            f"{self._shard.tokens * self._dtype.itemsize} that {_INDEX} "
            "says: cut while the run read it?")
      done += got
    return out

  def close(self) -> None:
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None

  def __del__(self):
    self.close()


def verify(index: token_shards.TokenIndex,
           field: str = "--output") -> token_shards.TokenIndex:
  """Reads every shard and checks it against the index (ShardFile's
  checks); an index an older prepare wrote without checksums
  (read_index(..., unchecked=True)) gets them: its shards are read, their
  sha256 and largest id recorded, and index.json replaced atomically.
  Returns the index as it stands now; DataError in one line on the first
  shard that fails."""
  splits = {}
  for split in token_shards.SPLITS:
    shards = []
    for shard in index.splits[split]:
      recorded = bool(shard.sha256)
      shard_file = ShardFile(index, shard, verify=recorded, field=field)
      if not recorded:
        digest = shard_file.digest()
        shard = dataclasses.replace(shard, sha256=digest.sha256,
                                    max_id=digest.max_id)
      shard_file.close()
      token_shards.check_shard(index, shard, field)
      shards.append(shard)
    splits[split] = tuple(shards)
  checked = dataclasses.replace(index, splits=splits)
  if checked != index:
    token_shards.write_json_atomically(index.directory / _INDEX,
                                      token_shards.to_json(checked))
  return checked
