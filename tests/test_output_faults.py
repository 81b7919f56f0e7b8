"""Faults in the files a run writes, and in the text it reads.

Each test is a promise of README.md's "Faults and resume" list for one of
the run's outputs: metrics.jsonl or TensorBoard's events removed mid-run
(written again whole), metrics.jsonl lacking steps on resume (said in one
line), the workdir or its checkpoints removed while a save is in flight
and TensorBoard's directory unwritable or full (one `error:` line, no
tracebacks, nothing of the run's left in a workdir being removed), a
corpus file that is not text (refused before anything is created), a
normal resume (no warning), a full disk (no torn record, no workdir left
by a run that could not start) and every error exit printing its one line
and no other. Runs that must stop on their own are real `python -m
diloco_jax.main` processes under a timeout.
"""

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import time

import pytest
import tensorstore
from orbax.checkpoint._src.metadata import array_metadata_store

from configs import tiny
from diloco_jax.data import errors as data_errors
from diloco_jax.data import text_files
from diloco_jax.run import train
from diloco_jax.storage import files
from diloco_jax.storage import workdir as workdir_lib
from diloco_jax.telemetry import metrics_files as metrics_lib
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


def test_starting_from_another_run_warns_of_nothing(finished, tmp_path,
                                                    caplog):
  """init_from (and the pretraining-to-DiLoCo switch, which reads its
  pretraining run's checkpoints the same way): the source's checkpoints
  opened read-only, without orbax's warnings about them."""
  config = _config()
  config.init_from = finished
  config.total_steps = 12  # 4 steps after the source's 8
  with caplog.at_level(logging.WARNING):
    summary = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert summary["initialized_from"]
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
  # Before it only the run's progress (and a file it wrote again): no
  # library's error or warning of the same failure, no line repeating it.
  assert all(_PROGRESS.match(line) or _WRITTEN_AGAIN in line
             for line in err.strip().splitlines()[:-1] if line), err[-3000:]


_PROGRESS = re.compile(r"I\d{4} ")  # absl's INFO lines
_WRITTEN_AGAIN = "was removed or replaced while the run wrote it"


@pytest.mark.slow
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


def test_a_save_whose_directory_orbax_finds_gone_stops_the_run_in_one_line(
    tmp_path, monkeypatch):
  # The 1-in-7 race of removing the workdir during a save, made certain:
  # orbax's helper threads make a save's directory again, empty, before
  # its last step reads back the array metadata written there, and orbax
  # raises a ValueError that names no OS error.
  workdir = tmp_path / "run"
  checkpoints = workdir / "checkpoints"
  read = array_metadata_store.Store.read

  async def removed_before_read(self, checkpoint_dir, *args, **kwargs):
    shutil.rmtree(checkpoints)  # as `rm -r` would, mid-save
    os.makedirs(checkpoint_dir)  # as orbax's other threads do meanwhile
    return await read(self, checkpoint_dir, *args, **kwargs)

  monkeypatch.setattr(array_metadata_store.Store, "read", removed_before_read)
  with pytest.raises(files.StorageError) as error:
    # A synchronous save: it meets the removal in the loop's own call.
    train.train_and_evaluate(_config(**{"checkpoint.async_save": False}),
                             str(workdir))
  assert str(error.value) == (f"cannot write checkpoints in {checkpoints}: "
                              "No such file or directory")
  assert os.listdir(checkpoints) == []  # the save's remains removed


