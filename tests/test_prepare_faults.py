"""Faults a prepare meets, and the unreadable text files a run meets.

Each is one `error:` line (no traceback, nothing but progress lines before
it), and what a prepare had finished stays resumable: a text file that
cannot be read (refused before anything is written, by the prepare and by
a run) or is removed after the files were listed; a full disk and the
output removed mid-run; --output below a regular file. A prepare SIGKILLed
mid-shard leaves no worker writing (so the same command, run at once,
finishes whole) and no semaphores in /dev/shm; --help exits 0. Prepares
and runs are real `python -m` processes on real files: an unreadable file
is mode 000 (read by a process without CAP_DAC_OVERRIDE when the tests run
as root), a full disk a small tmpfs.
"""
import contextlib
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import sentencepiece

from diloco_jax.data import embedded
from diloco_jax.data import errors
from diloco_jax.data import prepare
from diloco_jax.data import prepare_plan
from diloco_jax.data import text_files
from diloco_jax.data import token_shards

REPO = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
_WORDS = ("ka", "lo", "mi", "ne", "ru", "ta", "vi", "so", "pe", "du")
# absl's INFO lines of a prepare's progress, the only lines allowed before
# its error.
_PROGRESS = re.compile(r"^I\d{4} [\d:.]+ +\d+ prepare\.py:\d+\] "
                       r"(prepare \[[#.]+\] \d+/\d+ shards|resuming: )")
_KEPT = ("; the finished shards are kept in {}; rerun the same command to "
         "make the others")


def _text(rng: random.Random, size: int) -> str:
  """`size` characters of words of syllables."""
  pieces = rng.choices(_WORDS + tuple(word + " " for word in _WORDS),
                       k=size // 2)
  return "".join(pieces)[:size]


def _write_texts(directory: pathlib.Path, count: int, size: int,
                 seed: int = 0) -> pathlib.Path:
  rng = random.Random(seed)
  directory.mkdir(parents=True)
  for number in range(count):
    (directory / f"doc{number:02d}.txt").write_text(_text(rng, size))
  return directory


def _command(*flags, prefix=()) -> list[str]:
  return [*prefix, sys.executable, "-m", "diloco_jax.data.prepare", *flags]


def _run(*flags, prefix=()) -> subprocess.CompletedProcess:
  return subprocess.run(_command(*flags, prefix=prefix), cwd=REPO, env=ENV,
                        capture_output=True, text=True, timeout=120,
                        check=False)


def _assert_one_error_line(result, pattern: str) -> str:
  """The process failed with one line matching `pattern` last, after
  progress lines at most; returns that line."""
  assert result.returncode == 1, (result.stdout, result.stderr[-3000:])
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert re.fullmatch(pattern, lines[-1]), lines[-1]
  assert all(_PROGRESS.match(line) for line in lines[:-1] if line), lines
  return lines[-1]


def _shards(directory: pathlib.Path) -> dict[str, bytes]:
  return {path.name: path.read_bytes() for path in directory.iterdir()
          if path.name != token_shards.INDEX_FILE}


# A file that cannot be read: refused before anything is written.


def _unreading_prefix(path: pathlib.Path) -> list[str]:
  """Makes `path` mode 000 and returns the command prefix of a process that
  cannot read it: none for a user; as root (whom modes do not stop),
  setpriv dropping CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH. Skips where
  neither makes it unreadable."""
  path.chmod(0)
  prefix = []
  if os.geteuid() == 0:
    caps = "-dac_override,-dac_read_search"
    prefix = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]
  try:
    probe = subprocess.run([*prefix, sys.executable, "-c",
                            f"open({str(path)!r}, 'rb')"],
                           capture_output=True, text=True, check=False)
  except FileNotFoundError:
    pytest.skip("root without setpriv(1): cannot make an unreadable file")
  if "PermissionError" not in probe.stderr:
    pytest.skip(f"cannot make an unreadable file: {probe.stderr[-300:]}")
  return prefix


def _unreadable_message(field: str, path: pathlib.Path, file: pathlib.Path,
                        reason: str = "Permission denied") -> str:
  return (f"{field}={str(path)!r}: cannot read {file} ({reason}); corpus "
          "'text_files' reads every file the path names: make it readable, "
          "or name only readable files")


def test_the_prepare_refuses_an_unreadable_text_file_before_writing(
    tmp_path):
  data = _write_texts(tmp_path / "text", 6, 200)
  prefix = _unreading_prefix(data / "doc03.txt")
  output = tmp_path / "tokens"
  result = _run("--corpus=text_files", f"--path={data}", f"--output={output}",
                "--processes=2", prefix=prefix)
  assert result.returncode == 1 and not result.stdout
  assert result.stderr.strip() == "error: " + _unreadable_message(
      "--path", data, data / "doc03.txt")  # the only line
  assert not output.exists()


