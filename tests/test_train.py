"""End-to-end runs on the tiny config, and bad configs failing cleanly."""

import collections
import json
import os
import subprocess
import sys

import pytest

from configs import tiny
from diloco_jax.algorithm import participation
from diloco_jax.config import validation
from diloco_jax.data import settings as data_settings
from diloco_jax.run import train
from tests import helpers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_KEYS = {"step", "round", "train_loss", "tokens_seen", "elapsed_s", "comm_bytes",
             "ddp_comm_bytes"}
SUMMARY_KEYS = {"final_eval_loss", "comm_bytes", "ddp_comm_bytes", "wall_s",
                "tokens_per_s", "mode", "islands", "inner_steps"}


def _read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _read_summary(workdir):
  with open(os.path.join(workdir, "summary.json")) as f:
    return json.load(f)


@pytest.mark.parametrize("mode,islands", [("diloco", 2), ("diloco", 1),
                                          ("ddp", 2), ("single", 2)])
def test_each_mode_trains_and_writes_outputs(mode, islands, tmp_path):
  config = tiny.get_config()
  config.mode = mode
  config.diloco.islands = islands
  # tiny's 4e-4 moves the loss by ~0.01 in its 8 steps; 1e-2 learns.
  config.inner_optimizer.learning_rate = 1e-2
  workdir = str(tmp_path / mode)
  summary = train.train_and_evaluate(config, workdir)

  records = _read_metrics(workdir)
  assert [r["step"] for r in records] == list(range(1, config.total_steps + 1))
  for r in records:
    assert STEP_KEYS <= set(r)
  evals = [r for r in records if "eval_loss" in r]
  h = config.diloco.inner_steps
  assert [r["step"] for r in evals] == list(range(h, config.total_steps + 1, h))
  # It learns: the second eval 0.06-0.09 below the first, and 0.17-0.22
  # below the untrained model's loss (its first step's), measured.
  assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.03
  assert evals[-1]["eval_loss"] < records[0]["train_loss"] - 0.1
  # The islands' plain average is scored only when asked for.
  assert not any("eval_loss_island_mean" in r for r in evals)

  on_disk = _read_summary(workdir)
  assert SUMMARY_KEYS <= set(on_disk)
  assert on_disk == summary  # JSON round-trips floats exactly
  assert on_disk["mode"] == mode
  islands = 1 if mode == "single" else islands
  assert on_disk["islands"] == islands
  assert on_disk["tokens_seen"] == (config.total_steps * islands
                                    * config.data.batch_size
                                    * config.data.sequence_length)
  assert os.listdir(os.path.join(workdir, "tensorboard"))

  # Byte accounting: DiLoCo sends once per round, DDP every step.
  rounds = config.total_steps // h
  if mode == "diloco":
    assert on_disk["comm_bytes"] * h == on_disk["ddp_comm_bytes"]
    assert on_disk["rounds"] == rounds
    assert (on_disk["comm_bytes"] > 0) == (islands > 1)  # k=1 sends nothing
  elif mode == "ddp":
    assert on_disk["comm_bytes"] == on_disk["ddp_comm_bytes"] > 0
  else:
    assert on_disk["comm_bytes"] == 0


@pytest.mark.slow
def test_diloco_learns_the_synthetic_chain(tmp_path):
  """A longer tiny run gets well below the unigram loss toward the entropy rate."""
  config = tiny.get_config()
  config.total_steps = 48
  config.inner_optimizer.learning_rate = 3e-3
  summary = train.train_and_evaluate(config, str(tmp_path))
  uniform = __import__("math").log(config.model.vocab_size)
  assert summary["final_eval_loss"] < uniform - 0.5
  assert summary["final_eval_loss"] > summary["corpus_entropy_rate"] - 0.05


def _run_main(args, **kwargs):
  return subprocess.run(
      [sys.executable, "-m", "diloco_jax.main", *args],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env={**os.environ, "PYTHONPATH": REPO}, **kwargs)


