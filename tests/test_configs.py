"""Every shipped config builds, validates, and has the model it promises."""

import importlib

import pytest

from diloco_jax import model as model_lib
from diloco_jax import validation

NUM_DEVICES = 8  # conftest forces 8 CPU devices


@pytest.mark.parametrize("name", ["default", "tiny"])
def test_runnable_configs_validate(name):
  config = importlib.import_module(f"configs.{name}").get_config()
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
