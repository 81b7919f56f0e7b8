"""What composes with what: every codec x overlap x island layout.

Validation only (no compile), on the tiny config with 4 layers, batch 8 and
2 islands over the 8 CPU devices conftest forces. Each cell either
validates or is refused with one line per pair of settings that cannot be
combined, the line naming both settings; the cells refused are exactly
those of the pairs listed in REFUSED_PAIRS, each a limit docs/islands.md
states ("What composes with what").
"""

import itertools

import jax

from configs import tiny
from diloco_jax.config import validation
from diloco_jax.parallel import outer_devices
from tests import helpers

CODECS = {
    "fp32": {},
    "int8": {"diloco.codec": "int8"},
    "fp4": {"diloco.codec": "fp4"},
    "topk": {"diloco.codec": "topk"},
    "lowrank": {"diloco.codec": "lowrank"},
    "adaptive_lowrank": {"diloco.codec": "adaptive_lowrank"},
    "sparseloco": {"diloco.outer_optimizer.name": "sparseloco"},
}
OVERLAPS = {
    "none": {},
    "one_step_delay": {"diloco.overlap": "one_step_delay"},
    "eager": {"diloco.overlap": "eager"},
    "fragments": {"diloco.fragments": 2},
}
LAYOUTS = {
    "plain": {},
    "fsdp": {"mesh.data": 2, "mesh.fsdp": True},
    "stages": {"mesh.stage": 2},
    "outer_device": {"diloco.outer_placement": "host"},
    "fsdp+stages": {"mesh.data": 2, "mesh.fsdp": True, "mesh.stage": 2},
    "outer_device+stages": {"diloco.outer_placement": "host",
                            "mesh.stage": 2},
}
# Each refused pair: when it applies to a cell, and the two settings its
# one line names (as they appear in the message). Every cell composes now;
# the check stays for the next limit (and a refusal outside the matrix is
# tested below).
REFUSED_PAIRS = {}


def _config(codec: str, overlap: str, layout: str):
  config = tiny.get_config()
  config.model.num_layers = 4
  config.data.batch_size = 8
  config.diloco.islands = 2
  return helpers.with_overrides(
      config, {**CODECS[codec], **OVERLAPS[overlap], **LAYOUTS[layout]})


def _validate(config):
  """Validates as train does: the outer device comes out of the devices."""
  devices = jax.devices()
  if config.diloco.outer_placement == "host":
    devices, _ = outer_devices.split_devices(devices)
  validation.validate_config(config, len(devices))


def _problem_lines(error: validation.ConfigError) -> list[str]:
  message = str(error)
  if "\n" not in message:
    return [message]
  return [line.strip() for line in message.splitlines()[1:]]


def _names(line: str, setting: str) -> bool:
  return any(name in line for name in setting.split("|"))


CELLS = list(itertools.product(CODECS, OVERLAPS, LAYOUTS))


def test_the_matrix_accepts_all_but_the_refused_pairs():
  accepted, refused_lines = [], {}
  for cell in CELLS:
    pairs = [name for name, (applies, _) in REFUSED_PAIRS.items()
             if applies(*cell)]
    try:
      _validate(_config(*cell))
    except validation.ConfigError as e:
      lines = _problem_lines(e)
      assert pairs, f"{cell} refused: {e}"
      # One line per refused pair, each naming both of its settings.
      assert len(lines) == len(pairs), (cell, lines)
      for name in pairs:
        settings = REFUSED_PAIRS[name][1]
        assert any(all(_names(line, s) for s in settings) for line in lines), (
            cell, name, lines)
      refused_lines[cell] = lines
    else:
      assert not pairs, f"{cell} validated, but {pairs} should refuse it"
      accepted.append(cell)
  # The count docs/islands.md's table states.
  assert (len(accepted), len(CELLS)) == (168, 168)


def test_fragments_that_are_not_the_stages_are_one_line_naming_both():
  """On pipelined islands a fragment is a stage: any other count is
  refused in one line that names both settings and the count to set."""
  for fragments in (1, 4):
    config = _config("fp32", "fragments", "stages")
    config.diloco.fragments = fragments
    config.diloco.fragment_delay = 1
    try:
      _validate(config)
    except validation.ConfigError as e:
      lines = _problem_lines(e)
    else:
      raise AssertionError(f"fragments={fragments} with 2 stages validated")
    assert len(lines) == 1, lines
    assert all(name in lines[0] for name in (
        f"config.diloco.fragments={fragments}", "config.mesh.stage=2",
        "--config.diloco.fragments=2")), lines
