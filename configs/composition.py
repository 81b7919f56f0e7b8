r"""One cell of the composition table: a codec x an overlap x an island
layout, on the smallest model that has every layout (2 layers, so 2
pipeline stages hold one each), 2 islands, 2 rounds of H=4.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
  python -m diloco_jax.main --config=configs/composition.py:sparseloco,eager,stages \
      --workdir=DIR

The argument is CODEC,OVERLAP,LAYOUT (each one of the names below; the
default fp32,none,plain). The largest layout (FSDP + 2 stages) takes 8
devices: on a CPU, the XLA flag above makes them.
benchmarks/composition.py runs every cell; tests/test_composition.py
validates every cell and trains a cover of them.
"""

import itertools

from configs import tiny
from diloco_jax.config import schema as config_schema

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
    "streaming": {"diloco.fragments": 2},
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
CELLS = tuple(itertools.product(CODECS, OVERLAPS, LAYOUTS))


def parse_cell(argument: str) -> tuple[str, str, str]:
  """'CODEC,OVERLAP,LAYOUT' as a cell, or ValueError naming what is not
  one of the names."""
  parts = [part.strip() for part in argument.split(",")]
  if len(parts) != 3:
    raise ValueError(f"{argument!r} is not CODEC,OVERLAP,LAYOUT, e.g. "
                     "sparseloco,eager,stages")
  for part, names, what in zip(parts, (CODECS, OVERLAPS, LAYOUTS),
                               ("codec", "overlap", "layout")):
    if part not in names:
      raise ValueError(f"{part!r} is not a {what}: takes "
                       f"{', '.join(names)}")
  return tuple(parts)


def cell_config(codec: str, overlap: str, layout: str):
  """The run of one cell: the tiny config with 2 layers, batch 8, 2
  islands, 2 rounds of H=4."""
  config = tiny.get_config()
  config.model.num_layers = 2
  config.data.batch_size = 8
  config.diloco.islands = 2
  config.total_steps = 2 * config.diloco.inner_steps
  return config_schema.override(
      config, {**CODECS[codec], **OVERLAPS[overlap], **LAYOUTS[layout]})


def get_config(argument: str = "fp32,none,plain"):
  return cell_config(*parse_cell(argument))
