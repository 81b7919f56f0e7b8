"""TensorBoard's event files, written in the training loop's own thread.

tensorboardX's SummaryWriter writes from a thread of its own: a write
that fails there (a read-only file system, a full disk) ends that thread
with a traceback nobody catches, and the loop then blocks on the writer's
full queue. Here each step's scalars are framed as TFRecords (the format
TensorBoard reads: length, masked CRC-32C of the length, the serialized
Event, its masked CRC-32C) and appended by the caller's thread through
files.AppendedFile, so a failed write is one StorageError like any other,
and an event file removed while the run writes is written again.
"""

import os
import socket
import struct
import time

from tensorboardX.proto import event_pb2
from tensorboardX.proto import summary_pb2
from tensorboardX.record_writer import masked_crc32c

from diloco_jax.storage import files


def _record(event: event_pb2.Event) -> bytes:
  """`event` framed as one TFRecord."""
  data = event.SerializeToString()
  header = struct.pack("<Q", len(data))
  return b"".join([header, struct.pack("<I", masked_crc32c(header)), data,
                   struct.pack("<I", masked_crc32c(data))])


class EventFile:
  """A new event file in `directory` for one attempt of a run.

  Points of steps >= `purge_step` left by an earlier attempt (a run killed
  after its last checkpoint) are hidden: the file starts with a SessionLog
  START at that step, which TensorBoard reads as "purge what follows".
  """

  def __init__(self, directory: str, purge_step: int,
               sentinel: str | None = None):
    """Creates the directory (if missing) and the file; `sentinel` as
    files.AppendedFile's.

    Raises:
      files.StorageError: either cannot be written.
      files.UnsafeFileError: the directory is a symlink.
    """
    files.refuse_symlink(directory)
    try:
      os.makedirs(directory, exist_ok=True)
    except OSError as e:
      raise files.storage_error("TensorBoard events in", directory,
                                e) from None
    self._file = self._create(directory, sentinel)
    now = time.time()
    self._file.append(
        _record(event_pb2.Event(wall_time=now, file_version="brain.Event:2"))
        + _record(event_pb2.Event(
            wall_time=now, step=purge_step,
            session_log=event_pb2.SessionLog(
                status=event_pb2.SessionLog.START))))

  @staticmethod
  def _create(directory: str, sentinel: str | None) -> files.AppendedFile:
    """A file of a name no attempt used (TensorBoard reads a directory's
    event files in name order: the time first, then a counter)."""
    name = (f"events.out.tfevents.{int(time.time()):010d}."
            f"{socket.gethostname()}")
    for attempt in range(1000):
      path = os.path.join(directory,
                          name + (f".{attempt}" if attempt else ""))
      try:
        return files.AppendedFile(path, "TensorBoard events", exclusive=True,
                                  remake_directory=True, sentinel=sentinel)
      except FileExistsError:
        continue
    raise files.StorageError(f"cannot write TensorBoard events {directory}: "
                             f"1000 files named {name}* exist")

  def add_scalars(self, step: int, scalars: dict[str, float]) -> None:
    """Appends the step's point of each scalar (StorageError on failure)."""
    if not scalars:
      return
    self._file.append(_record(event_pb2.Event(
        wall_time=time.time(), step=step,
        summary=summary_pb2.Summary(value=[
            summary_pb2.Summary.Value(tag=tag, simple_value=value)
            for tag, value in scalars.items()]))))

  def close(self) -> None:
    self._file.close()
