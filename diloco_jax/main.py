r"""Runs one training job: `python -m diloco_jax.main --config=... --workdir=...`.

Examples:
  python -m diloco_jax.main --config=configs/default.py --workdir=/tmp/run
  python -m diloco_jax.main --config=configs/tiny.py --workdir=/tmp/t \
      --config.mode=ddp --config.diloco.islands=2
"""

import time

_LAUNCH_TIME = time.time()  # first thing: startup_s counts from here

# pylint: disable=g-import-not-at-top,wrong-import-position
import os
import sys
import threading

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from diloco_jax.config import config_files
from diloco_jax.telemetry import quiet_logs

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a config file with get_config().",
    lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for metrics.jsonl, summary.json, TensorBoard.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "host:port of process 0, for multi-host runs (jax.distributed; default: "
    "$JAX_COORDINATOR_ADDRESS, or what JAX detects on SLURM, TPU, Open MPI).")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None,
    "Number of processes in a multi-host run (default: $JAX_NUM_PROCESSES "
    "or detected).")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None,
    "This process's index in a multi-host run (default: $JAX_PROCESS_ID or "
    "detected).")
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    "heartbeat_timeout_s", 30,
    "Multi-host: a process silent this long is declared dead and the others "
    "stop with an error instead of waiting for it.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", None,
    "Host CPU devices each process creates (default: one island slot per "
    "island, islands x data x stage, divided among the processes). Islands "
    "fold onto fewer: --cpu_devices=1 runs a process's islands on one "
    "device. Ignored when XLA_FLAGS sets "
    "--xla_force_host_platform_device_count.")
flags.mark_flags_as_required(["config", "workdir"])


