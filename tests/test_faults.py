"""Faults that used to hang, write outside the workdir or start over silently.

Each test is one row of the fault table: storage that fails mid-run (a real
read-only bind mount, a real full tmpfs), checkpoints none of which reads
back, symlinks where the run writes its own files, a damaged init_from
source, bad settings and flags (one line, no workdir), what a resumed run
reports (summary, ETA, TensorBoard), a stop while compiling. Runs that
must exit on their own go to real `python -m diloco_jax.main` processes
under a timeout.
"""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from configs import tiny
from diloco_jax.config import validation
from diloco_jax.run import train
from diloco_jax.storage import checkpoints as checkpointing
from diloco_jax.storage import workdir as workdir_lib
from diloco_jax.telemetry import metrics_files as metrics_lib
from diloco_jax.telemetry import reports
from tests import helpers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO}


def _config(**overrides):
  return helpers.with_overrides(tiny.get_config(), overrides)


def _main(workdir, *flags, env=None):
  return subprocess.Popen(
      [sys.executable, "-m", "diloco_jax.main", "--config=configs/tiny.py",
       f"--workdir={workdir}", *flags], cwd=REPO, env=env or ENV, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _steps(workdir):
  path = os.path.join(workdir, "checkpoints")
  return sorted(int(name) for name in os.listdir(path) if name.isdigit())


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A finished 8-step run (checkpoints at steps 4 and 8)."""
  workdir = str(tmp_path_factory.mktemp("finished") / "run")
  train.train_and_evaluate(_config(), workdir)
  return workdir


def _copy(finished, tmp_path, name="run"):
  workdir = str(tmp_path / name)
  shutil.copytree(finished, workdir, symlinks=True)
  return workdir


# 1. Storage that fails mid-run: one line, a bounded exit, the lock free,
# the last good checkpoint the newest, nothing half-written left behind.


def _mount(*args):
  """mount(8) with `args`. A remount read-only is refused while a file in
  the mount is open for writing ("mount point is busy"), which a run that
  saves every step holds most of the time: it is tried again until it
  lands between two writes."""
  deadline = time.monotonic() + 60
  while True:
    result = subprocess.run(["mount", *args], capture_output=True, text=True,
                            check=False)
    if ("busy" not in result.stderr or result.returncode == 0
        or time.monotonic() > deadline):
      break
    time.sleep(0.01)
  assert result.returncode == 0, result.stderr


def _require_mount(tmp_path):
  """Skips, before anything is started, where mount(8) cannot make a file
  system (not root): a tiny tmpfs is mounted and unmounted to find out."""
  probe = tmp_path / "mount_probe"
  probe.mkdir()
  result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                           str(probe)], capture_output=True, text=True,
                          check=False)
  if result.returncode:
    pytest.skip("needs root and mount(8) to make a real read-only or full "
                f"file system: {result.stderr.strip()}")
  subprocess.run(["umount", str(probe)], check=True)


def _stop(process):
  if process.poll() is None:
    process.kill()
  process.communicate()


# A bound on the stop that only a hang exceeds: on a loaded 2-core machine
# the failed save alone can take seconds to fail, and the whole stop tens of
# seconds (measured: 37 s from the full disk to the exit, the run niced
# beside three busy processes).
_STOP_TIMEOUT_S = 240


def _assert_stopped_in_one_line(process, workdir, reason):
  _, err = process.communicate(timeout=_STOP_TIMEOUT_S)
  assert process.returncode == 1, err[-3000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith("error: cannot write "), last
  assert last.endswith(reason) and workdir in last, last


def _assert_no_temporary_dirs(workdir):
  names = os.listdir(os.path.join(workdir, "checkpoints"))
  assert all(name.isdigit() for name in names), names


# The reruns save only at round ends (checkpoint settings may change on
# resume): a save per step would make them minutes long on a loaded machine.
_RERUN_SAVES = "--config.checkpoint.every_steps=0"


@pytest.mark.slow
def test_a_read_only_checkpoint_directory_stops_the_run_in_one_line(
    tmp_path):
  _require_mount(tmp_path)
  workdir = str(tmp_path / "run")
  checkpoints = os.path.join(workdir, "checkpoints")
  process = _main(workdir, "--config.total_steps=60",
                  "--config.checkpoint.every_steps=1")
  mounted = False
  try:
    helpers.wait_for(lambda: os.path.isdir(checkpoints) and _steps(workdir),
                     process)
    _mount("--bind", checkpoints, checkpoints)
    mounted = True
    _mount("-o", "remount,ro,bind", checkpoints)
    saved = _steps(workdir)
    _assert_stopped_in_one_line(process, workdir, "Read-only file system")
    assert _steps(workdir) == saved  # nothing written, nothing lost
    # A new run is refused at once, before it compiles.
    with pytest.raises(workdir_lib.WorkdirError,
                       match=r"checkpoints is not writable \(Read-only"):
      workdir_lib.claim(workdir)
  finally:
    _stop(process)
    if mounted:  # lazily: a file still open must not keep the mount
      subprocess.run(["umount", "-l", checkpoints], check=False)
  workdir_lib.claim(workdir).release()  # the lock was released
  # The last good checkpoint is where the rerun goes on from (a save cut
  # short on the read-only disk could not be removed: orbax removes it).
  rerun = _main(workdir, "--config.total_steps=60", _RERUN_SAVES)
  _, err = rerun.communicate(timeout=300)
  assert rerun.returncode == 0, err[-3000:]
  assert f"resuming from the checkpoint at step {saved[-1]}" in err
  _assert_no_temporary_dirs(workdir)


def _fill(descriptor):
  """Writes to `descriptor` until its file system is full."""
  chunk = b"\0" * (64 << 10)
  try:
    while True:
      os.write(descriptor, chunk)  # a short write takes the last bytes
  except OSError as error:
    if error.errno != errno.ENOSPC:
      raise


def _keep_full(path, process):
  """Fills the file system of `path` and keeps it full while `process`
  runs: what the run frees (max_to_keep removing an old checkpoint) is
  taken back at once. Filled once, a fill that landed between a save and
  that removal (the test's process is slow on a loaded machine) would
  leave the next save its room, and the run could go on."""
  descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
  _fill(descriptor)
  def keep():
    try:
      while process.poll() is None:
        _fill(descriptor)
        time.sleep(0.005)
    finally:
      os.close(descriptor)
  thread = threading.Thread(target=keep, daemon=True)
  thread.start()
  return thread


@pytest.mark.slow
def test_a_full_disk_stops_the_run_in_one_line_and_frees_the_partial_save(
    tmp_path):
  _require_mount(tmp_path)
  disk = str(tmp_path / "disk")
  os.makedirs(disk)
  _mount("-t", "tmpfs", "-o", "size=8m", "tmpfs", disk)
  processes = []
  try:
    workdir = os.path.join(disk, "run")
    process = _main(workdir, "--config.total_steps=200",
                    "--config.checkpoint.every_steps=1",
                    "--config.checkpoint.max_to_keep=2")
    processes.append(process)
    helpers.wait_for(
        lambda: os.path.isdir(os.path.join(workdir, "checkpoints"))
        and _steps(workdir), process)
    keeping = _keep_full(os.path.join(disk, "filler"), process)
    _assert_stopped_in_one_line(process, workdir, "No space left on device")
    keeping.join()
    _assert_no_temporary_dirs(workdir)  # the partial save freed at once
    os.remove(os.path.join(disk, "filler"))
    workdir_lib.claim(workdir).release()  # the lock was released
    newest = _steps(workdir)[-1]
    rerun = _main(workdir, "--config.total_steps=200",
                  "--config.checkpoint.max_to_keep=2", _RERUN_SAVES)
    processes.append(rerun)
    _, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-3000:]
    assert f"resuming from the checkpoint at step {newest}" in err
  finally:
    for started in processes:
      _stop(started)
    subprocess.run(["umount", "-l", disk], check=False)


# 2. Checkpoints that exist but do not read back never start a run over
# silently.


def _remove_metadata(workdir):
  for step in _steps(workdir):
    os.remove(os.path.join(workdir, "checkpoints", str(step), "state",
                           "_METADATA"))


def test_unreadable_checkpoints_stop_the_run_unless_starting_over_is_asked(
    finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  os.remove(os.path.join(workdir, "summary.json"))
  _remove_metadata(workdir)
  with pytest.raises(checkpointing.UnreadableCheckpointsError) as error:
    train.train_and_evaluate(_config(), workdir)
  message = str(error.value)
  assert "\n" not in message
  assert "step 4: " in message and "step 8: " in message
  assert "from_scratch_if_unreadable" in message
  assert _steps(workdir) == [4, 8]  # left where they were
  assert not os.path.exists(os.path.join(workdir, "summary.json"))

  summary = train.train_and_evaluate(
      _config(**{"resume.from_scratch_if_unreadable": True}), workdir)
  assert summary["resumed_from_step"] == 0
  assert [sorted(entry) for entry in summary["started_over"]] == [["4", "8"]]
  assert sorted(name.split(".")[0] for name in os.listdir(
      os.path.join(workdir, "checkpoints.unreadable"))) == ["4", "8"]
  assert _steps(workdir) == [4, 8]  # written again


def test_init_from_falls_back_to_a_readable_checkpoint_or_stops_in_one_line(
    finished, tmp_path):
  source = _copy(finished, tmp_path, "source")
  step_dir = os.path.join(source, "checkpoints", "8")
  os.remove(os.path.join(step_dir, "state", "_METADATA"))
  config = _config(**{"init_from": source, "total_steps": 12})
  summary = train.train_and_evaluate(config, str(tmp_path / "from_4"))
  assert summary["initialized_from"]["step"] == 4

  os.remove(os.path.join(source, "checkpoints", "4", "state", "_METADATA"))
  new = str(tmp_path / "from_none")
  with pytest.raises(checkpointing.UnreadableCheckpointsError,
                     match=r"^config.init_from: no checkpoint in .* reads "
                     r"back \(step 4: .*; step 8: .*\)$"):
    train.train_and_evaluate(config, new)
  assert not os.path.exists(new)  # no lock, no empty checkpoints/ left
  assert _steps(source) == [4, 8]  # another run's files are never moved


# 3. The workdir is the run's alone: no write follows a symlink.

_OWN_FILES = ("run.lock", "metrics.jsonl", "summary.json", "config.json")
_OWN_DIRS = ("checkpoints", "tensorboard")


@pytest.mark.parametrize("name", _OWN_FILES + _OWN_DIRS)
def test_a_symlink_where_the_run_writes_is_refused_and_its_target_untouched(
    tmp_path, name):
  outside = tmp_path / "outside"
  outside.mkdir()
  target = outside / "precious"
  if name in _OWN_DIRS:
    target.mkdir()
  else:
    target.write_text("keep me")
  workdir = tmp_path / "run"
  workdir.mkdir()
  os.symlink(target, workdir / name)
  with pytest.raises(workdir_lib.WorkdirError,
                     match=rf"{workdir / name} is a symlink"):
    train.train_and_evaluate(_config(), str(workdir))
  if name in _OWN_DIRS:
    assert os.listdir(target) == []
  else:
    assert target.read_text() == "keep me"
  assert sorted(os.listdir(workdir)) == [name]  # no lock taken either


def test_temporary_files_are_never_opened_by_a_predictable_name(tmp_path):
  outside = tmp_path / "outside"
  outside.write_text("keep me")
  workdir = tmp_path / "run"
  workdir.mkdir()
  for name in ("config.json.tmp", "summary.json.tmp", "metrics.jsonl.tmp"):
    os.symlink(outside, workdir / name)
  train.train_and_evaluate(_config(), str(workdir))
  train.train_and_evaluate(_config(), str(workdir))  # resumes: rewrites
  assert outside.read_text() == "keep me"
  assert not [name for name in os.listdir(workdir)
              if name.endswith(".tmp") and not os.path.islink(workdir / name)]


# 4. Every setting is checked before anything is created.


@pytest.mark.parametrize("field, value, message", [
    ("checkpoint.max_to_keep", 0, "must be an integer >= 1"),
    ("checkpoint.every_steps", -1, "must be an integer >= 0"),
    ("model.param_dtype", "float64x", "is not one of ('float32', 'bfloat16')"),
    ("inner_optimizer.final_learning_rate_fraction", -20.0,
     "must be a number in [0, 1]"),
    ("inner_optimizer.b2", 2.0, "must be a number in [0, 1)"),
    ("inner_optimizer.b1", -0.1, "must be a number in [0, 1)"),
    ("inner_optimizer.weight_decay", -1.0, "must be a number >= 0"),
    ("inner_optimizer.eps", -1e-8, "must be a number >= 0"),
    ("inner_optimizer.learning_rate", 0.0, "must be a number > 0"),
    ("diloco.outer_optimizer.b2", 1.0, "must be a number in [0, 1)"),
    ("diloco.outer_optimizer.learning_rate", -0.7, "must be a number > 0"),
    ("model.rope_base", 0.0, "must be a number > 0"),
    ("seed", -1, f"must be an integer in [0, {2**31 - 1:g}]"),  # int32
    ("log_every_seconds", -5.0, "must be a number >= 0"),
])
def test_a_bad_setting_is_one_line_and_creates_nothing(tmp_path, field, value,
                                                       message):
  workdir = tmp_path / "run"
  with pytest.raises(validation.ConfigError) as error:
    train.train_and_evaluate(_config(**{field: value}), str(workdir))
  assert str(error.value) == f"config.{field}={value!r} {message}"
  assert not workdir.exists()


def test_a_flag_of_another_type_is_refused_too(tmp_path):
  # Overrides keep a field's type; a config file can still set any value.
  config = _config()
  with config.ignore_type():
    config.model.remat = 1
  with pytest.raises(validation.ConfigError,
                     match=r"^config.model.remat=1 is not one of \(True, "
                     r"False\)$"):
    train.train_and_evaluate(config, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()


def test_data_that_cannot_be_read_is_reported_before_the_workdir(tmp_path):
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match="config.data"):
    train.train_and_evaluate(_config(**{
        "data.corpus": "text_files", "data.path": str(empty),
        "model.vocab_size": 257}), str(workdir))
  assert not workdir.exists()


@pytest.mark.parametrize("flags, line", [
    (["--config.foo=1"], "error: --config.foo: no such config field"),
    (["--config.diloco.island=3"],
     "error: --config.diloco.island: no such config field; did you mean "
     "--config.diloco.islands?"),
    (["--config.inner_optimizer.bb2=0.5"],
     "error: --config.inner_optimizer.bb2: no such config field; did you "
     "mean --config.inner_optimizer.b2?"),
    (["--config=configs/no_such_config.py"],
     "error: --config=configs/no_such_config.py: no such file"),
    (["--config.checkpoint.max_to_keep=0"],
     "error: config.checkpoint.max_to_keep=0 must be an integer >= 1"),
])
def test_command_line_mistakes_are_one_line_and_create_nothing(tmp_path,
                                                               flags, line):
  workdir = tmp_path / "run"
  process = _main(str(workdir), *flags)
  _, err = process.communicate(timeout=120)
  assert process.returncode != 0
  assert err.strip().splitlines()[-1].startswith(line), err[-3000:]
  assert "Traceback" not in err
  assert not workdir.exists()


# 5. What a resumed run reports is true.


def test_a_run_resumed_at_its_end_keeps_its_throughput_and_network_figures(
    finished, tmp_path):
  workdir = _copy(finished, tmp_path)
  with open(os.path.join(workdir, "summary.json")) as f:
    before = json.load(f)
  os.remove(os.path.join(workdir, "summary.json"))  # killed before writing it
  after = train.train_and_evaluate(_config(), workdir)
  assert after["resumed_from_step"] == 8
  assert set(before) <= set(after)  # the network model's fields included
  # The one attempt's records timed steps 2..8 (step 1's time started with
  # the loop): 7 steps of islands x batch x L tokens each, in the time
  # between step 1's record and step 8's.
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    elapsed = {r["step"]: r["elapsed_s"] for r in map(json.loads, f)}
  config = _config()
  tokens = 7 * (config.diloco.islands * config.data.batch_size
                * config.data.sequence_length)
  seconds = elapsed[8] - elapsed[1]
  assert after["timed_steps"] == 7
  assert after["tokens_per_s"] == pytest.approx(tokens / seconds)
  assert after["model_flops_per_token"] == before["model_flops_per_token"]
  assert after["model_flops_per_s"] == pytest.approx(
      before["model_flops_per_token"] * tokens / seconds)
  assert after["network_step_time_s"] == pytest.approx(seconds / 7)
  for field in ("network_sync_bytes", "network_bandwidth_bits_per_s",
                "network_latency_s"):
    assert after[field] == before[field]


def test_timed_steps_counts_each_attempt_from_its_own_clock():
  metrics = [{"step": 1, "elapsed_s": 5.0, "tokens_seen": 10},
             {"step": 2, "elapsed_s": 6.0, "tokens_seen": 20},
             # resumed after step 2: this attempt's clock starts again
             {"step": 3, "elapsed_s": 2.0, "tokens_seen": 30},
             {"step": 4, "elapsed_s": 3.5, "tokens_seen": 40}]
  assert reports.timed_steps(metrics) == (3, 30, 1.0 + 2.0 + 1.5)


def test_the_eta_after_a_resume_counts_the_steps_taken_since(tmp_path,
                                                             monkeypatch,
                                                             caplog):
  clock = [100.0]
  monkeypatch.setattr(metrics_lib.time, "perf_counter", lambda: clock[0])
  writer = metrics_lib.MetricsWriter(str(tmp_path), total_steps=400,
                                     log_every_seconds=0.0, start_step=34)
  writer.start_clock(tokens_seen=0, step=34)
  clock[0] += 6.0  # 6 steps in 6 s: 360 steps left take 6 minutes
  with caplog.at_level("INFO"):
    writer.write({"step": 40, "round": 1, "train_loss": 1.0,
                  "tokens_seen": 600})
  writer.close()
  assert caplog.records[-1].getMessage().endswith("ETA 6m00s")


def test_tensorboard_drops_the_points_a_resumed_run_takes_again(finished,
                                                                tmp_path):
  workdir = _copy(finished, tmp_path)
  os.remove(os.path.join(workdir, "summary.json"))
  shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
  # Killed after logging step 8, whose checkpoint was not finished.
  train.train_and_evaluate(_config(), workdir)
  losses = {r["step"]: r["train_loss"]
            for r in metrics_lib.read_metrics(workdir)}
  points = helpers.tensorboard_points(workdir, "train_loss")
  assert sorted(points) == list(range(1, 9))
  assert points == pytest.approx(losses)


# 7. A stop while the first programs compile ends the run at once.


@pytest.mark.slow
def test_sigterm_while_compiling_exits_within_seconds(tmp_path):
  workdir = str(tmp_path / "run")
  # No compilation cache: the compile must really take its time.
  env = {k: v for k, v in ENV.items() if not k.startswith("JAX_")}
  process = _main(workdir, "--config.model.num_layers=12",
                  "--config.model.remat=true", env=env)
  # The run writes config.json once the state is initialized and the
  # programs' compile has started (in the background): the signal lands in
  # that compile, not in the setup before it.
  try:
    helpers.wait_for(
        lambda: os.path.exists(os.path.join(workdir, "config.json")),
        process)
    started = time.time()
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
  finally:
    _stop(process)
  assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
  assert err.strip().splitlines()[-1] == (
      "stopped by SIGTERM: no step was taken, nothing to save")
  assert "compiled in" not in err  # it did not wait for the compile
  # Far less than the compile would take (minutes on a loaded 2-core
  # machine: 239 s measured, where reaching config.json took 96 s), with
  # slack for the exit itself under that load (up to 5.2 s measured).
  assert time.time() - started < 30
