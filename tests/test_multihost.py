"""Several processes, one run: islands spread over processes as over hosts.

The end-to-end tests start real runs through `python -m diloco_jax.launch`
(jax.distributed over local CPU processes, gloo collectives) and compare
them with the same islands in one process: metrics and final states must
agree (to float summation order: see _assert_close_runs), a stopped or
killed run must resume to the bit-identical run, and a killed process must
stop the run within a bounded time instead of hanging it.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from diloco_jax.data import sources
from diloco_jax import launch
from diloco_jax.parallel import multihost
from diloco_jax.storage import workdir as workdir_lib
from tests import helpers
from tests import test_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO}
# A killed process: the launcher's grace period (10 s) plus the poll and
# process exit; measured about 10.3 s.
KILL_BOUND_S = 30


# Islands a process holds, and its share of the data.


class _Sharding:
  """What local_islands reads of a sharding: the indices of this process's
  devices (a real one has them only in a multi-process run)."""

  def __init__(self, indices):
    self._indices = indices

  def addressable_devices_indices_map(self, shape):
    del shape
    return dict(enumerate(self._indices))


def test_local_islands_of_folded_and_spanning_islands():
  whole = (slice(None), slice(None))
  # 8 islands, this process's 2 device slots hold islands 2-3 and 4-5.
  assert multihost.local_islands(
      _Sharding([(slice(2, 4),) + whole, (slice(4, 6),) + whole]),
      (8, 4, 33)) == range(2, 6)
  # One island over all devices: every process holds it.
  assert multihost.local_islands(
      _Sharding([(slice(None), slice(0, 2), slice(None))]),
      (1, 4, 33)) == range(0, 1)
  with pytest.raises(ValueError, match="not consecutive"):
    multihost.local_islands(
        _Sharding([(slice(0, 1),) + whole, (slice(2, 3),) + whole]),
        (4, 4, 33))


def _write_c4(directory, shards=4, documents=24):
  words = ("river", "mill", "letter", "mountain", "inn", "spring", "week")
  for shard in range(shards):
    lines = [json.dumps({"text": " ".join(
        words[(shard + i + j) % len(words)] for j in range(40 + i))})
             for i in range(documents)]
    (directory / f"c4-train.{shard:05d}-of-{shards:05d}.jsonl").write_text(
        "\n".join(lines) + "\n")
  (directory / "c4-validation.00000-of-00001.jsonl").write_text(
      json.dumps({"text": " ".join(words * 20)}) + "\n")


@pytest.mark.parametrize("corpus,split", [
    ("synthetic", "iid"), ("synthetic", "clustered"), ("c4", "iid"),
    ("c4", "clustered_balanced")])
def test_a_process_reads_the_rows_of_its_own_islands(tmp_path, corpus, split):
  if corpus == "c4":
    _write_c4(tmp_path)
  config = helpers.small_data_config(corpus=corpus, path=str(tmp_path),
                                     island_split=split,
                                     validation_fraction=0.2)
  every = sources.make_batch_source(config, 4, batch_size=2, seed=0)
  mine = sources.make_batch_source(config, 4, batch_size=2, seed=0,
                                   islands=range(1, 3))
  for _ in range(5):
    np.testing.assert_array_equal(mine.next_batch(), every.next_batch()[1:3])
  np.testing.assert_array_equal(mine.island_token_weights(),
                                every.island_token_weights())
  # A restart restores the merged state of every island and goes on.
  merged = multihost.merge_island_states(every.state(), range(4), 4)
  again = sources.make_batch_source(config, 4, batch_size=2, seed=0,
                                    islands=range(1, 3))
  again.restore(json.loads(json.dumps(merged)))
  np.testing.assert_array_equal(again.next_batch(), every.next_batch()[1:3])


def test_one_process_needs_no_setup(monkeypatch):
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
               "JAX_PROCESS_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
               "TPU_WORKER_HOSTNAMES"):
    monkeypatch.delenv(name, raising=False)
  assert multihost.process_count_hint() == 1
  assert not multihost.initialize()
  monkeypatch.setenv("SLURM_NTASKS", "4")
  assert multihost.process_count_hint() == 4
  assert multihost.process_count_hint(2) == 2  # the flag wins
  assert multihost.any_process(True) and not multihost.any_process(False)
  assert multihost.gather_json({"a": 1}) == [{"a": 1}]


# Real runs over several processes.


def _flags(workdir, *extra):
  return ["--config=configs/tiny.py", f"--workdir={workdir}",
          "--config.total_steps=12", "--config.diloco.inner_steps=3",
          "--config.checkpoint.every_steps=2",
          "--config.checkpoint.max_to_keep=20", *extra]


def _launch(processes, workdir, *extra, **popen):
  return subprocess.Popen(
      [sys.executable, "-m", "diloco_jax.launch", f"--processes={processes}",
       "--", *_flags(workdir, *extra)], cwd=REPO, env=ENV,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def _run(processes, workdir, *extra):
  process = _launch(processes, workdir, *extra)
  output, _ = process.communicate(timeout=300)
  assert process.returncode == 0, output[-3000:]
  return output


def _one_process(workdir, *extra):
  result = subprocess.run(
      [sys.executable, "-m", "diloco_jax.main", *_flags(workdir, *extra)],
      cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]


def _wait_for_step(workdir, process, step):
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + 240
  while time.time() < deadline and process.poll() is None:
    if os.path.exists(path):
      with open(path) as f:
        if sum(1 for _ in f) >= step:
          return
    time.sleep(0.05)
  raise AssertionError(f"the run ended or stalled before step {step}")


_C4_FLAGS = ("--config.data.corpus=c4", "--config.model.vocab_size=257",
             "--config.diloco.islands=4")


@pytest.fixture(scope="module")
def c4_dir(tmp_path_factory):
  directory = tmp_path_factory.mktemp("c4")
  _write_c4(directory, shards=8)
  return str(directory)


@pytest.fixture(scope="module")
def one_process_c4(tmp_path_factory, c4_dir):
  """4 islands of a streamed corpus in one process: the reference."""
  workdir = str(tmp_path_factory.mktemp("one") / "run")
  _one_process(workdir, *_C4_FLAGS, f"--config.data.path={c4_dir}")
  return workdir


@pytest.fixture(scope="module")
def two_processes_c4(tmp_path_factory, c4_dir):
  """The same 4 islands over 2 processes (2 each), with its output."""
  workdir = str(tmp_path_factory.mktemp("two") / "run")
  output = _run(2, workdir, *_C4_FLAGS, f"--config.data.path={c4_dir}")
  return workdir, output


# Runs whose sends go through a rounding codec (int8 here; any codec but
# fp32) agree to summation order only where no value sat on a rounding
# midpoint. The placements' programs add the islands' decoded chunks in
# other orders (and fuse other multiply-adds; both depend on the CPU's
# vector widths and FMA): at a send with bit-identical inputs the means are
# at most 2 ulp apart (1.7 eps x the sum of the islands' |terms|, measured).
# Rounding to nearest is discontinuous: where a value lies that close to a
# midpoint between two codes, the runs send neighbouring codes, one code
# step (its block's absmax / 127) apart, and x moves by lr (1 + momentum)
# steps there (0.7 x 1.9 x 4.5e-6 = 6.0e-6 at the first send of the FSDP
# streaming run on 2 processes); the runs train on from there, and the
# differences training grows from the last bits later tip an island's
# values too (61.500057 vs 61.499954 scale units: codes 62 and 61). Such
# flips are few and local: over 4 seeds, 2 of them also with XLA's CPU ISA
# capped at AVX and at SSE4.2, at most 0.22% of any field's values (48 of
# 21696) were beyond the summation-order tolerance, none by more than
# 8.6e-6. A real difference between the placements moves a large share of
# a field: a merge taking the x from before its send 99% of x, error
# feedback lost 48%, the codec's blocks cut in other stripes 24%
# (Streaming DiLoCo, int8).
CODEC_FLIP_FRACTION = 0.02  # of each field's values
CODEC_FLIP_ATOL = 1e-4  # ~20 code steps; every leaf of x moves >= 1.9e-3


def _codec(workdir) -> str:
  with open(os.path.join(workdir, "config.json")) as f:
    return json.load(f)["diloco"]["codec"]


def _assert_close_but_codec_flips(a, b):
  """Every field of states `a` and `b` (dicts of arrays) agrees to float
  summation order except at CODEC_FLIP_FRACTION of its values at most,
  which agree within CODEC_FLIP_ATOL; integers agree exactly."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for field in a:
    beyond = total = 0
    for x, y in zip(jax.tree.leaves(a[field]), jax.tree.leaves(b[field])):
      x, y = np.asarray(x), np.asarray(y)
      if not np.issubdtype(x.dtype, np.floating):
        np.testing.assert_array_equal(x, y, err_msg=field)
        continue
      np.testing.assert_allclose(x, y, rtol=0, atol=CODEC_FLIP_ATOL,
                                 err_msg=field)
      beyond += int(np.sum(~np.isclose(x, y, rtol=1e-5, atol=1e-6)))
      total += x.size
    assert beyond <= CODEC_FLIP_FRACTION * total, (
        f"{field}: {beyond} of {total} values beyond summation order")


