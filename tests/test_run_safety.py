"""Runs that never lose work or lie: each row of the failure table, tested.

Non-finite guards (stop and rollback), checksummed checkpoints, one run per
workdir, graceful SIGTERM/SIGINT stops, errors that wait for the checkpoint
in flight and print last, resume that compares configs, workdir errors.
Signals go to real `python -m diloco_jax.main` subprocesses.
"""

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import tiny
from diloco_jax.algorithm import guards
from diloco_jax.config import changes as config_changes
from diloco_jax.config import validation
from diloco_jax.data import errors as data_errors
from diloco_jax.run import train
from diloco_jax.storage import checkpoints as checkpointing
from diloco_jax.storage import integrity
from diloco_jax.storage import resume
from diloco_jax.storage import workdir as workdir_lib
from tests import helpers
from tests import test_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO}


def _config(**overrides):
  return helpers.with_overrides(tiny.get_config(), overrides)


def _strict_metrics(workdir):
  """metrics.jsonl parsed by a JSON reader that refuses NaN and Infinity."""
  def refuse(constant):
    raise AssertionError(f"metrics.jsonl holds {constant}")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line, parse_constant=refuse) for line in f]


def _checkpoint_steps(workdir):
  path = os.path.join(workdir, "checkpoints")
  return sorted(int(s) for s in os.listdir(path) if s.isdigit())


def _assert_checkpoints_finite(workdir):
  for step in _checkpoint_steps(workdir):
    state = ocp.PyTreeCheckpointer().restore(
        os.path.join(workdir, "checkpoints", str(step), "state"))
    for leaf in jax.tree.leaves(state):
      assert np.all(np.isfinite(np.asarray(leaf, np.float64))), step


# 1. Non-finite guard.


def test_a_diverging_run_stops_naming_step_and_island_and_saves_no_nan(
    tmp_path):
  workdir = str(tmp_path / "nan")
  config = _config(**{"inner_optimizer.learning_rate": 1e3,
                      "total_steps": 16, "checkpoint.max_to_keep": 1})
  with pytest.raises(guards.NonFiniteError,
                     match=r"^step \d+: island \d+.* (loss|gradient norm)"):
    train.train_and_evaluate(config, workdir)
  records = _strict_metrics(workdir)  # valid JSON: non-finite became null
  assert any(r["grad_norm"] is None or r["train_loss"] is None
             for r in records)
  # The one checkpoint max_to_keep allows is the last good one.
  assert _checkpoint_steps(workdir) == [4]
  _assert_checkpoints_finite(workdir)
  assert not os.path.exists(os.path.join(workdir, "summary.json"))


def _poison_once(monkeypatch, at_call: int):
  """Makes the inner step's `at_call`-th call return NaN params and loss:
  one transient fault, as a bad batch or a flipped bit would cause."""
  calls = []

  def poisoned(inner_step, state, batch):
    calls.append(1)
    state, metrics = inner_step(state, batch)
    if len(calls) == at_call:
      state = state.replace(island_params=jax.tree.map(
          lambda p: p * jnp.nan, state.island_params))
      metrics = {**metrics, "loss": metrics["loss"] * jnp.nan}
    return state, metrics

  helpers.wrap_inner_step(monkeypatch, poisoned)
  return calls


@pytest.mark.slow
def test_rollback_restores_the_last_good_checkpoint_and_skips_batches(
    tmp_path, monkeypatch):
  workdir = str(tmp_path / "rollback")
  calls = _poison_once(monkeypatch, at_call=6)
  summary = train.train_and_evaluate(
      _config(**{"total_steps": 12, "diloco.inner_steps": 3,
                 "nonfinite": "rollback"}), workdir)
  assert len(calls) == 12 + 3  # steps 4..6 were taken twice
  [rollback] = summary["rollbacks"]
  assert (rollback["step"], rollback["to_step"],
          rollback["skipped_batches"]) == (6, 3, 3)
  assert "island 0" in rollback["error"]
  assert np.isfinite(summary["final_eval_loss"])
  assert [r["step"] for r in _strict_metrics(workdir)] == list(range(1, 13))
  _assert_checkpoints_finite(workdir)


def test_rollback_gives_up_after_max_rollbacks(tmp_path):
  config = _config(**{"inner_optimizer.learning_rate": 1e3,
                      "total_steps": 16, "nonfinite": "rollback",
                      "max_rollbacks": 2})
  with pytest.raises(guards.NonFiniteError, match=r"after 2 rollbacks"):
    train.train_and_evaluate(config, str(tmp_path / "w"))


