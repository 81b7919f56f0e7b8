"""Faults in the files a run writes, and in the text it reads.

Each test is a promise of README.md's "Faults and resume" list for one of
the run's outputs: metrics.jsonl or TensorBoard's events removed mid-run
(written again whole), metrics.jsonl lacking steps on resume (said in one
line), the workdir or its checkpoints removed while a save is in flight
and TensorBoard's directory unwritable or full (one `error:` line, no
tracebacks), a corpus file that is not text (refused before anything is
created), and a normal resume (no warning). Runs that must stop on their
own are real `python -m diloco_jax.main` processes under a timeout.
"""

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import time

import pytest
import tensorstore

from configs import tiny
from diloco_jax.data import errors as data_errors
from diloco_jax.data import text_files
from diloco_jax.run import files
from diloco_jax.run import metrics as metrics_lib
from diloco_jax.run import train
from diloco_jax.run import workdir as workdir_lib
from tests import helpers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO}
# A bound only a hang exceeds: on a loaded 2-core machine a failed save can
# take tens of seconds to fail and the process as long to exit.
_STOP_TIMEOUT_S = 240


def _config(**overrides):
  return helpers.with_overrides(tiny.get_config(), overrides)


def _main(workdir, *flags):
  return subprocess.Popen(
      [sys.executable, "-m", "diloco_jax.main", "--config=configs/tiny.py",
       f"--workdir={workdir}", *flags], cwd=REPO, env=ENV, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _stop(process):
  if process.poll() is None:
    process.kill()
  process.communicate()


def _warnings(caplog):
  return [record.getMessage() for record in caplog.records
          if record.levelno >= logging.WARNING]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A finished 8-step run (checkpoints at steps 4 and 8)."""
  workdir = str(tmp_path_factory.mktemp("finished") / "run")
  train.train_and_evaluate(_config(), workdir)
  return workdir


def _resumable_at_step_4(finished, tmp_path):
  """A copy of `finished` as a run killed after step 8's record, before
  its checkpoint: a rerun resumes from step 4."""
  workdir = str(tmp_path / "run")
  shutil.copytree(finished, workdir, symlinks=True)
  os.remove(os.path.join(workdir, "summary.json"))
  shutil.rmtree(os.path.join(workdir, "checkpoints", "8"))
  return workdir


# 1. metrics.jsonl and TensorBoard's events: nothing is lost silently.


def test_outputs_removed_mid_run_are_written_again_whole(tmp_path,
                                                         monkeypatch, caplog):
  workdir = tmp_path / "run"
  tensorboard = workdir / "tensorboard"
  steps = []

  def remove_outputs_before_step_5(inner_step, state, batch):
    steps.append(len(steps) + 1)
    if steps[-1] == 5:  # records 1-4 are written by now
      os.remove(workdir / "metrics.jsonl")
      shutil.rmtree(tensorboard)  # as `rm -r tensorboard` would
    return inner_step(state, batch)

  helpers.wrap_inner_step(monkeypatch, remove_outputs_before_step_5)
  with caplog.at_level(logging.WARNING):
    train.train_and_evaluate(_config(), str(workdir))
  assert steps[-1] == 8
  losses = {record["step"]: record["train_loss"]
            for record in metrics_lib.read_metrics(str(workdir))}
  assert sorted(losses) == list(range(1, 9))  # each step once
  assert helpers.tensorboard_points(str(workdir), "train_loss") == (
      pytest.approx(losses))
  restored = [message for message in _warnings(caplog)
              if "was removed or replaced while the run wrote it" in message]
  assert len(restored) == 2, _warnings(caplog)
  assert restored[0].startswith(f"{workdir / 'metrics.jsonl'} was removed")
  assert restored[1].startswith(f"{tensorboard}{os.sep}events.out.tfevents")
  assert all(message.endswith("nothing is lost") for message in restored)


def test_a_resume_names_the_steps_metrics_jsonl_lacks(finished, tmp_path,
                                                      caplog):
  workdir = _resumable_at_step_4(finished, tmp_path)
  os.remove(os.path.join(workdir, "metrics.jsonl"))  # while no run held it
  with caplog.at_level(logging.WARNING):
    summary = train.train_and_evaluate(_config(), workdir)
  assert summary["resumed_from_step"] == 4
  assert [record["step"] for record in metrics_lib.read_metrics(workdir)] == [
      5, 6, 7, 8]
  assert [message for message in _warnings(caplog)
          if "metrics.jsonl" in message] == [
              f"{workdir}/metrics.jsonl lacks the records of steps 1-4, "
              "before the checkpoint at step 4 this run resumes from; those "
              "steps are not taken again, so their records stay missing"]


def test_a_normal_resume_warns_of_nothing(finished, tmp_path, caplog):
  # orbax used to warn "Metadata file does not exist" on every resume,
  # which reads like damage.
  workdir = _resumable_at_step_4(finished, tmp_path)
  with caplog.at_level(logging.WARNING):
    summary = train.train_and_evaluate(_config(), workdir)
  assert summary["resumed_from_step"] == 4
  assert not _warnings(caplog)


# 2. The workdir or its checkpoints removed while a save is in flight: one
# line naming the path, whichever write meets the removal first.


def _steps_in(checkpoints) -> tuple[int, int]:
  """(the newest step being saved, the newest step saved or being saved);
  0 for none. orbax saves step s in 's.orbax-checkpoint-tmp...' first."""
  try:
    names = os.listdir(checkpoints)
  except FileNotFoundError:
    return 0, 0
  steps = [(int(name.split(".")[0]), "orbax-checkpoint-tmp" in name)
           for name in names if name.split(".")[0].isdigit()]
  return (max([step for step, saving in steps if saving], default=0),
          max([step for step, _ in steps], default=0))


def _remove_during_a_save(process, checkpoints, path, attempts=5):
  """Removes `path` while a save is in flight, again at a later save if
  the run went on (that save had finished first, and orbax made its
  directory again); returns the run's stderr."""
  for _ in range(attempts):
    helpers.wait_for(lambda: _steps_in(checkpoints)[0], process)
    removed_at = _steps_in(checkpoints)[1]
    shutil.rmtree(path, ignore_errors=True)
    deadline = time.time() + _STOP_TIMEOUT_S
    while process.poll() is None and time.time() < deadline:
      if _steps_in(checkpoints)[1] > removed_at:  # the run went on
        break
      time.sleep(0.01)
    if process.poll() is not None:
      return process.communicate()[1]
  raise AssertionError(f"the run went on after {attempts} removals")


def _assert_one_error_line(process, err, start):
  assert process.returncode == 1, err[-3000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith(start), last
  # No traceback, from the main thread or from a save's threads.
  assert "Traceback" not in err and "Event loop is closed" not in err, (
      err[-3000:])


def test_removing_the_checkpoints_during_a_save_stops_the_run_in_one_line(
    tmp_path):
  workdir = str(tmp_path / "run")
  checkpoints = os.path.join(workdir, "checkpoints")
  process = _main(workdir, "--config.total_steps=400",
                  "--config.checkpoint.every_steps=1")
  try:
    err = _remove_during_a_save(process, checkpoints, checkpoints)
  finally:
    _stop(process)
  _assert_one_error_line(process, err, f"error: cannot write checkpoints in "
                         f"{checkpoints}: No such file or directory")


def test_removing_the_workdir_during_a_save_stops_the_run_in_one_line(
    tmp_path):
  workdir = str(tmp_path / "run")
  process = _main(workdir, "--config.total_steps=400",
                  "--config.checkpoint.every_steps=1")
  try:
    # At once: its next record finds metrics.jsonl gone with the lock, even
    # where orbax's threads made directories again under the workdir.
    err = _remove_during_a_save(process, os.path.join(workdir, "checkpoints"),
                                workdir, attempts=1)
  finally:
    _stop(process)
  _assert_one_error_line(process, err, "error: cannot write ")
  last = err.strip().splitlines()[-1]
  assert (last.endswith("No such file or directory")
          or last.endswith("(the workdir is being removed)")), last
  assert workdir in last, last


def test_tensorstore_not_found_is_reported_as_a_missing_file(tmp_path):
  # What orbax's writer raises for a file of a save removed under it: a
  # status with no OS error code.
  missing = tmp_path / "removed"
  with pytest.raises(ValueError) as error:
    tensorstore.open({"driver": "zarr", "path": "x/", "kvstore": {
        "driver": "ocdbt", "base": f"file://{missing}/"}},
                     open=True).result()
  assert str(error.value).startswith("NOT_FOUND: ")
  assert "os_error_code" not in str(error.value)
  assert str(files.storage_error("checkpoints in", str(missing),
                                 error.value)) == (
      f"cannot write checkpoints in {missing}: No such file or directory")


# 3. TensorBoard's directory: checked with the workdir, its writes stop the
# run in one line like every other write.


def _mount(*args) -> bool:
  return subprocess.run(["mount", *args], capture_output=True,
                        check=False).returncode == 0


@contextlib.contextmanager
def _unwritable(directory):
  """`directory` made unwritable: read-only bind-mounted as root (whom
  permissions do not stop), its mode 0555 otherwise."""
  if os.geteuid() != 0:
    os.chmod(directory, 0o555)
    try:
      yield "Permission denied"
    finally:
      os.chmod(directory, 0o755)
    return
  if not _mount("--bind", directory, directory):
    pytest.skip("root without mount(8): cannot make a read-only directory")
  try:
    assert _mount("-o", "remount,ro,bind", directory)
    yield "Read-only file system"
  finally:
    subprocess.run(["umount", "-l", directory], check=False)


def test_an_unwritable_tensorboard_directory_is_refused_before_writing(
    tmp_path):
  workdir = tmp_path / "run"
  tensorboard = workdir / "tensorboard"
  tensorboard.mkdir(parents=True)
  with _unwritable(str(tensorboard)) as reason:
    with pytest.raises(workdir_lib.WorkdirError) as error:
      train.train_and_evaluate(_config(), str(workdir))
  assert str(error.value) == (f"--workdir={workdir}: {tensorboard} is not "
                              f"writable ({reason})")
  assert sorted(os.listdir(workdir)) == ["tensorboard"]  # nothing written


def test_a_full_tensorboard_disk_stops_the_run_in_one_line(tmp_path):
  workdir = tmp_path / "run"
  tensorboard = workdir / "tensorboard"
  tensorboard.mkdir(parents=True)
  # A file system of its own, so only TensorBoard's writes fill it. Needs
  # root: skipped before anything is started otherwise.
  if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", "size=256k",
                                     "tmpfs", str(tensorboard)):
    pytest.skip("needs root and mount(8) to make a real full file system")
  try:
    process = _main(str(workdir), "--config.total_steps=400")
    try:
      helpers.wait_for(
          lambda: len(metrics_lib.read_metrics(str(workdir))) >= 2, process)
      with contextlib.suppress(OSError), open(tensorboard / "filler",
                                              "wb") as f:
        while True:  # until the disk is full
          f.write(b"\0" * (64 << 10))
          f.flush()
      _, err = process.communicate(timeout=_STOP_TIMEOUT_S)
    finally:
      _stop(process)
  finally:
    subprocess.run(["umount", "-l", str(tensorboard)], check=False)
  _assert_one_error_line(process, err, "error: cannot write TensorBoard "
                         f"events {tensorboard}{os.sep}events.out.tfevents.")
  assert err.strip().endswith(": No space left on device"), err[-3000:]


# 4. A corpus of text only.


@pytest.mark.parametrize("content, reason", [
    (b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8,
     "a NUL byte at offset 7"),
    ("un café noir, ".encode("latin-1") * 100,
     "byte 0xe9 at offset 6 is not UTF-8"),
])
def test_a_file_that_is_not_text_is_refused_before_anything_is_created(
    tmp_path, content, reason):
  data = tmp_path / "data"
  data.mkdir()
  (data / "a.txt").write_text("un café noir, s'il vous plaît.\n" * 400,
                              encoding="utf-8")
  (data / "b.bin").write_bytes(content)
  workdir = tmp_path / "run"
  with pytest.raises(data_errors.DataError) as error:
    train.train_and_evaluate(_config(**{
        "data.corpus": "text_files", "data.path": str(data),
        "model.vocab_size": 257}), str(workdir))
  assert str(error.value) == (
      f"config.data.path={str(data)!r}: {data / 'b.bin'} is not UTF-8 text "
      f"({reason}); corpus 'text_files' reads plain text files: give a "
      "file, directory or glob of text only (e.g. DIR/**/*.txt)")
  assert not workdir.exists()


def test_text_is_told_from_binary_by_the_first_block(tmp_path):
  # A character cut by the end of the block read is still text.
  cut = ("x" * 8191 + "é").encode()
  assert text_files.not_text_reason(cut[:8192]) is None
  assert text_files.not_text_reason("ünïcödé ✓\n".encode()) is None
  assert text_files.not_text_reason(b"text\0") == "a NUL byte at offset 4"
  for name in ("a.txt", "b.bin", "c.bin"):
    (tmp_path / name).write_bytes(b"\0" if name.endswith(".bin") else b"ok")
  with pytest.raises(data_errors.DataError,
                     match=r"b\.bin is not UTF-8 text \(a NUL byte at "
                     r"offset 0\) \(and 1 more of the 3 files\);"):
    text_files.check_text(tmp_path, ["a.txt", "b.bin", "c.bin"],
                          str(tmp_path))
  text_files.check_text(tmp_path, ["a.txt"], str(tmp_path))
