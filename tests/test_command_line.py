"""What the shipped configs do with the flags a user adds to them.

Configs are parsed as main.py parses them (ml_collections' config-file
flag, the shipped file, the flags verbatim) and checked as a run checks
them; two runs go through `python -m diloco_jax.main` itself:

- a field means the same whether the config file or a flag set it: the
  outer step a config sets is kept whatever overlap the flags turn on
  (configs/default.py's averaging stays averaging under
  `--config.diloco.overlap=eager`), and what it leaves unset takes the
  overlap's measured step;
- the run's "outer step:" line names the overlap's measured step and the
  flags that select it where the run takes another, and those flags parse
  and select it;
- SparseLoCo runs on every shipped config with the flags its refusal
  names, if any;
- pipelined islands' default microbatch count fits the batch, and where
  no count can, the refusal names the flag to set.
"""

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from configs import tiny
from diloco_jax.algorithm import overlap as overlap_lib
from diloco_jax.config import overlap_defaults
from diloco_jax.config import run_config as run_config_lib
from diloco_jax.config import validation

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_DEVICES = 8  # conftest forces 8 CPU devices
EAGER = ("nesterov", *overlap_defaults.NESTEROV_DEFAULTS["eager"])
OVERLAPS = [o for o in overlap_lib.OVERLAPS if o != "none"]
# configs/slow_link.py's docstring: its whole-round overlap, verbatim.
SLOW_LINK_EAGER = ("--config.diloco.fragments=1",
                   "--config.diloco.fragment_delay=0",
                   "--config.diloco.fragment_alpha=0",
                   "--config.diloco.overlap=eager")
SLOW_LINK_EAGER_STEP = ("--config.diloco.outer_optimizer.name=nesterov",
                        "--config.diloco.outer_optimizer.learning_rate=0.5",
                        "--config.diloco.outer_optimizer.momentum=0.7")
# The configs that set an outer step of their own: (name, lr, momentum).
SET_STEPS = {"configs/default.py": ("sgd", 1.0, None),
             "configs/scaling.py:small": ("nesterov", 1.0, 0.0)}


def _parse(config_file, *argv):
  """The config main.py's --config flag gives for `--config=config_file
  *argv`."""
  argv = ["main", f"--config={config_file}", *argv]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values,
                                  lock_config=True, sys_argv=argv)
  flag_values(argv)
  return flag_values["config"].value


def _check(config_file, *argv):
  """The RunConfig a run of `config_file` with flags `argv` validates."""
  return validation.validate_config(_parse(config_file, *argv), NUM_DEVICES)


def _outer(run_config):
  """(name, lr, momentum) of a checked config's outer step (momentum None
  for sgd, which has none)."""
  outer = run_config.config.diloco.outer_optimizer
  momentum = outer.momentum if outer.name in ("nesterov", "momentum") else None
  return outer.name, outer.learning_rate, momentum


def _named_flags(line):
  """The --config.* flags a log or error line names, in order."""
  return re.findall(r"--config\.[\w.]+=[^\s,;)]+", line)


# A config's outer step is the same whoever set it.


@pytest.mark.parametrize("config_file", sorted(SET_STEPS))
@pytest.mark.parametrize("overlap", OVERLAPS)
def test_a_files_outer_step_is_kept_whatever_overlap_a_flag_sets(
    config_file, overlap):
  run_config = _check(config_file, f"--config.diloco.overlap={overlap}")
  assert _outer(run_config) == SET_STEPS[config_file]
  # The same config built in Python: the same run, the same log line.
  config = _parse(config_file)
  config.diloco.overlap = overlap
  built = validation.validate_config(config, NUM_DEVICES)
  assert built.config == run_config.config
  assert built.outer_step == run_config.outer_step


def test_slow_link_s_whole_round_overlap_averages_unless_its_flags_say():
  # Its docstring's overlap alone keeps the averaging it inherits; with
  # the docstring's outer flags, eager's measured step.
  assert _outer(_check("configs/slow_link.py", *SLOW_LINK_EAGER)) == (
      "sgd", 1.0, None)
  assert _outer(_check("configs/slow_link.py", *SLOW_LINK_EAGER,
                       *SLOW_LINK_EAGER_STEP)) == EAGER
  with open(os.path.join(REPO, "configs", "slow_link.py")) as f:
    docstring = " ".join(f.read().split('"""')[1].split())
  assert " ".join(SLOW_LINK_EAGER + SLOW_LINK_EAGER_STEP) in docstring