def _rm_r_around_the_run(workdir, before_step, after_step):
  """An inner-step wrapper that removes `workdir` as `rm -r` would, but
  with the run writing in between: metrics.jsonl and tensorboard/ before
  step `before_step` (the run writes them again at its next record), the
  rest before step `after_step`, and the directory, which the run's new
  copies keep (rm fails: "Directory not empty")."""
  calls = []

  def wrapper(inner_step, state, batch):
    calls.append(len(calls) + 1)
    if calls[-1] == before_step:
      os.remove(workdir / "metrics.jsonl")
      shutil.rmtree(workdir / "tensorboard")
    if calls[-1] == after_step:
      assert (workdir / "metrics.jsonl").exists()  # written again
      for name in set(os.listdir(workdir)) - {"metrics.jsonl",
                                              "tensorboard"}:
        path = workdir / name
        if path.is_dir():
          shutil.rmtree(path)
        else:
          path.unlink()
      with pytest.raises(OSError):
        os.rmdir(workdir)
    return inner_step(state, batch)

  return wrapper


def test_a_workdir_removed_around_the_run_is_not_made_again(tmp_path,
                                                            monkeypatch):
  # The run writes metrics.jsonl and tensorboard/ again (they were removed
  # while the workdir stayed); then the rest of the workdir goes: the run
  # stops at its next record and removes its new copies.
  workdir = tmp_path / "run"
  helpers.wrap_inner_step(monkeypatch, _rm_r_around_the_run(workdir, 5, 7))
  with pytest.raises(files.StorageError) as error:
    # Synchronous saves: none in flight to meet the removal.
    train.train_and_evaluate(_config(**{
        "total_steps": 12, "checkpoint.async_save": False}), str(workdir))
  assert str(error.value) == (
      f"cannot write metrics {workdir / 'metrics.jsonl'}: "
      f"{workdir / 'run.lock'} was removed (the workdir is being removed)")
  assert not workdir.exists()


def test_releasing_a_workdir_removed_meanwhile_raises_nothing(tmp_path):
  workdir = tmp_path / "run"
  claim = workdir_lib.claim(str(workdir))
  release = claim.lock.release

  def removed_first(remove=False):
    shutil.rmtree(workdir)  # `rm -r` as the run ends
    release(remove=remove)

  claim.lock.release = removed_first
  claim.release()
  assert not workdir.exists()


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


@pytest.mark.slow
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


# 5. A full disk: no torn record, and no workdir from a run that could not
# start.


@contextlib.contextmanager
def _small_disk(directory):
  """`directory` on a small file system of its own (tmpfs). Needs root and
  mount(8): skipped otherwise."""
  os.makedirs(directory, exist_ok=True)
  if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", "size=256k",
                                     "tmpfs", str(directory)):
    pytest.skip("needs root and mount(8) to make a real full file system")
  try:
    yield
  finally:
    subprocess.run(["umount", "-l", str(directory)], check=False)


def _fill(directory, free_pages: int = 0) -> None:
  """Fills `directory`'s file system but for `free_pages` pages (4 KiB)."""
  filler = os.path.join(directory, "filler")
  with contextlib.suppress(OSError), open(filler, "wb") as f:
    while True:  # until the disk is full
      f.write(b"\0" * 4096)
      f.flush()
  os.truncate(filler, max(os.path.getsize(filler) - free_pages * 4096, 0))


