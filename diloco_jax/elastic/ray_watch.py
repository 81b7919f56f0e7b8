"""Ends the Ray processes an elastic run started when its coordinator ends,
however it ends (SIGKILL included).

Ray's head processes (the GCS server, the raylet, the dashboard, the log
monitor) die with the coordinator that started them (Ray sets
PR_SET_PDEATHSIG on them), and the islands' worker processes notice their
raylet's death within seconds; but the raylet's agents (ray::DashboardAgent,
ray::RuntimeEnvAgent), seeing the raylet die, first report its death to
the GCS, dead too, and wait out that call's 60 s timeout (Ray 2.60,
`_private/process_watcher.py`). Ray cannot be told not to start them, and
the run needs the runtime-env agent (each island's XLA_FLAGS).

So the coordinator starts this watch once its Ray is up (`start`): a
process of its own (its own session, so a Ctrl-C at the terminal does not
end it first), holding the read end of a pipe whose write end only the
coordinator has. When the coordinator ends, the kernel closes that end,
the watch reads end-of-file at once and SIGKILLs every process that holds
a file of the run's Ray session directory open (each Ray process of the
session keeps its log files there; no process outside the session does),
but the coordinator (whose driver logs are there too), then exits.
A coordinator that ends normally shuts Ray down first and then closes the
pipe (`stop`): the watch finds nothing left, or ends what is.

Run as a script (`python ray_watch.py SESSION_DIR COORDINATOR_PID`): it
imports nothing of the package (no JAX), so it starts in tens of
milliseconds.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

# How long the watch goes on looking for the session's processes after the
# coordinator died (a process the raylet was starting then shows up late).
_SWEEP_S = 1.0
# What `stop` writes before closing the pipe: Ray was shut down (one look
# for what is left is enough).
_SHUT_DOWN = b"shut down\n"


def start(session_dir: str, nodes_dir: str = "", namespaces=(),
          bridge: str = "") -> subprocess.Popen:
  """Starts the watch of the Ray session in `session_dir` (this process's
  Ray, started by this process); its process. Keep it until `stop`.
  `nodes_dir`: where the run's other Ray nodes on this machine keep their
  sessions (island_nodes.py), whose processes end too; `namespaces`: the
  network namespaces they run in, removed after with their /etc/netns
  entries, and `bridge`, the link that joined them (netns.Network's)."""
  return subprocess.Popen(
      [sys.executable, "-I", os.path.abspath(__file__), session_dir,
       str(os.getpid()), nodes_dir, bridge, *namespaces],
      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL, cwd="/", start_new_session=True)


def stop(watch: subprocess.Popen, timeout: float = 10.0) -> None:
  """Closes the watch's pipe (after ray.shutdown()): it ends what is left
  of the session and exits; waits up to `timeout` seconds for it."""
  try:
    watch.stdin.write(_SHUT_DOWN)
    watch.stdin.close()
    watch.wait(timeout)
  except (OSError, subprocess.TimeoutExpired):
    watch.kill()


def session_processes(session_dir: str, spare: int | None = None,
                      nodes_dir: str = "") -> list[int]:
  """The pids of the processes holding a file under `session_dir` (or
  `nodes_dir`) open for writing (those of a Ray session: each writes its
  logs there; so does the driver that started it; a reader, `tail -f` of
  a log, is not one), this one and `spare` aside."""
  prefix = tuple(os.path.join(os.path.abspath(d), "")
                 for d in (session_dir, nodes_dir) if d)
  spared = {os.getpid(), spare}
  found = []
  for name in os.listdir("/proc"):
    if not name.isdigit() or int(name) in spared:
      continue
    try:
      fds = os.listdir(f"/proc/{name}/fd")
    except OSError:  # gone, or another user's
      continue
    for fd in fds:
      try:
        if (os.readlink(f"/proc/{name}/fd/{fd}").startswith(prefix)
            and _writes(f"/proc/{name}/fdinfo/{fd}")):
          found.append(int(name))
          break
      except OSError:
        continue
  return found


def _writes(fdinfo: str) -> bool:
  """Whether the descriptor /proc/PID/fdinfo/FD describes is open for
  writing."""
  with open(fdinfo) as f:
    for line in f:
      if line.startswith("flags:"):
        return int(line.split()[1], 8) & os.O_ACCMODE != os.O_RDONLY
  return False


def _kill_session(session_dir: str, coordinator: int, sweep_s: float,
                  nodes_dir: str = "") -> None:
  """SIGKILLs the session's processes but the coordinator (alive after
  `stop`) until none is left and `sweep_s` seconds passed."""
  deadline = time.monotonic() + sweep_s
  while True:
    pids = session_processes(session_dir, spare=coordinator,
                             nodes_dir=nodes_dir)
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except OSError:
        pass
    if not pids and time.monotonic() > deadline:
      return
    time.sleep(0.1)


def _main(session_dir: str, coordinator: int, nodes_dir: str = "",
          bridge: str = "", namespaces=()) -> None:
  for sig in (signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
  # Blocks until the coordinator closes its end: by stop(), or by ending.
  said = b""
  while True:
    try:
      read = os.read(0, 4096)
    except OSError:
      break
    if not read:
      break
    said += read
  _kill_session(session_dir, coordinator,
                0.0 if said == _SHUT_DOWN else _SWEEP_S, nodes_dir)
  # The island nodes' network (gone already after a normal end): each
  # namespace (its veth pair with it), its /etc/netns entry, the bridge.
  for namespace in namespaces:
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True,
                   check=False)
    shutil.rmtree(os.path.join("/etc/netns", namespace), ignore_errors=True)
  if bridge and os.path.exists(f"/sys/class/net/{bridge}"):
    subprocess.run(["ip", "link", "del", bridge], capture_output=True,
                   check=False)
  if nodes_dir:  # the island nodes' Ray sessions, their processes ended
    shutil.rmtree(nodes_dir, ignore_errors=True)


if __name__ == "__main__":
  _main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:5], sys.argv[5:])
