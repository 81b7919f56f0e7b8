"""What a newcomer meets at `python -m diloco_jax.main`'s command line (and
`python -m diloco_jax.elastic`'s): a config argument the file does not
take is one line naming the values it takes; an error or a stop after the
run started is printed once, not also as a log line; rerunning a finished
run says its result again.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests import helpers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO}


def _main(*flags, entry="diloco_jax.main"):
  return subprocess.Popen(
      [sys.executable, "-m", entry, *flags], cwd=REPO, env=ENV,
      text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(process, timeout=300):
  try:
    return process.communicate(timeout=timeout)
  finally:
    if process.poll() is None:
      process.kill()
      process.communicate()


# A config file's argument: one line naming what it takes.


@pytest.mark.parametrize("config, line", [
    ("configs/c4_small.py:small",
     "error: --config=configs/c4_small.py:small: configs/c4_small.py takes "
     "gpu, colab, quick, not 'small'"),
    ("configs/scaling.py:huge",
     "error: --config=configs/scaling.py:huge: configs/scaling.py takes "
     "small, large, gpu or quick, not 'huge'"),
    ("configs/default.py:quick",
     "error: --config=configs/default.py:quick: configs/default.py takes "
     "no ':ARGUMENT'; use --config=configs/default.py"),
])
def test_a_config_argument_it_does_not_take_is_one_line(tmp_path, config,
                                                        line):
  workdir = tmp_path / "run"
  out, err = _finish(_main(f"--config={config}", f"--workdir={workdir}"))
  assert (out, err.strip()) == ("", line), err[-3000:]
  assert not workdir.exists()


def test_the_elastic_command_says_a_bad_config_argument_in_one_line(
    tmp_path):
  workdir = tmp_path / "run"
  out, err = _finish(_main("--config=configs/composition.py:fp32,none,huge",
                           f"--workdir={workdir}",
                           entry="diloco_jax.elastic"))
  assert (out, err.strip()) == ("", (
      "error: --config=configs/composition.py:fp32,none,huge: 'huge' is not "
      "a layout: takes plain, fsdp, stages, outer_device, fsdp+stages, "
      "outer_device+stages")), err[-3000:]
  assert not workdir.exists()


# An error, or a stop, after the run started: its line once.


@pytest.mark.slow
def test_an_error_after_the_start_is_printed_once(tmp_path):
  workdir = tmp_path / "run"
  process = _main("--config=configs/tiny.py", f"--workdir={workdir}",
                  "--config.inner_optimizer.learning_rate=1e12")
  _, err = _finish(process)
  assert process.returncode == 1, err[-3000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith("error: step "), err[-3000:]
  message = last[len("error: "):]
  # The run had started (its progress lines are printed), and the error
  # is not also a log line before its `error:` line.
  assert "first inner step done" in err
  assert err.count(message) == 1, err[-3000:]


@pytest.mark.slow
def test_a_stop_after_the_start_is_printed_once(tmp_path):
  workdir = tmp_path / "run"
  process = _main("--config=configs/tiny.py", f"--workdir={workdir}",
                  "--config.total_steps=100000")
  metrics = workdir / "metrics.jsonl"
  try:
    helpers.wait_for(lambda: metrics.exists()
                     and len(metrics.read_text().splitlines()) >= 2, process)
    process.send_signal(signal.SIGTERM)
  finally:
    _, err = _finish(process)
  assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith("stopped by SIGTERM: saved a checkpoint at step ")
  assert err.count("stopped by SIGTERM") == 1, err[-3000:]


# Rerunning a finished run: its result again (docs/running.md says so).


@pytest.mark.slow
def test_rerunning_a_finished_run_says_its_result(tmp_path):
  workdir = tmp_path / "run"
  flags = ("--config=configs/tiny.py", f"--workdir={workdir}")
  first = _main(*flags)
  _, err = _finish(first)
  assert first.returncode == 0, err[-3000:]
  summary_path = workdir / "summary.json"
  summary = json.loads(summary_path.read_text())
  before = summary_path.read_bytes()
  again = _main(*flags)
  out, err = _finish(again)
  assert again.returncode == 0, err[-3000:]
  assert out == ""
  lines = err.strip().splitlines()
  assert "already finished" in lines[-2]
  assert lines[-1].endswith(
      f"] done already: final eval loss {summary['final_eval_loss']:.4f}, "
      f"{summary['tokens_per_s']:.0f} tokens/s, "
      f"{summary['comm_bytes'] / 1e6:.1f} MB sent; the summary is in "
      f"{summary_path}"), err[-3000:]
  assert summary_path.read_bytes() == before  # nothing changed
  with open(os.path.join(REPO, "docs", "running.md")) as f:
    running = " ".join(f.read().split())
  assert "Rerunning a finished run prints its result again" in running