def test_a_state_with_nan_is_never_saved(tmp_path):
  checkpointer = checkpointing.Checkpointer(str(tmp_path))
  state = {"w": jnp.array([1.0, jnp.inf]), "b": jnp.zeros(2)}
  with pytest.raises(guards.NonFiniteError, match=r"\['w'\].*not saved"):
    checkpointer.save(1, state, {})
  checkpointer.close()
  assert checkpointer.steps() == []


def test_step_problem_names_the_first_bad_island():
  assert guards.step_problem(3, [1.0, 2.0], [0.5, 0.5]) is None
  error = guards.step_problem(7, [1.0, np.nan, np.inf], [0.5, 0.5, 0.5])
  assert str(error).startswith("step 7: island 1 (and 1 more) has loss nan")
  assert guards.eval_problem(4, float("inf")).step == 4


# 2. Verified checkpoints.


def test_digests_ignore_placement_and_catch_every_single_bit_flip():
  mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
  values = jax.random.normal(jax.random.key(0), (8, 6))
  tree = {"a": values, "b": values.astype(jnp.bfloat16),
          "n": jnp.arange(5, dtype=jnp.int32), "s": jnp.float32(2.0)}
  digests = integrity.inspect_state(tree)[0]
  sharded = dict(tree, a=jax.device_put(values, NamedSharding(mesh, P("x"))))
  assert integrity.inspect_state(sharded)[0] == digests
  bits = np.asarray(values).view(np.uint32).copy()
  for index, bit in [(0, 0), (17, 31), (47, 13)]:
    flipped = bits.copy().reshape(-1)
    flipped[index] ^= np.uint32(1 << bit)
    changed = dict(tree, a=jnp.asarray(flipped.view(np.float32).reshape(8, 6)))
    assert integrity.digest_mismatch(
        digests, integrity.inspect_state(changed)[0]) == (
            "['a'] does not match its checksum")
  # Swapping two values changes the digest too (weights depend on position).
  swapped = np.asarray(values).copy().reshape(-1)
  swapped[[0, 1]] = swapped[[1, 0]]
  assert integrity.inspect_state(dict(
      tree, a=jnp.asarray(swapped.reshape(8, 6))))[0]["['a']"] != (
          digests["['a']"])