@pytest.mark.parametrize("overlap", overlap_lib.OVERLAPS)
def test_unset_fields_take_the_overlap_s_measured_step(overlap):
  # configs/study.py names Nesterov and leaves its lr and momentum unset.
  run_config = _check("configs/study.py:quick",
                      f"--config.diloco.overlap={overlap}")
  assert _outer(run_config) == (
      "nesterov", *overlap_defaults.NESTEROV_DEFAULTS[overlap])
  assert run_config.outer_step == (
      f"outer step: nesterov lr {_outer(run_config)[1]:g} momentum "
      f"{_outer(run_config)[2]:g}, the measured default for "
      f"overlap={overlap!r} (config/overlap_defaults.py)")


@pytest.mark.parametrize("argv,outer", [
    # A flag sets one field; the others are the file's or the defaults.
    (("--config.diloco.overlap=eager",
      "--config.diloco.outer_optimizer.learning_rate=0.3"),
     ("sgd", 0.3, None)),
    # The file's lr 1 is Nesterov's too; its unset momentum the default.
    (("--config.diloco.outer_optimizer.name=nesterov",),
     ("nesterov", 1.0, overlap_defaults.NESTEROV_DEFAULTS["none"][1])),
    (("--config.diloco.overlap=eager",
      "--config.diloco.outer_optimizer.name=nesterov"),
     ("nesterov", 1.0, EAGER[2])),
    (("--config.diloco.outer_optimizer.name=nesterov",
      "--config.diloco.outer_optimizer.learning_rate=0.7"),
     ("nesterov", *overlap_defaults.NESTEROV_DEFAULTS["none"])),
])
def test_flags_and_the_file_set_fields_alike(argv, outer):
  assert _outer(_check("configs/default.py", *argv)) == outer


# The log line: which step, from where, and the overlap's measured one.


def test_the_line_names_the_measured_step_and_its_flags():
  run_config = _check("configs/default.py", "--config.diloco.overlap=eager")
  assert run_config.outer_step == (
      "outer step: sgd lr 1, as the config sets it; the measured default "
      "for overlap='eager' is nesterov lr 0.5 momentum 0.7: "
      "--config.diloco.outer_optimizer.name=nesterov "
      "--config.diloco.outer_optimizer.learning_rate=0.5 "
      "--config.diloco.outer_optimizer.momentum=0.7")


def test_a_partly_set_step_says_which_field_came_from_where():
  run_config = _check("configs/study.py:quick",
                      "--config.diloco.overlap=eager",
                      "--config.diloco.outer_optimizer.learning_rate=1.0")
  assert run_config.outer_step == (
      "outer step: nesterov lr 1 momentum 0.7, lr as the config sets it, "
      "momentum the measured default for overlap='eager' "
      "(config/overlap_defaults.py); the measured default for "
      "overlap='eager' is nesterov lr 0.5 momentum 0.7: "
      + overlap_defaults.measured_flags("eager"))


@pytest.mark.parametrize("config_file", sorted(SET_STEPS))
@pytest.mark.parametrize("overlap", overlap_lib.OVERLAPS)
def test_the_flags_the_line_names_parse_and_select_that_step(
    config_file, overlap):
  argv = (f"--config.diloco.overlap={overlap}",)
  named = _named_flags(_check(config_file, *argv).outer_step)
  # None where the file's step is the measured one already (scaling.py's
  # lr 1, momentum 0 is eager_share's).
  assert len(named) == (
      0 if SET_STEPS[config_file] == (
          "nesterov", *overlap_defaults.NESTEROV_DEFAULTS[overlap]) else 3)
  run_config = _check(config_file, *argv, *named)
  assert _outer(run_config) == (
      "nesterov", *overlap_defaults.NESTEROV_DEFAULTS[overlap])
  # At the measured step the line names nothing more.
  assert run_config.outer_step == (
      f"outer step: nesterov lr {_outer(run_config)[1]:g} momentum "
      f"{_outer(run_config)[2]:g}, as the config sets it")


