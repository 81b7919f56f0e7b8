"""Faults that used to hang, write outside the workdir or start over silently.

Each test is one row of the fault table: storage that fails mid-run (a real
read-only bind mount, a real full tmpfs), checkpoints none of which reads
back, symlinks where the run writes its own files, a damaged init_from
source, bad settings and flags (one line, no workdir), what a resumed run
reports (summary, ETA, TensorBoard), a stop while compiling. Runs that
must exit on their own go to real `python -m diloco_jax.main` processes
under a timeout.
"""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import pytest
from tensorboardX.proto import event_pb2

from configs import tiny
from diloco_jax.config import validation
from diloco_jax.run import checkpoints as checkpointing
from diloco_jax.run import metrics as metrics_lib
from diloco_jax.run import records
from diloco_jax.run import train
from diloco_jax.run import workdir as workdir_lib
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
  result = subprocess.run(["mount", *args], capture_output=True, text=True,
                          check=False)
  if result.returncode:
    pytest.skip("needs root and mount(8) to make a real read-only or full "
                f"file system: {result.stderr.strip()}")


def _assert_stopped_in_one_line(process, workdir, reason, started):
  _, err = process.communicate(timeout=120)
  assert process.returncode == 1, err[-3000:]
  assert time.time() - started < 60  # bounded: it never hangs
  last = err.strip().splitlines()[-1]
  assert last.startswith("error: cannot write "), last
  assert last.endswith(reason) and workdir in last, last


def _assert_no_temporary_dirs(workdir):
  names = os.listdir(os.path.join(workdir, "checkpoints"))
  assert all(name.isdigit() for name in names), names


def test_a_read_only_checkpoint_directory_stops_the_run_in_one_line(
    tmp_path):
  workdir = str(tmp_path / "run")
  checkpoints = os.path.join(workdir, "checkpoints")
  process = _main(workdir, "--config.total_steps=60",
                  "--config.checkpoint.every_steps=1")
  helpers.wait_for(lambda: os.path.isdir(checkpoints) and _steps(workdir),
                   process)
  _mount("--bind", checkpoints, checkpoints)
  try:
    _mount("-o", "remount,ro,bind", checkpoints)
    started = time.time()
    saved = _steps(workdir)
    _assert_stopped_in_one_line(process, workdir, "Read-only file system",
                                started)
    assert _steps(workdir) == saved  # nothing written, nothing lost
    # A new run is refused at once, before it compiles.
    with pytest.raises(workdir_lib.WorkdirError,
                       match=r"checkpoints is not writable \(Read-only"):
      workdir_lib.claim(workdir)
  finally:
    process.kill()
    process.wait()
    # Lazily: a file still open must not keep the mount behind the test.
    subprocess.run(["umount", "-l", checkpoints], check=False)
  workdir_lib.claim(workdir).release()  # the lock was released
  # The last good checkpoint is where the rerun goes on from (a save cut
  # short on the read-only disk could not be removed: orbax removes it).
  rerun = _main(workdir, "--config.total_steps=60",
                "--config.checkpoint.every_steps=1")
  _, err = rerun.communicate(timeout=300)
  assert rerun.returncode == 0, err[-3000:]
  assert f"resuming from the checkpoint at step {saved[-1]}" in err
  _assert_no_temporary_dirs(workdir)