@pytest.mark.slow
def test_main_cli_runs_tiny_config(tmp_path):
  workdir = str(tmp_path / "run")
  result = _run_main(["--config=configs/tiny.py", f"--workdir={workdir}",
                      "--config.diloco.inner_steps=2"])
  assert result.returncode == 0, result.stderr[-3000:]
  summary = _read_summary(workdir)
  assert summary["inner_steps"] == 2 and summary["rounds"] == 4
  assert "step 8/8" in result.stderr  # the progress line


def test_main_refuses_a_finished_workdir(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "summary.json").write_text("{}")
  result = _run_main(["--config=configs/tiny.py", f"--workdir={workdir}"])
  assert result.returncode != 0
  assert "holds summary.json but no checkpoints" in result.stderr
  assert (workdir / "summary.json").read_text() == "{}"


BAD_CONFIGS = [
    ({"data.batch_size": 3, "mesh.data": 2}, "config.data.batch_size=3"),
    ({"diloco.inner_steps": 0}, "config.diloco.inner_steps=0"),
    ({"diloco.islands": 4, "mesh.data": 16}, "16 devices per island"),
    ({"data.microbatches": 3}, "config.data.microbatches x config.mesh.data"),
    ({"data.microbatches": 0}, "config.data.microbatches=0"),
    ({"model.attention": "flash"}, "config.model.attention='flash'"),
    ({"model.attention": "cudnn"}, "config.model.attention='cudnn' needs"),
    ({"diloco.outer_optimizer.name": "lamb"},
     "config.diloco.outer_optimizer.name='lamb'"),
    ({"inner_optimizer.name": "sgd"}, "config.inner_optimizer.name='sgd'"),
    ({"mode": "async"}, "config.mode='async'"),
    ({"data.corpus": "text_files", "data.path": ""},
     "config.data.path is required"),
    ({"data.corpus": "text_files", "data.path": "/nonexistent/*.txt"},
     "config.data.path"),
    ({"data.corpus": "c4", "data.path": ""}, "config.data.path is required"),
    ({"model.vocab_size": 8}, "config.model.vocab_size=8"),
    ({"diloco.codec": "int3"}, "config.diloco.codec='int3'"),
    ({"diloco.codec_block_size": 7}, "config.diloco.codec_block_size=7"),
    ({"diloco.codec": "topk", "diloco.topk_fraction": 1.5},
     "config.diloco.topk_fraction=1.5"),
    ({"diloco.prune_rate": 0.0}, "config.diloco.prune_rate=0.0"),
    ({"diloco.fallback_codec": "topk"}, "config.diloco.fallback_codec='topk'"),
    ({"diloco.lowrank.factor_codec": "int2"},
     "config.diloco.lowrank.factor_codec='int2'"),
    ({"diloco.lowrank.min_rank": 32, "diloco.lowrank.max_rank": 8},
     "config.diloco.lowrank.min_rank=32"),
    ({"diloco.lowrank.rank": 0}, "config.diloco.lowrank.rank=0"),
    ({"eval.every_rounds": -1}, "config.eval.every_rounds=-1"),
]


def test_eval_every_rounds_evaluates_those_rounds_and_the_last_step(tmp_path):
  config = tiny.get_config()
  config.total_steps, config.diloco.inner_steps = 10, 2
  config.eval.every_rounds = 2
  train.train_and_evaluate(config, str(tmp_path / "run"))
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records if "eval_loss" in r] == [4, 8, 10]


def _override(config, dotted, value):
  *parents, leaf = dotted.split(".")
  node = config
  for p in parents:
    node = node[p]
  node[leaf] = value


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS)
def test_bad_config_raises_one_clear_error(overrides, message, tmp_path):
  config = tiny.get_config()
  for dotted, value in overrides.items():
    _override(config, dotted, value)
  workdir = tmp_path / "run"
  with pytest.raises(validation.ConfigError) as error:
    train.train_and_evaluate(config, str(workdir))
  assert message in str(error.value)
  assert "\n" not in str(error.value)
  assert not workdir.exists()  # nothing written before validation passed


