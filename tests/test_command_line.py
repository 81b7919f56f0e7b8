"""What the shipped configs do with the flags a user adds to them.

Configs are parsed as main.py parses them (ml_collections' config-file
flag, the shipped file, the flags verbatim) and checked as a run checks
them; two runs go through `python -m diloco_jax.main` itself:

- a config file's outer optimizer is its choice for its own overlap:
  `--config.diloco.overlap=eager` on configs/default.py and
  configs/slow_link.py runs eager's measured outer step, unless flags set
  the outer optimizer too, and a resumed run keeps the step it started
  with;
- `--config.diloco.outer_optimizer.name=sparseloco` with
  `--config.diloco.sparseloco.alpha` alone works on every shipped config;
- pipelined islands' default microbatch count fits the batch, and where
  no count can, the refusal names the flag to set.
"""

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from configs import tiny
from diloco_jax.algorithm import overlap as overlap_lib
from diloco_jax.config import command_line as command_line_lib
from diloco_jax.config import overlap_defaults
from diloco_jax.config import run_config as run_config_lib
from diloco_jax.config import validation

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_DEVICES = 8  # conftest forces 8 CPU devices
EAGER = ("nesterov", *overlap_defaults.NESTEROV_DEFAULTS["eager"])
# configs/slow_link.py's docstring: its whole-round overlap, verbatim.
SLOW_LINK_EAGER = ("--config.diloco.fragments=1",
                   "--config.diloco.fragment_delay=0",
                   "--config.diloco.fragment_alpha=0",
                   "--config.diloco.overlap=eager")


def _parse(config_file, *argv):
  """(config, CommandLine) as main.py's --config flag gives them for
  `--config=config_file *argv`."""
  argv = ["main", f"--config={config_file}", *argv]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values,
                                  lock_config=True, sys_argv=argv)
  flag_values(argv)
  return (flag_values["config"].value,
          command_line_lib.from_flag(flag_values["config"]))


def _check(config_file, *argv):
  """The RunConfig a run of `config_file` with flags `argv` validates."""
  config, command_line = _parse(config_file, *argv)
  return validation.validate_config(config, NUM_DEVICES,
                                    command_line=command_line)


def _outer(run_config):
  outer = run_config.config.diloco.outer_optimizer
  return outer.name, outer.learning_rate, outer.momentum


# A config file's outer step is its choice for its own overlap.


@pytest.mark.parametrize("config_file,argv", [
    ("configs/default.py", ("--config.diloco.overlap=eager",)),
    ("configs/slow_link.py", SLOW_LINK_EAGER),
])
def test_eager_from_the_command_line_runs_eager_s_outer_step(
    config_file, argv):
  run_config = _check(config_file, *argv)
  assert _outer(run_config) == EAGER
  # The log line says which step and why, naming what was set aside.
  assert run_config.outer_step.startswith(
      f"outer step: nesterov lr {EAGER[1]:g} momentum {EAGER[2]:g}, the "
      "measured default for overlap='eager'")
  assert (f"{config_file} chose sgd lr 1 for overlap='none'"
          in run_config.outer_step)


@pytest.mark.parametrize("config_file", ["configs/default.py",
                                         "configs/scaling.py:small"])
@pytest.mark.parametrize("overlap", [o for o in overlap_lib.OVERLAPS
                                     if o != "none"])
def test_every_overlap_from_the_command_line_takes_its_measured_step(
    config_file, overlap):
  run_config = _check(config_file, f"--config.diloco.overlap={overlap}")
  assert _outer(run_config) == (
      "nesterov", *overlap_defaults.NESTEROV_DEFAULTS[overlap])


