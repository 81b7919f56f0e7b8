"""An elastic run's life across commands: its workdir held by one
coordinator, Ray's processes ending with the coordinator, a rerun of a
finished (or nearly finished) run, and goodput over the whole run.

One run serves every test here (the `lifecycle` fixture), in the network
namespace of tests/test_elastic.py (loopback only: Ray binds to its
127.0.0.1; every process left in it is killed at the end):

  A  the tiny config's 3 rounds of 2 islands, island 1 SIGKILLed in round
     1 (half of round 1's island-steps lost) and island 0 asleep in round
     2; while it sleeps,
  B  a second coordinator on the same workdir, then A's coordinator is
     SIGKILLed alone;
  C  the same command again, which resumes after round 1 and finishes;
  D  again after summary.json is removed (as if C had been killed after
     its last checkpoint, before its summary);
  E  again, on the finished run.
"""
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import pytest

from configs import tiny
from diloco_jax.elastic import ray_watch
from diloco_jax.model import transformer as model_lib
from tests.test_elastic import namespace  # pylint: disable=unused-import
from tests.test_elastic import _flags
from tests.test_elastic import _records
from tests.test_elastic import _summary
from tests.test_elastic import REPO


def _command(namespace, workdir, *flags):  # pylint: disable=redefined-outer-name
  return namespace.command(
      sys.executable, "-m", "diloco_jax.elastic",
      f"--config={REPO / 'configs/tiny.py'}", f"--workdir={workdir}",
      *_flags(), *flags)


_ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _run(namespace, workdir, *flags):  # pylint: disable=redefined-outer-name
  return subprocess.run(_command(namespace, workdir, *flags), env=_ENV,
                        capture_output=True, text=True, timeout=300)


def _files(workdir: pathlib.Path) -> dict:
  """Every file under `workdir`: its size and modification time."""
  return {str(p): (p.stat().st_size, p.stat().st_mtime_ns)
          for p in workdir.rglob("*") if p.is_file()}


def _processes(namespace):  # pylint: disable=redefined-outer-name
  """The processes in the namespace (each one this module started)."""
  done = subprocess.run(["ip", "netns", "pids", namespace.name],
                        capture_output=True, text=True, check=False)
  return [int(pid) for pid in done.stdout.split()]


def _names(pids):
  names = []
  for pid in pids:
    try:
      names.append(pathlib.Path(f"/proc/{pid}/comm").read_text().strip())
    except OSError:
      pass
  return names


