r"""Starts N local processes of one run: `python -m diloco_jax.launch`.

  python -m diloco_jax.launch --processes=2 -- \
      --config=configs/default.py --workdir=runs/two_hosts

Each process runs `python -m diloco_jax.main` with the flags after `--` and
the environment JAX reads to join one jax.distributed run
(JAX_COORDINATOR_ADDRESS on a free local port, JAX_NUM_PROCESSES,
JAX_PROCESS_ID); islands are spread over the processes as over hosts, and
each process creates its share of the CPU devices. This is how the tests run
several hosts on one machine, and how to try a multi-host setup before a
cluster.

Ctrl-C and SIGTERM are passed to every process, which stop together at the
same step with a checkpoint. If one process fails or is killed, the others
are stopped (SIGTERM, then SIGKILL after --grace_s) and the launcher exits
non-zero naming it; rerunning the same command resumes from the last
checkpoint. Processes die with the launcher even if it is killed outright.
"""

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags

_PROCESSES = flags.DEFINE_integer("processes", 2, "How many processes.",
                                  lower_bound=1)
_GRACE = flags.DEFINE_float(
    "grace_s", 10.0,
    "After one process fails: how long the others get to exit on SIGTERM "
    "before SIGKILL.")

_PR_SET_PDEATHSIG = 1  # prctl option: a signal for when the parent dies
_POLL_S = 0.2
_SETTLE_S = 3.0


def free_port() -> int:
  """A TCP port free on localhost now (the coordinator binds it next)."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _die_with_parent() -> None:
  """In the child before exec: SIGKILL when the launcher dies (Linux)."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG,
                                            signal.SIGKILL)
  except (OSError, AttributeError):  # not Linux: best effort
    pass


def _relay(stream, prefix: str) -> None:
  """Copies a child's output to ours, each line marked with its process."""
  for line in iter(stream.readline, b""):
    sys.stdout.buffer.write(prefix.encode() + line)
    sys.stdout.buffer.flush()
  stream.close()


def describe_exit(code: int) -> str:
  if code < 0:
    return f"was killed by {signal.Signals(-code).name}"
  return f"exited with code {code}"


def start(num_processes: int, main_args: list[str], port: int | None = None,
          python: str = sys.executable) -> list[subprocess.Popen]:
  """Starts the processes of one run; their output goes to ours, marked."""
  address = f"localhost:{port or free_port()}"
  children = []
  for index in range(num_processes):
    env = {**os.environ, "JAX_COORDINATOR_ADDRESS": address,
           "JAX_NUM_PROCESSES": str(num_processes),
           "JAX_PROCESS_ID": str(index)}
    child = subprocess.Popen(
        [python, "-m", "diloco_jax.main", *main_args], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        preexec_fn=_die_with_parent)
    threading.Thread(target=_relay, args=(child.stdout, f"[{index}] "),
                     daemon=True).start()
    children.append(child)
  return children


def supervise(children: list[subprocess.Popen], grace_s: float) -> int:
  """Waits for the processes; returns the run's exit code.

  Ctrl-C/SIGTERM are forwarded to all. When one process ends with an
  error, the others are stopped and its failure is reported.
  """
  stopping = []

  def forward(signum, _):
    stopping.append(signum)
    for child in children:
      if child.poll() is None:
        child.send_signal(signum)

  previous = {sig: signal.signal(sig, forward)
              for sig in (signal.SIGINT, signal.SIGTERM)}
  try:
    while True:
      codes = [child.poll() for child in children]
      if stopping and None not in codes:  # all saved and stopped together
        return max(codes, key=abs)
      failed = [(i, code) for i, code in enumerate(codes)
                if code not in (None, 0)]
      if failed and not stopping:
        index, code = failed[0]
        # An error every process finds (a bad config) ends them all at once:
        # wait a moment before calling the others hung.
        _wait_all(children, _SETTLE_S)
        if all(child.poll() for child in children):
          print(f"launch: every process exited with an error (process "
                f"{index} {describe_exit(code)}); see the messages above.",
                file=sys.stderr)
        else:
          _stop(children, grace_s)
          print(f"launch: process {index} {describe_exit(code)}; stopped "
                f"the other processes. Rerun the same command to resume "
                f"from the last checkpoint.", file=sys.stderr)
        return code if code > 0 else 128 - code
      if all(code == 0 for code in codes):
        return 0
      time.sleep(_POLL_S)
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def _wait_all(children: list[subprocess.Popen], seconds: float) -> None:
  deadline = time.monotonic() + seconds
  while (time.monotonic() < deadline
         and any(child.poll() is None for child in children)):
    time.sleep(_POLL_S)


def _stop(children: list[subprocess.Popen], grace_s: float) -> None:
  """SIGTERM to every live process, SIGKILL to those alive after grace_s
  (a process waiting in a collective for a dead peer cannot act on it)."""
  for child in children:
    if child.poll() is None:
      child.terminate()
  deadline = time.monotonic() + grace_s
  for child in children:
    try:
      child.wait(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
      child.kill()
      child.wait()


def main(argv):
  main_args = argv[1:]
  if not main_args:
    raise app.UsageError("give the flags of diloco_jax.main after '--'")
  children = start(_PROCESSES.value, main_args)
  sys.exit(supervise(children, _GRACE.value))


if __name__ == "__main__":
  app.run(main)