@pytest.mark.parametrize("argv,outer", [
    # The file's own overlap, named on the command line: the file's step.
    (("--config.diloco.overlap=none",), ("sgd", 1.0, None)),
    # Flags for the outer optimizer are the user's choice, over the file's.
    (("--config.diloco.overlap=eager",
      "--config.diloco.outer_optimizer.name=sgd"), ("sgd", 1.0, None)),
    (("--config.diloco.overlap=eager",
      "--config.diloco.outer_optimizer.learning_rate=0.3"),
     ("sgd", 0.3, None)),
    # The file's lr was its sgd's: Nesterov takes eager's lr, the flag's
    # momentum.
    (("--config.diloco.overlap=eager",
      "--config.diloco.outer_optimizer.name=nesterov",
      "--config.diloco.outer_optimizer.momentum=0.5"),
     ("nesterov", EAGER[1], 0.5)),
    (("--config.diloco.outer_optimizer.name=nesterov",),
     ("nesterov", *overlap_defaults.NESTEROV_DEFAULTS["none"])),
])
def test_flags_for_the_outer_optimizer_are_kept(argv, outer):
  name, learning_rate, momentum = _outer(_check("configs/default.py", *argv))
  assert (name, learning_rate) == outer[:2]
  if outer[2] is not None:  # sgd has no momentum to compare
    assert momentum == outer[2]


def test_a_config_built_in_python_keeps_its_outer_step():
  """The studies build configs in Python: every field is their author's
  (no command line, nothing set aside; their runs and hashes stay)."""
  config, _ = _parse("configs/default.py")
  config.diloco.overlap = "eager"
  run_config = validation.validate_config(config, NUM_DEVICES)
  assert _outer(run_config)[:2] == ("sgd", 1.0)
  assert run_config.outer_step == "outer step: sgd lr 1, as the config sets it"


# SparseLoCo with its alpha alone, on every shipped config.


def _shipped_configs():
  paths = sorted(glob.glob(os.path.join(REPO, "configs", "*.py")))
  found = []
  for path in paths:
    spec = importlib.util.spec_from_file_location("shipped", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "get_config"):
      found.append(os.path.relpath(path, REPO))
  return found


@pytest.mark.parametrize("config_file", _shipped_configs())
def test_sparseloco_takes_alpha_alone_on_every_shipped_config(config_file):
  config, command_line = _parse(
      config_file, "--config.diloco.outer_optimizer.name=sparseloco",
      "--config.diloco.sparseloco.alpha=0.5")
  try:
    run_config = validation.validate_config(config, NUM_DEVICES,
                                            command_line=command_line)
  except validation.ConfigError as e:
    # The C4 configs need their data; nothing else may be refused.
    refused = [line.strip() for line in str(e).splitlines()
               if line.startswith(("  ", "config."))]
    assert refused and all(line.startswith("config.data.")
                           for line in refused), str(e)
    return
  diloco = run_config.config.diloco
  assert (diloco.outer_optimizer.learning_rate,
          diloco.outer_optimizer.momentum, diloco.codec) == (0.5, 0.0, "fp32")
  assert run_config.outer_step.startswith("outer step: sparseloco alpha 0.5")


def test_sparseloco_refuses_a_learning_rate_set_on_the_command_line():
  with pytest.raises(validation.ConfigError,
                     match="learning_rate=0.7 is not used by SparseLoCo"):
    _check("configs/default.py",
           "--config.diloco.outer_optimizer.name=sparseloco",
           "--config.diloco.outer_optimizer.learning_rate=0.7")


# Pipelined islands' microbatches.


@pytest.mark.parametrize("stage,batch,eval_batch,microbatches", [
    (2, 4, 8, 4),  # 2 x stage divides both
    (4, 8, 8, 8),
    (4, 4, 8, 4),  # 2 x stage = 8 does not divide 4: stage does
    (2, 6, 8, 2),
    (4, 8, 4, 4),  # the eval batch decides
])
def test_the_default_microbatches_are_the_most_that_fit(
    stage, batch, eval_batch, microbatches):
  run_config = _check(
      "configs/tiny.py", f"--config.mesh.stage={stage}",
      "--config.model.num_layers=4", f"--config.data.batch_size={batch}",
      f"--config.eval.batch_size={eval_batch}")
  assert run_config_lib.pipeline_microbatches(run_config.config) == (
      microbatches)