# SparseLoCo on every shipped config, with what its refusal names.


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


def _refused(argv_config, argv):
  """The refusal's lines of a run of config `argv_config` with `argv`
  other than the C4 configs' missing data ([] when it validates)."""
  try:
    _check(argv_config, *argv)
  except validation.ConfigError as e:
    return [line.strip() for line in str(e).splitlines()
            if line.strip().startswith("config.")
            and not line.strip().startswith("config.data.")]
  return []


@pytest.mark.parametrize("config_file", _shipped_configs())
def test_sparseloco_runs_on_every_shipped_config_with_the_flags_it_names(
    config_file):
  argv = ("--config.diloco.outer_optimizer.name=sparseloco",
          "--config.diloco.sparseloco.alpha=0.5")
  # Each refusal names its fix first: the flags that make the config's
  # own settings agree with SparseLoCo's.
  fixes = [_named_flags(line)[0] for line in _refused(config_file, argv)]
  assert not _refused(config_file, (*argv, *fixes))
  try:
    run_config = _check(config_file, *argv, *fixes)
  except validation.ConfigError:
    return  # the C4 configs need their data
  diloco = run_config.config.diloco
  assert (diloco.outer_optimizer.learning_rate,
          diloco.outer_optimizer.momentum, diloco.codec) == (0.5, 0.0, "fp32")
  assert run_config.outer_step.startswith("outer step: sparseloco alpha 0.5")


@pytest.mark.parametrize("config_file,argv,fixes", [
    # configs/default.py's lr 1 is alpha's default: nothing to add.
    ("configs/default.py", (), ()),
    ("configs/default.py", ("--config.diloco.sparseloco.alpha=0.5",),
     ("--config.diloco.outer_optimizer.learning_rate=0.5",)),
    # Its fp4 is refused; scaling's momentum 0 is SparseLoCo's.
    ("configs/slow_link.py", (), ("--config.diloco.codec=fp32",)),
    ("configs/scaling.py:small", (), ()),
    ("configs/study.py:quick", ("--config.diloco.sparseloco.alpha=0.5",),
     ()),
])
def test_sparseloco_refuses_what_it_would_not_use_naming_the_fix(
    config_file, argv, fixes):
  argv = ("--config.diloco.outer_optimizer.name=sparseloco", *argv)
  assert [_named_flags(line)[0] for line in _refused(config_file, argv)] == (
      list(fixes))


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
  # The file's averaging, and a line naming eager's step and its flags.
  lines = [line for line in first.stderr.splitlines() if "outer step:" in line]
  assert len(lines) == 1 and lines[0].endswith(
      "outer step: sgd lr 1, as the config sets it; the measured default "
      "for overlap='eager' is nesterov lr 0.5 momentum 0.7: "
      + overlap_defaults.measured_flags("eager"))
  assert _saved_outer(workdir)[:2] == ("sgd", 1.0)
  # The same command, extended: the run resumes at the outer step it
  # started with.
  resumed = _main(workdir, *argv, *_tiny_sized(12),
                  "--config.resume.allow_changes=total_steps")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["resumed_from_step"] == 8 and summary["rounds"] == 6
  assert [c["field"] for c in summary["config_changes"]] == ["total_steps"]
  assert _saved_outer(workdir)[:2] == ("sgd", 1.0)


@pytest.mark.parametrize("command", ["diloco_jax.main", "diloco_jax.elastic"])
def test_configs_that_import_their_siblings_load_from_any_directory(
    command, tmp_path):
  """configs/c4_small.py imports configs/c4_common.py: run from a
  directory that is not the repository's root (no PYTHONPATH), as a user
  would, it loads (here it then stops on a bad value, in one line)."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  done = subprocess.run(
      [sys.executable, "-m", command,
       f"--config={REPO}/configs/c4_small.py:quick",
       f"--workdir={tmp_path / 'run'}", "--config.total_steps=abc"],
      cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
  assert done.returncode != 0
  assert "No module named 'configs'" not in done.stderr + done.stdout
  assert "--config.total_steps=abc" in done.stderr + done.stdout