def test_a_run_refuses_an_unreadable_text_file_before_writing(tmp_path):
  data = _write_texts(tmp_path / "text", 4, 2000)
  prefix = _unreading_prefix(data / "doc01.txt")
  workdir = tmp_path / "run"
  result = subprocess.run(
      [*prefix, sys.executable, "-m", "diloco_jax.main",
       "--config=configs/tiny.py", f"--workdir={workdir}",
       "--config.data.corpus=text_files", f"--config.data.path={data}",
       "--config.model.vocab_size=257"], cwd=REPO, env=ENV,
      capture_output=True, text=True, timeout=240, check=False)
  assert result.returncode == 1 and not result.stdout, result.stderr[-3000:]
  assert result.stderr.strip() == "error: " + _unreadable_message(
      "config.data.path", data, data / "doc01.txt")  # the only line
  assert not workdir.exists()


def test_a_text_file_removed_after_the_listing_is_one_line(tmp_path):
  data = _write_texts(tmp_path / "text", 6, 200)
  removed = data / "doc02.txt"
  # Between listing and checking: the check names it.
  root, names = text_files.resolve_text_files(str(data))
  removed.rename(tmp_path / "aside.txt")
  with pytest.raises(errors.DataError) as error:
    text_files.check_text(root, names, str(data))
  assert str(error.value) == _unreadable_message(
      "config.data.path", data, removed, "No such file or directory")
  # Between the check and the reading (a run's corpus, a prepare's worker).
  with pytest.raises(errors.DataError, match=(
      f"^cannot read {re.escape(str(removed))}: No such file or directory$")):
    list(embedded.read_documents([data / "doc01.txt", removed],
                                 skip_unreadable=False))
  (tmp_path / "aside.txt").rename(removed)
  plan = prepare_plan.make_plan("text_files", str(data),
                                str(tmp_path / "tokens"))
  removed.unlink()
  with pytest.raises(errors.DataError, match=(
      f"^cannot read {re.escape(str(removed))}: No such file or directory$")):
    prepare.prepare(plan, processes=2)
  assert not (tmp_path / "tokens" / token_shards.INDEX_FILE).exists()


# The prepare's own faults.


def test_help_exits_0():
  result = _run("--help")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "--output" in result.stdout and not result.stderr


def test_an_output_below_a_regular_file_is_one_line_before_writing(tmp_path):
  data = _write_texts(tmp_path / "text", 3, 200)
  file = tmp_path / "file"
  file.write_text("mine\n")
  result = _run("--corpus=text_files", f"--path={data}",
                f"--output={file / 'tokens'}")
  assert result.returncode == 1 and not result.stdout
  assert result.stderr.strip() == (
      f"error: --output={str(file / 'tokens')!r}: {str(file)!r} is a file, "
      "not a directory")
  assert file.read_text() == "mine\n"
  assert sorted(os.listdir(tmp_path)) == ["file", "text"]


def _mount(*args) -> bool:
  return subprocess.run(["mount", *args], capture_output=True,
                        check=False).returncode == 0


def test_a_full_disk_is_one_line_and_the_rerun_finishes(tmp_path):
  disk = tmp_path / "disk"
  disk.mkdir()
  if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", "size=256k",
                                     "tmpfs", str(disk)):
    pytest.skip("needs root and mount(8) to make a real full file system")
  try:
    # 6 files of 40 kB: 6 shards of 80 kB (uint16), 3 of which fit.
    data = _write_texts(tmp_path / "text", 6, 40_000)
    whole = prepare.prepare(prepare_plan.make_plan(
        "text_files", str(data), str(tmp_path / "whole")))
    output = disk / "tokens"
    flags = ("--corpus=text_files", f"--path={data}", f"--output={output}",
             "--processes=2")
    result = _run(*flags)
    _assert_one_error_line(
        result, f"error: cannot write {re.escape(str(output))}\\S*: "
        "No space left on device" + re.escape(_KEPT.format(output)))
    done = json.loads((output / token_shards.PROGRESS_FILE).read_text())
    kept = {name: (output / name).stat().st_ino for name in done["done"]}
    assert kept, "no shard was finished before the disk was full"
    # Room made: the same command makes only the shards it lacks.
    assert _mount("-o", "remount,size=4m", str(disk))
    rerun = _run(*flags)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming: {len(kept)} of 6 shards are done" in rerun.stderr
    assert {name: (output / name).stat().st_ino for name in kept} == kept
    assert _shards(output) == _shards(tmp_path / "whole")
    assert token_shards.read_index(str(output)).splits == whole.splits
  finally:
    subprocess.run(["umount", "-l", str(disk)], check=False)