@pytest.mark.parametrize("argv,message", [
    # No count of microbatches (a multiple of 4) divides 6: the batch.
    (("--config.data.batch_size=6",),
     "config.data.batch_size=6 gives 6 sequences per island per "
     "data.microbatches part and mesh.data device, which no count of "
     "pipeline microbatches divides"),
    (("--config.eval.batch_size=6",),
     "set --config.eval.batch_size to a multiple of 4"),
    # A count set that does not fit: the flag, with one that does.
    (("--config.pipeline.microbatches=8",),
     "set --config.pipeline.microbatches=4, or 0"),
])
def test_microbatches_that_cannot_fit_are_refused_naming_the_flag(
    argv, message):
  with pytest.raises(validation.ConfigError) as e:
    _check("configs/tiny.py", "--config.mesh.stage=4",
           "--config.model.num_layers=4", *argv)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_four_stages_of_the_one_layer_tiny_model_name_the_layers_flag():
  with pytest.raises(validation.ConfigError) as e:
    _check("configs/tiny.py", "--config.mesh.stage=4")
  assert str(e.value) == (
      "config.model.num_layers=1 does not split into config.mesh.stage x "
      "repeats = 4 x 1 chunks of consecutive layers (set "
      "--config.model.num_layers to a multiple of 4)")


# Through main.


def _main(workdir, *argv):
  return subprocess.run(
      [sys.executable, "-m", "diloco_jax.main", f"--workdir={workdir}",
       *argv], cwd=REPO, capture_output=True, text=True, timeout=600,
      env={**os.environ, "PYTHONPATH": REPO})


# What configs/tiny.py sets of the model, the data and the evaluation.
_TINY_FIELDS = (
    "model.num_layers", "model.d_model", "model.num_heads", "model.head_dim",
    "model.mlp_dim", "model.max_sequence_length", "model.vocab_size",
    "data.corpus", "data.sequence_length", "data.batch_size",
    "data.synthetic.vocab_size", "data.synthetic.num_documents",
    "data.synthetic.document_length", "data.synthetic.validation_documents",
    "eval.batch_size", "eval.num_batches")


def _tiny_sized(total_steps: int) -> list[str]:
  """Flags that shrink a shipped config to configs/tiny.py's model, data
  and evaluation, with 2 islands and rounds of 2 steps (seconds a run)."""
  config = tiny.get_config()

  def value(dotted):
    node = config
    for part in dotted.split("."):
      node = node[part]
    return node

  return [f"--config.{field}={value(field)}" for field in _TINY_FIELDS] + [
      "--config.diloco.islands=2", "--config.diloco.inner_steps=2",
      "--config.inner_optimizer.warmup_steps=2",
      f"--config.total_steps={total_steps}"]


def _saved_outer(workdir):
  with open(os.path.join(workdir, "config.json")) as f:
    outer = json.load(f)["diloco"]["outer_optimizer"]
  return outer["name"], outer["learning_rate"], outer["momentum"]


@pytest.mark.slow
def test_eager_on_the_default_config_through_main_and_its_resume(tmp_path):
  workdir = str(tmp_path / "eager")
  argv = ["--config=configs/default.py", "--config.diloco.overlap=eager"]
  first = _main(workdir, *argv, *_tiny_sized(8))
  assert first.returncode == 0, first.stderr[-3000:]
  lines = [line for line in first.stderr.splitlines() if "outer step:" in line]
  assert len(lines) == 1 and (
      f"outer step: nesterov lr {EAGER[1]:g} momentum {EAGER[2]:g}" in lines[0])
  assert _saved_outer(workdir) == EAGER
  # The same command, extended: the run resumes at the outer step it
  # started with.
  resumed = _main(workdir, *argv, *_tiny_sized(12),
                  "--config.resume.allow_changes=total_steps")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["resumed_from_step"] == 8 and summary["rounds"] == 6
  assert [c["field"] for c in summary["config_changes"]] == ["total_steps"]
  assert _saved_outer(workdir) == EAGER