def test_main_reports_bad_config_in_one_line_before_compiling(tmp_path):
  workdir = tmp_path / "run"
  result = _run_main(["--config=configs/tiny.py", f"--workdir={workdir}",
                      "--config.diloco.inner_steps=0"])
  assert result.returncode == 1
  error_lines = [l for l in result.stderr.splitlines() if l.startswith("error:")]
  assert error_lines == [
      "error: config.diloco.inner_steps=0 must be an integer >= 1"]
  assert "compiled" not in result.stderr
  assert not workdir.exists()


@pytest.mark.slow
def test_island_mean_eval_equals_global_eval_under_parameter_averaging(
    tmp_path):
  """With outer SGD lr 1, x after the outer step is the islands' average."""
  config = tiny.get_config()
  config.diloco.outer_optimizer.name = "sgd"
  config.diloco.outer_optimizer.learning_rate = 1.0
  config.eval.island_mean = True
  train.train_and_evaluate(config, str(tmp_path))
  evals = [r for r in _read_metrics(str(tmp_path)) if "eval_loss" in r]
  assert evals
  for r in evals:
    assert r["eval_loss_island_mean"] == pytest.approx(r["eval_loss"],
                                                       abs=1e-5)


def test_a_run_checks_its_config_once_and_the_loop_parses_nothing(
    tmp_path, monkeypatch):
  """Validation runs once per run and hands typed values down: config.data
  is checked once (it used to be checked from three places), and the
  island schedule is parsed by the config layer only (it used to be parsed
  again at every step)."""
  calls = collections.Counter()

  def count(module, name):
    real = getattr(module, name)

    def counted(*args, **kwargs):
      calls[name] += 1
      return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)

  count(validation, "validate_config")
  count(data_settings, "from_config")
  count(participation, "parse_schedule")
  config = tiny.get_config()
  config.diloco.island_schedule = "1->2"
  summary = train.train_and_evaluate(config, str(tmp_path / "run"))
  assert summary["rounds"] == config.total_steps // config.diloco.inner_steps
  # parse_schedule: validation checks the string, RunConfig keeps its parse.
  assert calls == {"validate_config": 1, "from_config": 1,
                   "parse_schedule": 2}


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    {}, {"diloco.outer_placement": "host"}], ids=["device", "host"])
def test_the_round_ends_compile_nothing_once_training_started(overrides,
                                                              tmp_path):
  """Every program the syncs, evals and checks run is compiled at start-up
  (compiled/programs.py), so no round end waits for XLA. The one exception is
  orbax's own: at the first save it slices each array replicated over the
  islands' devices among them, an eager jit(slice) per shape and device."""
  import logging  # pylint: disable=g-import-not-at-top
  import re  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top

  messages = []

  class Recorder(logging.Handler):

    def emit(self, record):
      messages.append(record.getMessage())

  recorder = Recorder()
  absl_logger = logging.getLogger("absl")
  level = absl_logger.level
  absl_logger.setLevel(logging.INFO)  # the loop's "first inner step done"
  logging.getLogger().addHandler(recorder)
  jax.config.update("jax_log_compiles", True)
  try:
    config = helpers.with_overrides(tiny.get_config(), overrides)
    config.total_steps = 3 * config.diloco.inner_steps
    train.train_and_evaluate(config, str(tmp_path / "run"))
  finally:
    jax.config.update("jax_log_compiles", False)
    logging.getLogger().removeHandler(recorder)
    absl_logger.setLevel(level)
  started = next(i for i, message in enumerate(messages)
                 if message.startswith("first inner step done"))
  compiled = {re.match(r"Compiling (\S+)", message).group(1)
              for message in messages[started:]
              if message.startswith("Compiling ")}
  assert compiled <= {"jit(slice)"}, compiled