@pytest.mark.parametrize("free_pages", [0, 2])
def test_a_run_that_cannot_start_on_a_full_disk_leaves_no_workdir(
    tmp_path, free_pages):
  # No page: run.lock cannot be written. Two: run.lock and config.json
  # are, then metrics.jsonl and the TensorBoard file are opened and their
  # first write fails.
  disk = tmp_path / "disk"
  workdir = disk / "run"
  with _small_disk(disk):
    _fill(disk, free_pages)
    result = subprocess.run(
        [sys.executable, "-m", "diloco_jax.main", "--config=configs/tiny.py",
         f"--workdir={workdir}"], cwd=REPO, env=ENV, text=True,
        capture_output=True, timeout=_STOP_TIMEOUT_S, check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    line = result.stderr.strip()  # the only one
    assert line.startswith(f"error: --workdir={workdir}: cannot write "
                           if not free_pages else "error: cannot write "), (
                               result.stderr[-3000:])
    assert line.endswith(": No space left on device"), result.stderr[-3000:]
    assert os.listdir(disk) == ["filler"]


def test_a_full_disk_leaves_whole_records(tmp_path):
  # A record the disk has room for part of is taken back: metrics.jsonl
  # and the TensorBoard file end in whole records.
  workdir = tmp_path / "run"
  with _small_disk(workdir):
    writer = metrics_lib.MetricsWriter(str(workdir), total_steps=10_000)
    writer.start_clock()
    for step in range(1, 10_000):
      if step == 3:  # each file's last page partly written
        _fill(workdir)
      try:
        writer.write({"step": step, "round": 1, "tokens_seen": step,
                      "train_loss": 1.0, "padding": "x" * 200})
      except files.StorageError as e:
        if "metrics.jsonl" in str(e):  # the file that matters most
          break
    writer.close()
    with open(workdir / "metrics.jsonl", "rb") as f:
      jsonl = f.read()
    events = [os.path.join(workdir, "tensorboard", name)
              for name in os.listdir(workdir / "tensorboard")]
    with open(events[0], "rb") as f:
      event_file = f.read()
  assert jsonl.endswith(b"\n")
  assert [json.loads(line)["step"] for line in jsonl.splitlines()] == list(
      range(1, step))
  at = 0
  while at < len(event_file):  # TFRecords: length, CRC, data, CRC
    at += 8 + 4 + struct.unpack("<Q", event_file[at:at + 8])[0] + 4
  assert at == len(event_file)


def test_a_resume_repairs_a_torn_last_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1}\n{"step": 2}')  # torn before its newline
  assert metrics_lib.truncate_metrics(str(tmp_path), 2) == 0
  assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
  path.write_text('{"step": 1}\n{"step": 2}\n{"st')  # torn mid-record
  assert metrics_lib.truncate_metrics(str(tmp_path), 2) == 1
  assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


# 6. Every error exit prints its `error:` line and nothing else.


def test_each_error_before_the_run_starts_is_the_only_line(tmp_path):
  data = tmp_path / "data"
  data.mkdir()
  (data / "a.bin").write_bytes(b"\0" * 64)
  held = tmp_path / "held"
  held.mkdir()
  cases = {  # flags: the line
      ("--config.total_steps=-3",):
          "error: config.total_steps=-3 must be an integer >= 1",
      ("--config.total_stepz=3",):
          "error: --config.total_stepz: no such config field; did you mean "
          "--config.total_steps?",
      ("extra",):
          "error: unexpected arguments ['extra']: every setting is a flag "
          "(--workdir=DIR, --config.FIELD=VALUE)",
      ("--config.data.corpus=text_files", f"--config.data.path={data}",
       "--config.model.vocab_size=257"):
          f"error: config.data.path={str(data)!r}: {data / 'a.bin'} is not "
          "UTF-8 text (a NUL byte at offset 0); corpus 'text_files' reads "
          "plain text files: give a file, directory or glob of text only "
          "(e.g. DIR/**/*.txt)",
      ("held",):
          f"error: --workdir={held} is in use by another run (pid 12345); "
          "wait for it to end or choose another workdir",
  }
  with open(held / "run.lock", "w") as lock:
    lock.write("12345\n")
    lock.flush()
    fcntl.flock(lock, fcntl.LOCK_EX)
    processes = {
        flags: _main(held if flags == ("held",) else tmp_path / "run",
                     *(() if flags == ("held",) else flags))
        for flags in cases}  # at once: each is mostly JAX's import
    try:
      outputs = {flags: process.communicate(timeout=_STOP_TIMEOUT_S)
                 for flags, process in processes.items()}
    finally:
      for process in processes.values():
        _stop(process)
  for flags, line in cases.items():
    out, err = outputs[flags]
    assert (out, err.strip()) == ("", line), (flags, err[-3000:])
  assert not (tmp_path / "run").exists()
  assert os.listdir(held) == ["run.lock"]