def _assert_close_runs(a, b):
  """Equal up to float summation order: the cross-island all-reduce of
  several processes (gloo) adds the islands' pseudo-gradients in another
  order than one process's XLA all-reduce, and float addition is not
  associative (measured: at most 6e-8 apart after 4 rounds). Runs through
  a rounding codec may differ more at a few values (CODEC_FLIP_FRACTION)."""
  codec = _codec(a)
  assert _codec(b) == codec
  state_a = test_checkpoint._final_state(a)
  state_b = test_checkpoint._final_state(b)
  if codec == "fp32":
    helpers.assert_trees_close(state_a, state_b, rtol=1e-5, atol=1e-6)
  else:
    _assert_close_but_codec_flips(state_a, state_b)
  ma, mb = test_checkpoint._metrics(a), test_checkpoint._metrics(b)
  assert [r["step"] for r in ma] == [r["step"] for r in mb]
  for ra, rb in zip(ma, mb):
    assert ra["train_loss"] == pytest.approx(rb["train_loss"], rel=1e-5)
    assert ("eval_loss" in ra) == ("eval_loss" in rb)
    if "eval_loss" in ra:
      assert ra["eval_loss"] == pytest.approx(rb["eval_loss"], rel=1e-5)
    assert ra["comm_bytes"] == rb["comm_bytes"]