def _configure_devices(config) -> None:
  """Sets up devices; must run before JAX touches a backend.

  Islands fold onto whatever devices there are. Host CPU devices cost
  nothing to create, and on 2 cores the default config trains 1.27x faster
  with its 4 islands on 4 devices than folded onto 1, so a CPU run gets one
  device slot per island unless --cpu_devices says otherwise. On GPU/TPU
  this only adds host CPU devices beside the accelerators, which do no
  harm.
  """
  # pylint: disable=g-import-not-at-top
  import jax
  from diloco_jax.config import run_config
  from diloco_jax.parallel import multihost
  # pylint: enable=g-import-not-at-top
  if "xla_force_host_platform_device_count" not in os.environ.get(
      "XLA_FLAGS", ""):
    count = _CPU_DEVICES.value
    if count is None:
      try:
        slots = int(run_config.effective_islands(config)
                    * run_config.devices_per_island(config))
      except (TypeError, ValueError):
        slots = 1  # validation will name the bad field
      processes = multihost.process_count_hint(_NUM_PROCESSES.value)
      count = -(-slots // processes)  # this process's share, rounded up
      if config.diloco.get("outer_placement") == "host":
        # The outer side's own devices, one per pipeline stage (on
        # CPU-only hosts set aside from these, beside GPUs or TPUs these
        # are the host devices it uses).
        count += max(int(config.mesh.get("stage", 1) or 1), 1)
    jax.config.update("jax_num_cpu_devices", max(count, 1))
  multihost.initialize(_COORDINATOR.value, _NUM_PROCESSES.value,
                       _PROCESS_ID.value, _HEARTBEAT_TIMEOUT.value)


def _drop_closed_loop_callbacks(unraisable) -> None:
  """sys.unraisablehook: drops the "Event loop is closed" errors that
  tensorstore's callbacks raise when a failed checkpoint save's asyncio
  loop ended before its other writes did (one traceback per write, up to
  hundreds); the failure itself reaches the run as an exception. Others
  go to the default hook."""
  if not (unraisable.exc_type is RuntimeError
          and str(unraisable.exc_value) == "Event loop is closed"):
    sys.__unraisablehook__(unraisable)


class _LogLines:
  """The log's filter: an error exit prints its one line and nothing else.

  Lines are held back until the run has started writing in its workdir
  (train_and_evaluate's `started`): a run refused before then (a bad
  config or corpus, a workdir in use, a disk full from the start) prints
  only its error, and one that starts prints them then, in order.
  Dropped at any time: what quiet_logs.QuietLibraries drops, orbax's
  warnings and errors and asyncio's of orbax's tasks ("Task exception was
  never retrieved", with a traceback): of orbax's internals, or of a
  failed write, which reaches the run as an exception and ends it in one
  line naming the path (printed first, from orbax's threads, they would
  come before that line); and JAX's note that it found no TPU.
  """

  def __init__(self):
    self._quiet = quiet_logs.QuietLibraries()
    self._lock = threading.Lock()
    self._held = []  # None once released

  def filter(self, record) -> bool:
    if not self._quiet.filter(record):
      return False
    orbax = f"{os.sep}orbax{os.sep}"
    if orbax in record.pathname or (
        record.name == "asyncio" and orbax in record.getMessage()) or (
            record.name == "jax._src.xla_bridge" and record.levelno <= 20
            and record.getMessage().startswith(
                "Unable to initialize backend")):
      return False
    with self._lock:
      if self._held is None:
        return True
      self._held.append(record)
      return False

  def release(self) -> None:
    """Prints the lines held back; from now on lines print at once."""
    with self._lock:
      held, self._held = self._held, None
    for record in held or ():
      logging.get_absl_handler().handle(record)


_LOG_LINES = _LogLines()


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with each mistake reported in one line: an
  unknown config field (with the nearest one), a bad value, a config file
  that does not load, an argument that is not a flag."""
  # Configs that import their siblings (`from configs import ...`) load
  # from any directory.
  config_files.importable(argv)
  # pylint: disable-next=g-import-not-at-top
  from diloco_jax.config import flag_errors
  remaining, problem = flag_errors.parse_flags(argv, _CONFIG)
  if problem:
    _exit(2, f"error: {problem}")
  return remaining


def _exit(code: int, message: str, failed: bool = True) -> None:
  """Prints `message` last and ends the process now.

  After the run has released its workdir and waited for what it could
  save, nothing is left to do; a library's thread still waiting (orbax's
  after a failed write, a compile abandoned by a signal) must not keep
  the process alive. The other processes of a multi-process run learn
  why (`failed`) or that this one stops with them.
  """
  # pylint: disable-next=g-import-not-at-top
  from diloco_jax.parallel import peer_watch
  peer_watch.leave(message if failed else None)
  peer_watch.exit_now(code, message)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  logging.get_absl_handler().addFilter(_LOG_LINES)
  sys.unraisablehook = _drop_closed_loop_callbacks
  config = _CONFIG.value
  _configure_devices(config)
  # pylint: disable=g-import-not-at-top
  from diloco_jax.algorithm import guards
  from diloco_jax.config import validation
  from diloco_jax.data import errors as data_errors
  from diloco_jax.parallel import peer_watch
  from diloco_jax.storage import checkpoints as checkpointing
  from diloco_jax.storage import files
  from diloco_jax.run import stops
  from diloco_jax.run import train
  from diloco_jax.storage import workdir
  # pylint: enable=g-import-not-at-top
  ran = []  # whether this run trained (else it had finished already)

  def started():
    ran.append(True)
    _LOG_LINES.release()

  try:
    summary = train.train_and_evaluate(
        config, _WORKDIR.value, launch_time=_LAUNCH_TIME, started=started)
  except stops.StopRequested as e:
    # Its line is the last one printed, once (not also as a log line).
    _exit(e.exit_code, str(e), failed=False)
  except KeyboardInterrupt:
    # A second Ctrl-C: the run was interrupted mid-step; any checkpoint
    # being saved was finished first.
    _exit(1, "interrupted: rerun the same command to resume from the last "
          "checkpoint")
  except (validation.ConfigError, workdir.WorkdirError,
          checkpointing.IncompatibleCheckpointError,
          checkpointing.UnreadableCheckpointsError, data_errors.DataError,
          guards.NonFiniteError, files.StorageError,
          files.UnsafeFileError) as e:
    # What the user can fix, in one line, the only one since the run's
    # last progress line: no traceback.
    _exit(1, f"error: {e}")
  except Exception:  # pylint: disable=broad-except
    # Often a collective cut short by a process that died: the peer watch
    # names it in one line if so; otherwise the error is raised as is,
    # after what led to it.
    _LOG_LINES.release()
    peer_watch.wait_for_a_verdict()
    raise
  _LOG_LINES.release()  # a run found finished already started nothing
  if not ran:
    logging.info("%s", finished_line(summary, _WORKDIR.value))
  peer_watch.finish()  # a multi-process run ends together


def finished_line(summary: dict, workdir: str) -> str:
  """What a rerun of a finished run says: its last line again, from its
  summary.json (run/train.py's `done:` line), and where that file is."""
  try:
    said = (f"final eval loss {summary['final_eval_loss']:.4f}, "
            f"{summary['tokens_per_s']:.0f} tokens/s, "
            f"{summary['comm_bytes'] / 1e6:.1f} MB sent")
  except (KeyError, TypeError, ValueError):  # a summary of another version
    said = "its results"
  return (f"done already: {said}; the summary is in "
          f"{os.path.join(workdir, 'summary.json')}")


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
