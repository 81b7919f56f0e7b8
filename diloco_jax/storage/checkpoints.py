"""Checkpoints of the whole run with orbax: every orbax call lives here.

A checkpoint holds the TrainState (global params, outer optimizer state, every
island's params and inner optimizer state, step, round) and a JSON record of
what the loop needs to continue exactly: per-island data positions, progress
inside the current round, the island count, the parameter shapes and the
config. Saves are asynchronous; orbax finalizes a step only once it is fully
written, so a process killed mid-save leaves the previous checkpoint intact.

Every save is checked first: a state holding NaN or inf is never written (so
`max_to_keep` can never push out the last good checkpoint for a bad one).
The record carries a digest of every array (integrity.py) and of itself;
restoring recomputes them, so a checkpoint whose bytes changed on disk is
set aside like an unreadable one.

A save that fails for want of storage (a read-only file system, a full
disk, a quota, a directory removed under it) raises files.StorageError
naming the directory and the reason; `abandon` then removes what the
failed save left half-written. The workdir removed under the run (its
run.lock gone) is such a failure too, whatever orbax raises of it, and no
new save starts there (orbax would make the directories again).
When checkpoints exist but none reads back, restoring raises
UnreadableCheckpointsError rather than letting the run start over.
"""

import contextlib
import dataclasses
import errno
import glob
import hashlib
import json
import os
import shutil
import threading
import time

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from diloco_jax.algorithm import guards
from diloco_jax.algorithm import state as state_lib
from diloco_jax.storage import files
from diloco_jax.storage import integrity
from diloco_jax.storage import legacy_state
from diloco_jax.storage import workdir as workdir_lib

STATE = "state"
META = "meta"
CHECKSUMS = "checksums"  # in the meta record: {leaf path: digest}
META_DIGEST = "meta_sha256"