@pytest.mark.slow
def test_two_processes_equal_one(one_process_c4, two_processes_c4):
  # 2 islands on each process; every island streams its own shards.
  workdir, output = two_processes_c4
  _assert_close_runs(one_process_c4, workdir)
  # One process writes the run's files; the progress line comes from it.
  assert "islands 2..3 on this process" in output
  progress = [line for line in output.splitlines() if "step 12/12" in line]
  assert len(progress) == 1 and progress[0].startswith("[0] ")
  assert sorted(os.listdir(workdir)) == [
      "checkpoints", "config.json", "metrics.jsonl", "run.lock",
      "summary.json", "tensorboard"]


# Processes started by hand: no launcher's JAX_* variables (the shared
# compilation cache stays).
_BY_HAND_ENV = {key: value for key, value in ENV.items()
                if not key.startswith("JAX_")
                or key.startswith(("JAX_COMPILATION", "JAX_PERSISTENT"))}


@pytest.mark.slow
def test_processes_started_by_hand_with_flags(two_processes_c4, c4_dir,
                                              tmp_path):
  # BUILD.md's several-hosts command: each process given the coordinator,
  # the process count and its index as flags (no launcher, no environment).
  workdir = str(tmp_path / "flags")
  port = launch.free_port()
  processes = [subprocess.Popen(
      [sys.executable, "-m", "diloco_jax.main",
       *_flags(workdir, *_C4_FLAGS, f"--config.data.path={c4_dir}"),
       f"--coordinator_address=localhost:{port}", "--num_processes=2",
       f"--process_id={index}"], cwd=REPO, env=_BY_HAND_ENV,
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for index in (0, 1)]
  for process in processes:
    _, errors = process.communicate(timeout=300)
    assert process.returncode == 0, errors[-3000:]
  test_checkpoint._assert_identical_runs(two_processes_c4[0], workdir)


@pytest.mark.slow
def test_a_worker_killed_without_the_launcher_is_named_in_one_line(tmp_path):
  # Started by hand (no launcher to watch the processes): the survivor
  # names the process that died, in its last line, before JAX's
  # coordination service would abort it with a crash dump (heartbeat
  # timeout 30 s).
  workdir = str(tmp_path / "run")
  port = launch.free_port()
  processes = [subprocess.Popen(
      [sys.executable, "-m", "diloco_jax.main", "--config=configs/tiny.py",
       f"--workdir={workdir}", "--config.total_steps=4000",
       f"--coordinator_address=localhost:{port}", "--num_processes=2",
       f"--process_id={index}", "--heartbeat_timeout_s=30"], cwd=REPO,
      env=_BY_HAND_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
      text=True)
               for index in (0, 1)]
  try:
    _wait_for_step(workdir, processes[0], 6)
    killed_at = time.monotonic()
    processes[1].kill()
    _, errors = processes[0].communicate(timeout=60)
  finally:
    for process in processes:
      process.kill()
  assert time.monotonic() - killed_at < 25  # before JAX's own abort
  assert processes[0].returncode == 1, errors[-3000:]
  assert errors.strip().splitlines()[-1].startswith(
      "error: process 1 of 2 stopped responding (no heartbeat for 10 s")
  assert "Traceback" not in errors and "Fatal Python error" not in errors
  workdir_lib.claim(workdir).release()  # the lock went with the process


@pytest.mark.slow
def test_an_island_spread_over_two_processes(tmp_path):
  # One island whose 'data' devices are on two processes: the gradient
  # all-reduce crosses them; both read the island's batch and place half.
  extra = ("--config.diloco.islands=1", "--config.mesh.data=2",
           "--config.data.batch_size=4", "--config.total_steps=6")
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  _one_process(one, *extra)
  _run(2, two, *extra)
  _assert_close_runs(one, two)


@pytest.mark.slow
def test_an_island_s_pipeline_stages_spread_over_two_processes(tmp_path):
  # One island of two pipeline stages, one on each process: the
  # activations' hand-off, the tied embedding's gather and the gradient's
  # clipping norm cross the processes.
  extra = ("--config.diloco.islands=1", "--config.mesh.stage=2",
           "--config.model.num_layers=2", "--config.data.batch_size=4",
           "--config.total_steps=6")
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  _one_process(one, *extra)
  _run(2, two, *extra)
  _assert_close_runs(one, two)


@pytest.mark.slow
@pytest.mark.parametrize("extra,message", [
    # One island on one device would leave process 1 with nothing to do.
    (("--config.mode=single",), "leaving process(es) [1] of 2 without any"),
    # An FSDP island over both processes: no process holds it whole for
    # its outer device.
    (("--config.diloco.islands=1", "--config.mesh.data=2",
      "--config.mesh.fsdp=True", "--config.diloco.codec=int8",
      "--config.diloco.outer_placement=host"), "island slot(s) [0] span"),
], ids=["idle_process", "fsdp_island_across_processes_on_host"])
def test_a_run_processes_cannot_share_is_one_clear_error(tmp_path, extra,
                                                         message):
  workdir = tmp_path / "refused"
  process = _launch(2, str(workdir), *extra)
  output, _ = process.communicate(timeout=120)
  assert process.returncode == 1
  errors = [line for line in output.splitlines() if "error: " in line]
  assert len(errors) == 2 and all(message in line for line in errors), output[
      -2000:]
  assert "every process exited with an error" in output
  assert not workdir.exists()  # nothing written


@pytest.mark.slow
def test_a_killed_process_and_a_sigterm_stop_the_run_and_reruns_resume(
    two_processes_c4, c4_dir, tmp_path):
  # One run through both ways a multi-host run ends early: a process that
  # dies (the launcher must stop the others within a bounded time, leaving
  # nothing behind), then, after resuming, a SIGTERM (every process stops
  # at the same step); the last rerun must end as the uninterrupted run.
  workdir = str(tmp_path / "interrupted")
  flags = (*_C4_FLAGS, f"--config.data.path={c4_dir}")
  launcher = _launch(2, workdir, *flags)
  _wait_for_step(workdir, launcher, 4)
  children = subprocess.run(["pgrep", "-P", str(launcher.pid)],
                            capture_output=True, text=True).stdout.split()
  victim = next(pid for pid in children if b"JAX_PROCESS_ID=1" in open(
      f"/proc/{pid}/environ", "rb").read().split(b"\0"))
  killed_at = time.monotonic()
  os.kill(int(victim), signal.SIGKILL)
  output, _ = launcher.communicate(timeout=KILL_BOUND_S + 30)
  assert time.monotonic() - killed_at < KILL_BOUND_S
  assert launcher.returncode != 0
  assert "process 1 was killed by SIGKILL" in output
  for pid in children:  # nothing is left behind
    assert not os.path.exists(f"/proc/{pid}") or open(
        f"/proc/{pid}/stat").read().split()[2] == "Z"
  # Resumed (the kill came at step 4 or a little later, so the metrics
  # hold fewer than 8 steps until the rerun writes them), then stopped.
  launcher = _launch(2, workdir, *flags)
  _wait_for_step(workdir, launcher, 8)
  launcher.send_signal(signal.SIGTERM)
  output, _ = launcher.communicate(timeout=120)
  assert "resuming from the checkpoint at step" in output
  assert launcher.returncode != 0, output[-2000:]
  assert not os.path.exists(os.path.join(workdir, "summary.json"))
  output = _run(2, workdir, *flags)
  assert "resuming from the checkpoint at step" in output
  test_checkpoint._assert_identical_runs(two_processes_c4[0], workdir)


# The delay with a mean in flight (eager_ef) and FSDP islands gathered from
# their shards (fsdp_streaming, whose fragments are in flight too); the
# rebasing delay with FSDP runs in one process in test_outer_placement.
@pytest.mark.slow
@pytest.mark.parametrize("overlap", [
    ("--config.diloco.islands=4", "--config.diloco.overlap=eager",
     "--config.total_steps=6", "--config.diloco.overlap_warmup_rounds=1",
     "--config.diloco.codec=int8", "--config.diloco.error_feedback=True"),
    # One FSDP island per process.
    ("--config.diloco.islands=2", "--config.model.num_layers=2",
     "--config.diloco.fragments=2",
     "--config.diloco.fragment_delay=1", "--config.total_steps=6",
     "--config.mesh.data=2", "--config.mesh.fsdp=True",
     "--config.model.d_model=64", "--config.model.num_heads=4",
     "--config.model.head_dim=16", "--config.model.mlp_dim=256",
     "--config.diloco.codec=int8")],
                         ids=["eager_ef", "fsdp_streaming"])
def test_the_outer_step_on_each_process_own_device(tmp_path, overlap):
  # outer_placement='host' on 2 processes: each sets a CPU device aside for
  # the outer side, takes its own islands there (no collective; with FSDP
  # gathered from the shards its island's devices hold) and runs the
  # cross-island collective between those devices (streaming: each
  # fragment's); with the delay or the fragments in flight the run must
  # still equal the on-device programs in one process.
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  _one_process(one, *overlap)
  output = _run(2, two, *overlap, "--config.diloco.outer_placement=host")
  assert "outer step on its own device(s)" in output
  _assert_close_runs(one, two)