def test_a_full_disk_stops_the_run_in_one_line_and_frees_the_partial_save(
    tmp_path):
  disk = str(tmp_path / "disk")
  os.makedirs(disk)
  _mount("-t", "tmpfs", "-o", "size=8m", "tmpfs", disk)
  try:
    workdir = os.path.join(disk, "run")
    process = _main(workdir, "--config.total_steps=200",
                    "--config.checkpoint.every_steps=1",
                    "--config.checkpoint.max_to_keep=2")
    helpers.wait_for(
        lambda: os.path.isdir(os.path.join(workdir, "checkpoints"))
        and _steps(workdir), process)
    try:  # fill the disk
      with open(os.path.join(disk, "filler"), "wb") as f:
        while True:
          f.write(b"\0" * (64 << 10))
          f.flush()
    except OSError:
      pass
    started = time.time()
    _assert_stopped_in_one_line(process, workdir, "No space left on device",
                                started)
    _assert_no_temporary_dirs(workdir)  # the partial save freed at once
    os.remove(os.path.join(disk, "filler"))
    workdir_lib.claim(workdir).release()  # the lock was released
    newest = _steps(workdir)[-1]
    rerun = _main(workdir, "--config.total_steps=200",
                  "--config.checkpoint.every_steps=1",
                  "--config.checkpoint.max_to_keep=2")
    _, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-3000:]
    assert f"resuming from the checkpoint at step {newest}" in err
  finally:
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
    ("seed", -1, "must be an integer in [0, "),
    ("log_every_seconds", -5.0, "must be a number >= 0"),
])
def test_a_bad_setting_is_one_line_and_creates_nothing(tmp_path, field, value,
                                                       message):
  workdir = tmp_path / "run"
  with pytest.raises(validation.ConfigError) as error:
    train.train_and_evaluate(_config(**{field: value}), str(workdir))
  assert str(error.value) == f"config.{field}={value!r} {message}" or (
      str(error.value).startswith(f"config.{field}={value!r} {message}"))
  assert "\n" not in str(error.value)
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
  for field in ("tokens_per_s", "model_flops_per_s"):
    assert after[field] > 0
  # The same records timed both (all but the first step's, whose time
  # started with the loop).
  steps, tokens, seconds = records.timed_steps(
      metrics_lib.read_metrics(workdir))
  assert after["timed_steps"] == steps == 7
  assert after["tokens_per_s"] == pytest.approx(tokens / seconds)


def test_timed_steps_counts_each_attempt_from_its_own_clock():
  metrics = [{"step": 1, "elapsed_s": 5.0, "tokens_seen": 10},
             {"step": 2, "elapsed_s": 6.0, "tokens_seen": 20},
             # resumed after step 2: this attempt's clock starts again
             {"step": 3, "elapsed_s": 2.0, "tokens_seen": 30},
             {"step": 4, "elapsed_s": 3.5, "tokens_seen": 40}]
  assert records.timed_steps(metrics) == (3, 30, 1.0 + 2.0 + 1.5)


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


def _tensorboard_points(workdir, tag):
  """{step: value} as TensorBoard shows `tag`: a SessionLog START at step s
  (tensorboardX's purge_step) hides the points at s and after that were
  written before it."""
  points = {}
  directory = os.path.join(workdir, "tensorboard")
  for name in sorted(os.listdir(directory),
                     key=lambda n: os.path.getmtime(os.path.join(directory,
                                                                 n))):
    with open(os.path.join(directory, name), "rb") as f:
      data = f.read()
    offset = 0
    while offset < len(data):
      (length,) = struct.unpack("<Q", data[offset:offset + 8])
      event = event_pb2.Event.FromString(
          data[offset + 12:offset + 12 + length])
      offset += 12 + length + 4
      if event.session_log.status == event_pb2.SessionLog.START:
        points = {s: v for s, v in points.items() if s < event.step}
      for value in event.summary.value:
        if value.tag == tag:
          points[event.step] = value.simple_value
  return points


def test_tensorboard_drops_the_points_a_resumed_run_takes_again(finished,
                                                                tmp_path):
  workdir = _copy(finished, tmp_path)
  os.remove(os.path.join(workdir, "summary.json"))
  shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
  # Killed after logging step 8, whose checkpoint was not finished.
  train.train_and_evaluate(_config(), workdir)
  losses = {r["step"]: r["train_loss"]
            for r in metrics_lib.read_metrics(workdir)}
  points = _tensorboard_points(workdir, "train_loss")
  assert sorted(points) == list(range(1, 9))
  assert points == pytest.approx(losses)


# 7. A stop while the first programs compile ends the run at once.


def test_sigterm_while_compiling_exits_within_seconds(tmp_path):
  workdir = str(tmp_path / "run")
  # No compilation cache: the compile must really take its time.
  env = {k: v for k, v in ENV.items() if not k.startswith("JAX_")}
  process = _main(workdir, "--config.model.num_layers=12",
                  "--config.model.remat=true", env=env)
  lock = os.path.join(workdir, workdir_lib.LOCK_FILE)
  helpers.wait_for(
      lambda: os.path.exists(lock) and open(lock).read().strip(), process)
  time.sleep(0.5)  # into the compile
  started = time.time()
  process.send_signal(signal.SIGTERM)
  _, err = process.communicate(timeout=120)
  assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
  assert err.strip().splitlines()[-1] == (
      "stopped by SIGTERM: no step was taken, nothing to save")
  assert time.time() - started < 5
  assert "compiled in" not in err  # it did not wait for the compile