def _meta_digest(meta: dict) -> str:
  body = {k: v for k, v in meta.items() if k != META_DIGEST}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class Checkpointer:
  """Saves and restores the run's state under `workdir/checkpoints`."""

  def __init__(self, workdir: str, max_to_keep: int = 3,
               async_save: bool = True, read_only: bool = False):
    """Opens workdir/checkpoints; `read_only` (another run's checkpoints)
    creates, removes and moves nothing there."""
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self._read_only = read_only
    # {step: why} of the checkpoints set aside when none read back and the
    # caller chose to start over (latest_readable).
    self.started_over_from = None
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else max_to_keep,
        save_interval_steps=0 if read_only else 1,
        enable_async_checkpointing=async_save,
        # A process killed mid-save leaves a temporary directory behind;
        # the next start removes it (the finalized steps are untouched).
        cleanup_tmp_directories=not read_only,
        create=not read_only,
        read_only=read_only)
    # orbax warns on opening a directory read-only, as a warm start opens
    # its source's on purpose: intact checkpoints read log no warning.
    with _dropped_log_line("Given directory is read only"):
      self._manager = ocp.CheckpointManager(
          self.directory, options=options, item_names=(STATE, META))
    # The workdir's lock, whose absence means the workdir is being removed
    # (None: no run holds this workdir, as in tests and read-only use).
    lock = os.path.join(os.path.dirname(self.directory),
                        workdir_lib.LOCK_FILE)
    self._sentinel = (lock if not read_only and os.path.exists(lock)
                      else None)

  def steps(self) -> list[int]:
    """Finalized checkpoint steps, oldest first."""
    return sorted(self._manager.all_steps())

  def save(self, step: int, state, meta: dict,
           inspect_state=integrity.inspect_state) -> None:
    """Starts saving `state` and `meta` at `step` (returns before it ends).

    Args:
      inspect_state: integrity.inspect_state, or a compiled equivalent.

    Raises:
      guards.NonFiniteError: the state holds NaN or inf; nothing is saved.
    """
    digests, nonfinite = inspect_state(state)
    problem = guards.state_problem(step, nonfinite)
    if problem:
      raise problem
    meta = {**meta, CHECKSUMS: digests}
    meta[META_DIGEST] = _meta_digest(meta)
    with self._storage_errors():
      if self._workdir_removed() or not os.path.isdir(self.directory):
        # orbax would make them again: a removal is a failure to report.
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT),
                                self.directory)
      self._manager.save(step, args=ocp.args.Composite(**{
          STATE: ocp.args.StandardSave(state),
          META: ocp.args.JsonSave(meta),
      }), force=True)

  @contextlib.contextmanager
  def _storage_errors(self):
    """Turns a failure to write (here or in a save still in flight, which
    orbax reports at the next call) into one StorageError."""
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      reason = files.os_reason(e)
      if reason is None and (self._workdir_removed()
                             or not os.path.isdir(self.directory)):
        # Removed under the run (orbax's threads may have made the
        # directory again): whatever tensorstore or orbax says of it then.
        reason = os.strerror(errno.ENOENT)
      if reason is None:
        raise  # not a storage failure: a bug to see whole
      raise files.StorageError(f"cannot write checkpoints in "
                               f"{self.directory}: {reason}") from e

  def abandon(self, wait_s: float = 5.0) -> None:
    """After a StorageError: removes the temporary directories of saves
    that did not finish (orbax would on the next start; a full disk is
    better freed now). Finalized checkpoints are untouched.

    The failed save's threads get `wait_s` to give up first (else they
    would write again into what was removed). orbax's helper threads
    (writing arrays, shardings, metadata) outlive the save that failed
    before them, by seconds on a loaded machine, and recreate its
    directory: while one still runs, what they write is removed again
    every 0.2 s, for up to `wait_s` more; a thread stuck longer is
    abandoned, never waited for. A sweep that found something is repeated
    until one finds nothing.
    """
    if self._read_only or jax.process_index() != 0:
      return
    waiter = threading.Thread(target=self._wait_quietly, daemon=True)
    waiter.start()
    waiter.join(wait_s)
    give_up = time.monotonic() + wait_s
    while True:
      removed = self._remove_temporary_dirs()
      running = [thread for thread in (waiter, *_orbax_threads())
                 if thread.is_alive()]
      if not (removed or running) or time.monotonic() > give_up:
        return
      if running:  # (orbax's threads re-raise their error on join)
        time.sleep(0.2)

  def _workdir_removed(self) -> bool:
    return self._sentinel is not None and not os.path.lexists(
        self._sentinel)

  def _remove_temporary_dirs(self) -> bool:
    """Removes unfinished saves' directories; True if it removed any (one
    that cannot be removed, on a read-only disk, is not retried)."""
    removed = False
    for path in glob.glob(os.path.join(glob.escape(self.directory),
                                       "*.orbax-checkpoint-tmp*")):
      shutil.rmtree(path, ignore_errors=True)
      removed = removed or not os.path.exists(path)
    return removed

  def read_meta(self, step: int) -> dict:
    """The JSON record saved with `step` (cheap: no arrays are read).

    Raises:
      CorruptCheckpointError: the record's digest does not match it.
    """
    meta = self._manager.restore(step, args=ocp.args.Composite(**{
        META: ocp.args.JsonRestore()}))[META]
    if META_DIGEST in meta and meta[META_DIGEST] != _meta_digest(meta):
      raise CorruptCheckpointError("the meta record does not match its "
                                   "checksum")
    return meta

  def restore_state(self, step: int, abstract_state, checksums=None):
    """Reads the state saved at `step` into `abstract_state`'s shardings.

    Args:
      abstract_state: a pytree of jax.ShapeDtypeStruct with `.sharding` set,
        shaped as the checkpoint was written.
      checksums: the digests saved with it (meta[CHECKSUMS]), checked
        against what was read; None skips the check (older checkpoints).

    Raises:
      CorruptCheckpointError: an array differs from what was saved.
    """
    if (isinstance(abstract_state, state_lib.TrainState)
        and legacy_state.is_legacy(self._saved_fields(step))):
      # Written before the state held the outer state as one field: read
      # as it was written (its digests checked), then renamed.
      return legacy_state.current(
          self.restore_state(step, legacy_state.target(abstract_state),
                             checksums), abstract_state)
    target, absent = self._saved_fields_only(step, abstract_state)
    state = self._manager.restore(step, args=ocp.args.Composite(**{
        STATE: ocp.args.StandardRestore(target)}))[STATE]
    if absent is not None:
      state = abstract_state.replace(**state, **{name: None
                                                 for name in absent})
    if checksums is not None:
      mismatch = integrity.digest_mismatch(checksums,
                                           integrity.inspect_state(state)[0])
      if mismatch:
        raise CorruptCheckpointError(mismatch)
    return state

  def _saved_fields_only(self, step: int, abstract_state):
    """(restore target, fields left out): a state's fields that are None
    and that the checkpoint lacks (optional fields added to the state
    after it was written) are left out of the target and set to None
    after reading; (abstract_state, None) when there are none."""
    if not dataclasses.is_dataclass(abstract_state):
      return abstract_state, None
    saved = self._saved_fields(step)
    fields = [f.name for f in dataclasses.fields(abstract_state)]
    absent = [name for name in fields if name not in saved
              and getattr(abstract_state, name) is None]
    if not absent:
      return abstract_state, None
    return ({name: getattr(abstract_state, name) for name in fields
             if name not in absent}, absent)

  def _saved_fields(self, step: int) -> set[str]:
    """The top-level fields of the state saved at `step`."""
    # The item's own tree metadata, read by its handler: a Checkpointer's
    # metadata() would look for a step's _CHECKPOINT_METADATA inside the
    # item and warn "Metadata file does not exist" on every resume.
    return set(ocp.StandardCheckpointHandler().metadata(
        epath.Path(self.directory) / str(step) / STATE).keys())

  def latest_readable(self, restore_fn, steps=None,
                      start_over_if_unreadable: bool = False,
                      refusals: tuple = (), what: str = ""):
    """Restores the newest checkpoint that reads back, falling back on errors.

    Newer checkpoints that do not read back are set aside (see _set_aside),
    unless none reads back: then they stay where they are and the error
    lists them, so no rerun mistakes an empty directory for a new run.

    Args:
      restore_fn: called as restore_fn(step, meta); it must raise if the
        checkpoint cannot be used (a truncated or corrupted file).
      steps: the steps to try, oldest first (default: every one).
      start_over_if_unreadable: when none reads back, set them all aside
        and return None instead of raising.
      refusals: exception types restore_fn raises to refuse a checkpoint
        that reads back (raised at once, as IncompatibleCheckpointError).
      what: the checkpoints' role, to start UnreadableCheckpointsError's
        message (default: the run's own, with how to go on).

    Returns:
      (step, meta, whatever restore_fn returned), or None without
      checkpoints.

    Raises:
      UnreadableCheckpointsError: checkpoints exist, none reads back.
      IncompatibleCheckpointError: what restore_fn raised of it.
    """
    unreadable = {}
    for step in reversed(self.steps() if steps is None else steps):
      try:
        meta = self.read_meta(step)
        restored = restore_fn(step, meta)
      except (IncompatibleCheckpointError, *refusals):
        raise
      except Exception as e:  # pylint: disable=broad-except
        # Truncated or corrupted files surface as many error types (from
        # tensorstore, msgpack, json); any of them means "not this one".
        unreadable[step] = f"{type(e).__name__}: {files.first_line(e)}"
        logging.warning("checkpoint at step %d in %s is unreadable (%s); "
                        "falling back to the previous one", step,
                        self.directory, unreadable[step])
        continue
      self._set_aside(unreadable)
      return step, meta, restored
    if not unreadable:
      return None
    error = UnreadableCheckpointsError(self.directory, unreadable, what)
    if not start_over_if_unreadable:
      raise error
    self._set_aside(unreadable)
    self.started_over_from = unreadable
    logging.warning("%s; starting over as config.resume."
                    "from_scratch_if_unreadable asks", error)
    return None

  def _set_aside(self, steps) -> None:
    """Moves unreadable checkpoints out of the way, keeping them to inspect.

    The run will write those steps again; orbax refuses to overwrite them.
    """
    if not steps or self._read_only:
      return
    if jax.process_index() == 0:  # one process moves; all wait for it
      aside = self.directory + ".unreadable"
      os.makedirs(aside, exist_ok=True)
      for step in steps:
        os.replace(os.path.join(self.directory, str(step)),
                   os.path.join(aside, f"{step}.{int(time.time())}"))
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("checkpoints set aside")
    self._manager.reload()

  def _wait_quietly(self) -> None:
    try:
      self._manager.wait_until_finished()
    except Exception:  # pylint: disable=broad-except
      pass  # the failure was reported already

  def wait(self) -> None:
    """Blocks until the last save is on disk (StorageError if it failed)."""
    with self._storage_errors():
      self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for the last save (StorageError if it failed) and closes."""
    self.wait()
    self._manager.close()


def _orbax_threads() -> list[threading.Thread]:
  """The threads orbax started for its saves that are still running (its
  own Thread subclasses: the finalize and helper threads)."""
  return [thread for thread in threading.enumerate()
          if type(thread).__module__.startswith("orbax.")]


class IncompatibleCheckpointError(ValueError):
  """A checkpoint written for a different model; the message names the field."""


class CorruptCheckpointError(RuntimeError):
  """A checkpoint whose content no longer matches the digests saved with it."""


class UnreadableCheckpointsError(RuntimeError):
  """Checkpoints exist but none reads back; the message lists each and why.

  Attributes:
    unreadable: {step: why it did not read back}.
  """

  def __init__(self, directory: str, unreadable: dict[int, str],
               what: str = ""):
    """`what`: whose checkpoints (default: the run's own, with how to go
    on)."""
    self.unreadable = unreadable
    listed = "; ".join(f"step {step}: {why}"
                       for step, why in sorted(unreadable.items()))
    if what:
      message = f"{what}: no checkpoint in {directory} reads back ({listed})"
    else:
      message = (
          f"no checkpoint in {directory} reads back ({listed}); they are "
          "left in place: repair or remove them, or rerun with --config."
          "resume.from_scratch_if_unreadable=true to set them aside and "
          "train from step 0")
    super().__init__(message)


@contextlib.contextmanager
def _dropped_log_line(prefix: str):
  """While open, absl's log drops the messages that start with `prefix`."""

  class _Drop:

    def filter(self, record) -> bool:
      return not record.getMessage().startswith(prefix)

  drop = _Drop()
  logger = logging.get_absl_logger()
  logger.addFilter(drop)
  try:
    yield
  finally:
    logger.removeFilter(drop)