def _flip_bytes_in_data_files(step_dir):
  """Flips 64 bytes in the middle of the largest array data file of orbax's
  OCDBT store, its size unchanged. The store compresses its chunks, so what
  breaks depends on where the bytes land: a chunk that no longer decodes, an
  index entry, or values that decode wrong (caught by the checksums)."""
  data = os.path.join(step_dir, "state", "ocdbt.process_0", "d")
  path = max((os.path.join(data, name) for name in os.listdir(data)),
             key=os.path.getsize)
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    chunk = f.read(64)
    f.seek(os.path.getsize(path) // 2)
    f.write(bytes(b ^ 0xFF for b in chunk))


def _rewrite_state_with_one_value_changed(step_dir):
  """Writes the step's arrays again, valid files that decode cleanly, with
  one float changed: corruption only the saved checksums can notice."""
  state_dir = os.path.join(step_dir, "state")
  checkpointer = ocp.PyTreeCheckpointer()
  metadata = checkpointer.metadata(state_dir).item_metadata
  state = checkpointer.restore(state_dir, restore_args=jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata))
  leaves, treedef = jax.tree.flatten(state)
  largest = max(range(len(leaves)), key=lambda i: leaves[i].size)
  changed = leaves[largest].copy()
  changed.reshape(-1)[changed.size // 2] += 1.0
  leaves[largest] = changed
  shutil.rmtree(state_dir)
  checkpointer.save(state_dir, jax.tree.unflatten(treedef, leaves))


def _resume_expecting_one_unreadable(config, workdir, caplog):
  """Resumes a finished run whose step-12 checkpoint was damaged; returns
  the one warning that set it aside."""
  os.remove(os.path.join(workdir, "summary.json"))
  caplog.clear()
  with caplog.at_level("WARNING"):
    train.train_and_evaluate(config, workdir)
  warnings = [r.getMessage() for r in caplog.records
              if "unreadable" in r.getMessage()]
  assert len(warnings) == 1 and "step 12" in warnings[0], warnings
  return warnings[0]


@pytest.mark.slow
def test_a_damaged_checkpoint_is_set_aside_and_the_previous_used(
    tmp_path, caplog):
  workdir = str(tmp_path / "damaged")
  config = test_checkpoint._config  # pylint: disable=protected-access
  whole = str(tmp_path / "whole")
  train.train_and_evaluate(config(), whole)
  train.train_and_evaluate(config(), workdir)
  step_dir = os.path.join(workdir, "checkpoints", "12")

  # Bytes flipped on disk: whatever error they cause, the step is set aside.
  _flip_bytes_in_data_files(step_dir)
  _resume_expecting_one_unreadable(config(), workdir, caplog)
  test_checkpoint._assert_identical_runs(whole, workdir)  # pylint: disable=protected-access

  # Files that decode cleanly to a wrong value: only the checksums notice.
  _rewrite_state_with_one_value_changed(step_dir)
  warning = _resume_expecting_one_unreadable(config(), workdir, caplog)
  assert "does not match its checksum" in warning, warning
  assert sorted(name.split(".")[0] for name in os.listdir(
      os.path.join(workdir, "checkpoints.unreadable"))) == ["12", "12"]
  test_checkpoint._assert_identical_runs(whole, workdir)  # pylint: disable=protected-access


def test_a_meta_record_edited_on_disk_is_refused(tmp_path):
  checkpointer = checkpointing.Checkpointer(str(tmp_path), async_save=False)
  checkpointer.save(1, {"w": jnp.ones(3)}, {"tokens_seen": 100})
  checkpointer.wait()
  meta_file = os.path.join(str(tmp_path), "checkpoints", "1", "meta",
                           "metadata")
  text = open(meta_file).read()
  assert '"tokens_seen": 100' in text
  with open(meta_file, "w") as f:
    f.write(text.replace('"tokens_seen": 100', '"tokens_seen": 900'))
  with pytest.raises(checkpointing.CorruptCheckpointError):
    checkpointer.read_meta(1)
  checkpointer.close()


# 3. One run per workdir.


def _main(workdir, *flags, **popen):
  return subprocess.Popen(
      [sys.executable, "-m", "diloco_jax.main", "--config=configs/tiny.py",
       f"--workdir={workdir}", *flags], cwd=REPO, env=ENV, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def _metric_lines(workdir):
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      return sum(1 for _ in f)
  except FileNotFoundError:
    return 0


def test_a_second_run_into_a_running_workdir_stops_naming_the_holder(
    tmp_path):
  workdir = str(tmp_path / "shared")
  first = _main(workdir, "--config.total_steps=400")
  lock = os.path.join(workdir, workdir_lib.LOCK_FILE)
  helpers.wait_for(
      lambda: os.path.exists(lock) and open(lock).read().strip(), first)
  started = time.time()
  second = _main(workdir, "--config.total_steps=400")
  _, err = second.communicate(timeout=120)
  assert second.returncode == 1
  assert err.strip().splitlines()[-1] == (
      f"error: --workdir={workdir} is in use by another run (pid "
      f"{first.pid}); wait for it to end or choose another workdir")
  assert time.time() - started < 60  # it stopped before compiling
  first.send_signal(signal.SIGKILL)
  first.wait()
  # The kernel released the dead run's lock: the workdir is usable at once.
  workdir_lib.claim(workdir).release()


def test_the_lock_is_exclusive_within_a_process_too(tmp_path):
  held = workdir_lib.claim(str(tmp_path))
  with pytest.raises(workdir_lib.WorkdirError,
                     match=rf"in use by another run \(pid {os.getpid()}\)"):
    workdir_lib.claim(str(tmp_path))
  held.release()
  workdir_lib.claim(str(tmp_path)).release()


@pytest.mark.parametrize("workdir, message", [
    ("", r"--workdir='': give a directory"),
    ("   ", r"give a directory"),
    ("{file}/sub", r"cannot create it: Not a directory"),
    ("{file}", r"is a file, not a directory"),
    # A URL would otherwise become a local directory named 'gs:'.
    ("gs://bucket/runs/x", r"^--workdir=gs://bucket/runs/x is a URL, .*"
     r"mount the bucket"),
    ("s3://bucket/x", r"is a URL"),
])
def test_unusable_workdirs_are_refused_before_anything_is_written(
    tmp_path, monkeypatch, workdir, message):
  monkeypatch.chdir(tmp_path)
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  with pytest.raises(workdir_lib.WorkdirError, match=message) as error:
    train.train_and_evaluate(_config(),
                             workdir.format(file=str(a_file)))
  assert "\n" not in str(error.value)
  assert sorted(os.listdir(tmp_path)) == ["a_file"]
  # The claim refuses it too, for callers that claim a workdir themselves.
  if "://" in workdir:
    with pytest.raises(workdir_lib.WorkdirError, match=message):
      workdir_lib.claim(workdir)
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


def test_a_url_workdir_is_one_line_from_the_command_line(tmp_path):
  """BUILD.md's multi-host commands once gave gs://... workdirs; main
  refuses one in a line, creating nothing where it runs."""
  process = subprocess.run(
      [sys.executable, "-m", "diloco_jax.main",
       f"--config={REPO}/configs/tiny.py", "--workdir=gs://bucket/runs/x"],
      cwd=tmp_path, env=ENV, text=True, capture_output=True, timeout=120)
  assert process.returncode == 1
  assert process.stderr.strip().splitlines()[-1].startswith(
      "error: --workdir=gs://bucket/runs/x is a URL"), process.stderr[-2000:]
  assert "Traceback" not in process.stderr
  assert os.listdir(tmp_path) == []


# 4. Graceful stops.


@pytest.fixture(scope="module")
def uninterrupted_40(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("whole40"))
  train.train_and_evaluate(_config(**{"total_steps": 40}), workdir)
  return workdir


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_finishes_the_step_saves_and_exits_nonzero(
    uninterrupted_40, tmp_path, signum):
  workdir = str(tmp_path / "stopped")
  process = _main(workdir, "--config.total_steps=40")
  helpers.wait_for(lambda: _metric_lines(workdir) >= 6, process)
  process.send_signal(signum)
  _, err = process.communicate(timeout=120)
  name = signal.Signals(signum).name
  assert process.returncode == 128 + signum, err[-2000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith(f"stopped by {name}: saved a checkpoint at step ")
  step = int(last.split("at step ")[1].split(";")[0])
  assert 6 <= step < 40
  assert max(_checkpoint_steps(workdir)) == step  # mid-round: not a round end
  assert [r["step"] for r in _strict_metrics(workdir)] == list(
      range(1, step + 1))
  resumed = _main(workdir, "--config.total_steps=40")
  _, err = resumed.communicate(timeout=300)
  assert resumed.returncode == 0, err[-2000:]
  test_checkpoint._assert_identical_runs(uninterrupted_40, workdir)  # pylint: disable=protected-access


@pytest.mark.slow
def test_a_data_error_mid_run_waits_for_the_save_and_prints_last(tmp_path):
  data = tmp_path / "c4"
  data.mkdir()
  line = lambda i: json.dumps({"text": f"document {i} " + "abc " * (i % 7)})
  for shard in range(2):
    lines = [line(i) for i in range(400)]
    if shard == 1:
      lines[150] = '{"text": "a broken line'
    with gzip.open(data / f"c4-train.{shard:05d}-of-00002.json.gz", "wt") as f:
      f.write("\n".join(lines) + "\n")
  with gzip.open(data / "c4-validation.00000-of-00001.json.gz", "wt") as f:
    f.write("\n".join(line(i) for i in range(100)) + "\n")
  workdir = str(tmp_path / "run")
  process = _main(workdir, "--config.total_steps=400",
                  "--config.data.corpus=c4", f"--config.data.path={data}",
                  "--config.model.vocab_size=257")
  _, err = process.communicate(timeout=300)
  assert process.returncode == 1
  bad = data / "c4-train.00001-of-00002.json.gz"
  assert err.strip().splitlines()[-1].startswith(f"error: {bad}:151: ")
  assert "Event loop is closed" not in err and "Traceback" not in err
  steps = _checkpoint_steps(workdir)
  assert steps and all(name.isdigit() for name in os.listdir(
      os.path.join(workdir, "checkpoints")))  # finalized, none half-written
  _assert_checkpoints_finite(workdir)


# 5. Resume compares the config.


@pytest.fixture(scope="module")
def finished_8(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("finished8"))
  train.train_and_evaluate(_config(), workdir)
  return workdir


def test_resume_refuses_changes_of_meaning_naming_both_values(finished_8):
  before = sorted(os.listdir(os.path.join(finished_8, "checkpoints")))
  with pytest.raises(resume.ConfigChangedError) as error:
    train.train_and_evaluate(_config(**{"total_steps": 16,
                                        "diloco.codec": "int8"}), finished_8)
  message = str(error.value)
  assert "diloco.codec 'fp32' -> 'int8'" in message
  assert "total_steps 8 -> 16" in message
  assert message.endswith(
      "--config.resume.allow_changes=diloco.codec,total_steps")
  assert sorted(os.listdir(os.path.join(finished_8, "checkpoints"))) == before


@pytest.mark.slow
def test_allowed_changes_continue_and_are_recorded(finished_8, tmp_path):
  workdir = str(tmp_path / "extended")
  test_checkpoint.shutil.copytree(finished_8, workdir)
  summary = train.train_and_evaluate(
      _config(**{"total_steps": 16, "diloco.codec": "int8",
                 "resume.allow_changes": "total_steps,diloco"}), workdir)
  assert summary["resumed_from_step"] == 8 and summary["total_steps"] == 16
  assert {(c["field"], c["checkpoint"], c["now"], c["step"])
          for c in summary["config_changes"]} == {
              ("total_steps", 8, 16, 8), ("diloco.codec", "fp32", "int8", 8)}


@pytest.mark.slow
@pytest.mark.parametrize("saved_mode, mode", [("single", "diloco"),
                                              ("ddp", "diloco")])
def test_a_checkpoint_of_another_mode_is_never_resumed_in_place(
    tmp_path, saved_mode, mode):
  workdir = str(tmp_path / saved_mode)
  train.train_and_evaluate(_config(mode=saved_mode, total_steps=4), workdir)
  os.remove(os.path.join(workdir, "summary.json"))
  with pytest.raises(resume.ConfigChangedError,
                     match=rf"written by a '{saved_mode}' run; a checkpoint "
                     rf"of another mode cannot be resumed as config.mode="
                     rf"'{mode}' in place.*--config.init_from=(\S+)$") as error:
    train.train_and_evaluate(_config(mode=mode, total_steps=4), workdir)
  # What the message suggests works: a new run from that checkpoint's model.
  suggested = error.value.args[0].rsplit("--config.init_from=", 1)[1]
  summary = train.train_and_evaluate(
      _config(mode=mode, total_steps=6, init_from=suggested),
      str(tmp_path / "from_it"))
  assert summary["initialized_from"]["step"] == 4
  with pytest.raises(validation.ConfigError, match=r"cannot allow 'mode'"):
    train.train_and_evaluate(_config(**{"mode": mode, "total_steps": 4,
                                        "resume.allow_changes": "mode"}),
                             workdir)


def test_placement_and_bookkeeping_fields_may_change_freely():
  saved = {"mesh": {"data": 1}, "checkpoint": {"every_steps": 0},
           "diloco": {"islands": 2, "codec": "fp32"}, "seed": 0,
           "data": {"microbatches": 1, "path": "a"}}
  now = {"mesh": {"data": 2}, "checkpoint": {"every_steps": 5},
         "diloco": {"islands": 4, "codec": "fp32"}, "seed": 1,
         "data": {"microbatches": 2, "path": "b"}, "new_field": 3}
  changed = config_changes.changes(saved, now)
  assert [c["field"] for c in changed] == ["data.path", "seed"]
  assert config_changes.refused(changed, "data") == [changed[1]]


def test_allow_changes_must_name_config_fields():
  with pytest.raises(validation.ConfigError,
                     match=r"allow_changes names 'totl_steps'"):
    validation.validate_config(
        _config(**{"resume.allow_changes": "totl_steps"}), num_devices=8)
  with pytest.raises(validation.ConfigError, match=r"config.nonfinite="):
    validation.validate_config(_config(nonfinite="skip"), num_devices=8)


# 6. Data errors through the command line.


def test_a_data_error_at_startup_is_one_line_before_compile(tmp_path):
  model = tmp_path / "empty.model"
  model.write_bytes(b"")
  process = _main(str(tmp_path / "w"), "--config.data.corpus=embedded",
                  "--config.data.tokenizer=sentencepiece",
                  f"--config.data.tokenizer_path={model}")
  _, err = process.communicate(timeout=120)
  assert process.returncode == 1
  assert err.strip().splitlines()[-1].startswith("error: config.data.")
  assert "is empty" in err.strip().splitlines()[-1]
  assert not os.path.exists(tmp_path / "w" / "checkpoints")
  assert issubclass(data_errors.DataError, ValueError)
