"""Every shipped config builds, validates, and has the model it promises."""

import dataclasses
import gzip
import importlib
import json

import pytest
import sentencepiece as spm

from diloco_jax.config import validation
from diloco_jax.model import transformer as model_lib

NUM_DEVICES = 8  # conftest forces 8 CPU devices


@pytest.mark.parametrize("name", ["default", "tiny", "study", "study:quick",
                                  "slow_link", "scaling:small",
                                  "scaling:large", "scaling:gpu",
                                  "scaling:quick"])
def test_runnable_configs_validate(name):
  module, _, arg = name.partition(":")
  config = importlib.import_module(f"configs.{module}").get_config(
      *([arg] if arg else []))
  validation.validate_config(config, num_devices=NUM_DEVICES)


@pytest.mark.parametrize("name,nominal", [("c4_60m", 60e6), ("c4_150m", 150e6),
                                          ("c4_400m", 400e6)])
def test_paper_c4_configs_build_and_validate(name, nominal):
  config = importlib.import_module(f"configs.{name}").get_config()
  assert config.data.corpus == "c4" and config.diloco.inner_steps == 500
  num_params = model_lib.count_params(model_lib.param_shapes(config.model))
  assert abs(num_params - nominal) / nominal < 0.03
  # Without a data path the config is refused, naming the field.
  with pytest.raises(validation.ConfigError, match="config.data.path"):
    validation.validate_config(config, num_devices=NUM_DEVICES)


def test_the_scaling_regime_is_compute_optimal_with_many_rounds():
  """configs/scaling.py: ~20 tokens per parameter, over 50 outer rounds,
  and its two CPU scales at least 4x apart in parameters."""
  scaling = importlib.import_module("configs.scaling")
  sizes = {}
  for scale in ("small", "large", "gpu"):
    config = scaling.get_config(scale)
    sizes[scale] = model_lib.count_params(model_lib.param_shapes(
        config.model))
    assert sizes[scale] == scaling.parameters(config.model)
    tokens = (config.total_steps * config.diloco.islands
              * config.data.batch_size * config.data.sequence_length)
    assert 20 <= tokens / sizes[scale] < 20.5
    assert config.total_steps // config.diloco.inner_steps >= 50
    # The single worker spends the same tokens in 4x the steps.
    assert scaling.steps_for(config, 1) == 4 * config.total_steps
  assert sizes["large"] >= 4 * sizes["small"]
  assert 20e6 <= sizes["gpu"] <= 60e6


def test_paper_c4_configs_validate_given_their_data(tmp_path):
  """With C4 shards and a SentencePiece model, the paper configs are valid."""
  texts = [f"document {i} about topic {i % 7}: " + "words " * (i % 13 + 3)
           for i in range(400)]
  shards = tmp_path / "c4"
  shards.mkdir()
  for name, part in (("c4-train.00000-of-00002.json.gz", texts[:200]),
                     ("c4-train.00001-of-00002.json.gz", texts[200:350]),
                     ("c4-validation.00000-of-00001.json.gz", texts[350:])):
    with gzip.open(shards / name, "wt") as f:
      f.writelines(json.dumps({"text": t}) + "\n" for t in part)
  sample = tmp_path / "sample.txt"
  sample.write_text("\n".join(texts))
  spm.SentencePieceTrainer.train(input=str(sample),
                                 model_prefix=str(tmp_path / "spm"),
                                 vocab_size=64, minloglevel=2)
  for name in ("c4_60m", "c4_150m", "c4_400m"):
    config = importlib.import_module(f"configs.{name}").get_config()
    config.data.path = str(shards)
    config.data.tokenizer_path = str(tmp_path / "spm.model")
    validation.validate_config(config, num_devices=NUM_DEVICES)


def test_every_problem_is_reported_at_once_naming_each_field():
  config = importlib.import_module("configs.tiny").get_config()
  config.diloco.inner_steps = 0
  config.model.dtype = "float16"
  config.diloco.codec = "int3"
  config.data.corpus = "wikipedia"
  with pytest.raises(validation.ConfigError) as error:
    validation.validate_config(config, num_devices=NUM_DEVICES)
  lines = str(error.value).splitlines()
  assert lines[0] == "4 problems in the config:"
  for field in ("config.diloco.inner_steps=0", "config.model.dtype='float16'",
                "config.diloco.codec='int3'",
                "config.data.corpus='wikipedia'"):
    assert sum(field in line for line in lines[1:]) == 1, (field, lines)


def test_a_problem_is_not_reported_again_by_the_checks_that_read_it():
  """A bad island count is one line, though the schedule, the eval split
  and the fragments all read it."""
  config = importlib.import_module("configs.tiny").get_config()
  config.diloco.islands = 0
  config.diloco.island_schedule = "1->2"
  with pytest.raises(validation.ConfigError) as error:
    validation.validate_config(config, num_devices=NUM_DEVICES)
  assert str(error.value) == "config.diloco.islands=0 must be an integer >= 1"


def test_a_valid_config_comes_back_frozen_with_what_it_stands_for():
  config = importlib.import_module("configs.tiny").get_config()
  config.diloco.codec = "int8"
  config.diloco.island_schedule = "1->2"
  run_config = validation.validate_config(config, num_devices=NUM_DEVICES)
  with pytest.raises(AttributeError):
    run_config.config.total_steps = 1  # frozen: nothing below changes it
  assert run_config.islands == config.diloco.islands
  assert run_config.compression.name == "int8"
  assert run_config.schedule.inner_steps == config.diloco.inner_steps
  assert run_config.participation.schedule == ("ramp", 1, 2)
  assert run_config.participation(1).tolist() == [True, False]
  assert run_config.data.corpus == "synthetic"
  assert run_config.data.vocab_size == config.data.synthetic.vocab_size + 1


def test_the_optimizer_settings_carry_every_field_of_their_sections():
  """algorithm/optimizers.py takes typed settings: each field of
  config.inner_optimizer and config.diloco.outer_optimizer reaches them
  with its value (a field added to the schema but not to the settings
  would be silently ignored)."""
  from diloco_jax.config import overlap_defaults  # pylint: disable=g-import-not-at-top
  from diloco_jax.config import run_config  # pylint: disable=g-import-not-at-top
  config = overlap_defaults.resolve(
      importlib.import_module("configs.default").get_config())
  # Distinct values, so that a field read from another cannot pass.
  for section in (config.inner_optimizer, config.inner_optimizer.muon,
                  config.diloco.outer_optimizer):
    for offset, key in enumerate(sorted(section.keys()), start=1):
      if isinstance(section[key], float):
        section[key] = 0.01 * offset + 0.001
  for section, settings in (
      (config.inner_optimizer,
       run_config.inner_optimizer(config.inner_optimizer)),
      (config.diloco.outer_optimizer,
       run_config.outer_optimizer(config.diloco.outer_optimizer))):
    values = dataclasses.asdict(settings)
    for key in section.keys():
      expected = section[key]
      if hasattr(expected, "keys"):
        expected = expected.to_dict()
      assert values[key] == expected, key