# SentencePiece shards: slow enough (~0.2 s each) to act mid-prepare.


@pytest.fixture(scope="module")
def slow_input(tmp_path_factory):
  """(text files, a 40-piece SentencePiece model)."""
  directory = tmp_path_factory.mktemp("slow")
  data = _write_texts(directory / "text", 5, 600_000, seed=1)
  rng = random.Random(2)
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=(_text(rng, 100) for _ in range(200)),
      model_prefix=str(directory / "spm"), vocab_size=40,
      hard_vocab_limit=False, minloglevel=2)
  return data, str(directory / "spm.model")


def _wait_for(predicate, process, what: str, timeout: float = 60):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return
    assert process.poll() is None, f"the prepare ended before {what}"
    time.sleep(0.002)
  raise AssertionError(f"no {what} after {timeout} s")


def _children(pid: int) -> list[int]:
  children = []
  for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
    with contextlib.suppress(OSError):
      if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
        children.append(int(stat.parent.name))
  return children


def _running(pid: int) -> bool:
  try:
    state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1]
  except OSError:
    return False
  return state.split()[0] not in ("Z", "X")


def _maps(pid: int) -> list[str]:
  try:
    return pathlib.Path(f"/proc/{pid}/maps").read_text().splitlines()
  except OSError:  # ended
    return []


def _workers(pid: int) -> list[int]:
  workers = []
  for child in _children(pid):
    with contextlib.suppress(OSError):
      if b"spawn_main" in pathlib.Path(f"/proc/{child}/cmdline").read_bytes():
        workers.append(child)
  return workers


def test_output_removed_mid_run_is_one_line(slow_input, tmp_path):
  data, model = slow_input
  output = tmp_path / "tokens"
  flags = ("--corpus=text_files", f"--path={data}", f"--output={output}",
           f"--tokenizer_path={model}", "--processes=2")
  process = subprocess.Popen(_command(*flags), cwd=REPO, env=ENV, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)
  try:
    _wait_for(lambda: any(output.glob("*.bin")), process, "a finished shard")
    # Stopped while the directory goes, so that no write slips between.
    os.killpg(process.pid, signal.SIGSTOP)
    shutil.rmtree(output)
    os.killpg(process.pid, signal.SIGCONT)
    out, err = process.communicate(timeout=120)
  finally:
    if process.poll() is None:
      os.killpg(process.pid, signal.SIGKILL)
      process.communicate()
  _assert_one_error_line(
      subprocess.CompletedProcess([], process.returncode, out, err),
      f"error: cannot write {re.escape(str(output))}\\S*: No such "
      f"file or directory \\(--output={re.escape(repr(str(output)))} was "
      "removed\\); rerun the same command to prepare it again")
  assert _run(*flags).returncode == 0


def test_a_sigkilled_prepare_leaves_no_worker_and_no_semaphore(slow_input,
                                                               tmp_path):
  data, model = slow_input
  whole = tmp_path / "whole"
  prepare.prepare(prepare_plan.make_plan("text_files", str(data), str(whole),
                                         tokenizer_path=model))
  output = tmp_path / "tokens"
  flags = ("--corpus=text_files", f"--path={data}", f"--output={output}",
           f"--tokenizer_path={model}", "--processes=2")
  process = subprocess.Popen(_command(*flags), cwd=REPO, env=ENV,
                             stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL,
                             start_new_session=True)
  try:
    # Both workers started, one of them writing a shard.
    _wait_for(lambda: len(_workers(process.pid)) == 2
              and any(output.glob("*.part")), process, "a shard in the making")
    processes = [process.pid, *_children(process.pid)]
    # No named semaphore (a file in /dev/shm): none a kill could leave.
    assert not [line for pid in processes for line in _maps(pid)
                if "/dev/shm/" in line]
    process.kill()  # the prepare only, as the OOM killer or `kill -9` would
    process.wait()
    made = sorted(output.glob("*.bin"))
    deadline = time.time() + 1.0
    while any(map(_running, processes)) and time.time() < deadline:
      time.sleep(0.01)
    assert not any(map(_running, processes)), "its workers outlive it"
    # No worker went on to rename a shard under the rerun.
    assert sorted(output.glob("*.bin")) == made
  finally:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(process.pid, signal.SIGKILL)
  rerun = _run(*flags)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert _shards(output) == _shards(whole)  # no .part, no progress.json