@pytest.fixture(scope="module")
def lifecycle(namespace, tmp_path_factory):  # pylint: disable=redefined-outer-name
  """The commands A-E of the module's docstring; what each left."""
  workdir = tmp_path_factory.mktemp("lifecycle") / "run"
  seen = {"workdir": workdir}
  with open(workdir.parent / "a.log", "w") as log:
    first = subprocess.Popen(
        _command(namespace, workdir, "--config.testing.kill_island=1@1",
                 "--config.testing.slow_island=0@2",
                 "--config.testing.slow_seconds=300"),
        env=_ENV, stdout=log, stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 300
    while (not (workdir / "coordinator" / "1").exists()
           and first.poll() is None):
      assert time.monotonic() < deadline, "no round was checkpointed"
      time.sleep(0.05)
    assert first.poll() is None, (workdir.parent / "a.log").read_text()
    # Round 2: island 0 sleeps; nothing is written meanwhile.
    before = _files(workdir)
    seen["second"] = _run(namespace, workdir)
    seen["second_wrote"] = _files(workdir) != before
    seen["first_pid"] = first.pid
    # Every process of A's Ray session, by its session directory.
    sessions = {arg.split("=", 1)[1] for pid in _processes(namespace)
                for arg in _cmdline(pid)
                if arg.startswith(("--session_dir=", "--session-dir="))}
    assert len(sessions) == 1, sessions
    session = sessions.pop()
    seen["ray_processes"] = len(ray_watch.session_processes(session))
    first.send_signal(signal.SIGKILL)  # the coordinator alone
    first.wait(timeout=60)
    killed = time.monotonic()
    while ray_watch.session_processes(session) or _processes(namespace):
      if time.monotonic() - killed > 10:
        break
      time.sleep(0.05)
    seen["gone_after_s"] = time.monotonic() - killed
    seen["left"] = _names(_processes(namespace))
  finally:
    if first.poll() is None:
      first.kill()
      first.wait()
  seen["resumed"] = _run(namespace, workdir)
  seen["left_after_resumed"] = _names(_processes(namespace))
  seen["resumed_summary"] = _summary(workdir) if seen[
      "resumed"].returncode == 0 else None
  (workdir / "summary.json").unlink(missing_ok=True)
  seen["summary_written_again"] = _run(namespace, workdir)
  summary = workdir / "summary.json"
  seen["summary_again"] = _summary(workdir) if summary.exists() else None
  before = (summary.read_bytes(), summary.stat().st_mtime_ns) if (
      summary.exists()) else None
  seen["finished"] = _run(namespace, workdir)
  seen["summary_untouched"] = before == (
      (summary.read_bytes(), summary.stat().st_mtime_ns) if summary.exists()
      else None)
  return seen


def _cmdline(pid):
  try:
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode(
        errors="replace").split("\0")
  except OSError:
    return []


def _lines(done):
  return (done.stdout + done.stderr).strip().splitlines()


@pytest.mark.slow
def test_a_second_coordinator_on_a_workdir_is_refused(lifecycle):  # pylint: disable=redefined-outer-name
  """While A trains, B on the same workdir is refused by the workdir's
  lock (storage/workdir.py's, as the SPMD runs take it) in one line naming
  A's pid, exits non-zero and writes nothing there. A's lock, left in its
  file when A is SIGKILLed, does not stop C (the kernel dropped it)."""
  second = lifecycle["second"]
  assert second.returncode != 0, _lines(second)[-5:]
  assert _lines(second) == [
      f"error: --workdir={lifecycle['workdir']} is in use by another run "
      f"(pid {lifecycle['first_pid']}); wait for it to end or choose "
      "another workdir"]
  assert not lifecycle["second_wrote"]
  assert lifecycle["resumed"].returncode == 0, _lines(lifecycle["resumed"])
  assert [r["round"] for r in _records(lifecycle["workdir"])] == [1, 2, 3]


def test_ray_s_processes_end_with_a_killed_coordinator(lifecycle):  # pylint: disable=redefined-outer-name
  """A's coordinator SIGKILLed alone: every process of its Ray session
  (the head's, the raylet's agents, the islands' workers) and every other
  process it started is gone within 3 s (Ray's own agents waited 62 s).
  C, which ends normally, leaves none either."""
  assert lifecycle["ray_processes"] >= 6  # head, agents, 2 islands
  assert not lifecycle["left"], lifecycle["left"]
  assert lifecycle["gone_after_s"] < 3
  assert not lifecycle["left_after_resumed"], lifecycle["left_after_resumed"]


def test_goodput_covers_the_whole_run(lifecycle):  # pylint: disable=redefined-outer-name
  """Goodput counts every command's rounds: round 1 lost island 1's
  work (A's), rounds 2 and 3 (C's) lost none, and the summary's goodput
  is over all three, as the records add up (5/6, where C's rounds alone
  are 1); the bytes too."""
  records = _records(lifecycle["workdir"])
  applied = sum(r["island_steps"]["applied"] for r in records)
  run = sum(r["island_steps"]["run"] for r in records)
  assert records[0]["island_steps"]["applied"] < records[0][
      "island_steps"]["run"]
  assert all(r["island_steps"]["applied"] == r["island_steps"]["run"]
             for r in records[1:])
  summary = lifecycle["resumed_summary"]
  assert summary["resumed"] and summary["goodput"] == pytest.approx(
      applied / run)
  assert summary["goodput"] < 1
  # Five results crossed Ray (island 0's in round 1, both islands' in
  # rounds 2 and 3), each the fp32 params.
  size = sum(leaf.size for leaf in jax.tree.leaves(
      model_lib.param_shapes(tiny.get_config().model)))
  assert summary["ray_bytes"] == 5 * 4 * size


def test_a_run_killed_before_its_summary_writes_it(lifecycle):  # pylint: disable=redefined-outer-name
  """With every round checkpointed but no summary (killed in between),
  the command again trains nothing and writes the summary the run would
  have written: the whole run's goodput, bytes and loss."""
  done = lifecycle["summary_written_again"]
  assert done.returncode == 0, _lines(done)[-5:]
  again, first = lifecycle["summary_again"], lifecycle["resumed_summary"]
  for key in ("rounds", "goodput", "final_eval_loss", "data_states",
              "comm_bytes", "ray_bytes", "island_nodes"):
    assert again[key] == first[key], key


def test_a_finished_run_rerun_says_so_and_touches_nothing(lifecycle):  # pylint: disable=redefined-outer-name
  """The command again on the finished run: one line saying so, exit 0,
  summary.json as it was (as the SPMD runs' train.py leaves it)."""
  done = lifecycle["finished"]
  assert done.returncode == 0, _lines(done)[-5:]
  summary = lifecycle["summary_again"]
  assert _lines(done) == [
      f"the run in {lifecycle['workdir']} already finished (final eval "
      f"loss {summary['final_eval_loss']:.4f}, goodput "
      f"{summary['goodput']:.3f}); summary.json is left as it is"]
  assert lifecycle["summary_untouched"]
