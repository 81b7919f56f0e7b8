"""diloco_jax: DiLoCo-family low-communication training of language models
across islands of accelerators, in JAX/Flax.

The package is layered; a module imports only from its own subpackage and
from the layers below it (tests/test_layers.py checks this):

  main.py, launch.py   entry points: `python -m diloco_jax.main`, the
                       multi-process launcher
  elastic/             islands as programs of their own under Ray, synced
                       through a coordinator (`python -m diloco_jax.elastic`)
  run/                 the driver: setup, where a run starts, the loop
  compiled/  telemetry/  the compiled programs (and the outer step on
                       devices of its own); metrics, records, summaries
  storage/             the workdir, its files, checkpoints, resuming
  analysis/            FLOPs, bytes over the link, the network model
  config/              the schema, one validation, RunConfig
  algorithm/           pure functions over pytrees: inner and outer steps,
                       overlap, streaming, compression, optimizers
  parallel/            mesh, placement, the communication boundary,
                       processes
  codecs/  model/  data/   dense/sparse/low-rank codecs of vectors; the
                       transformer; the host-side data pipeline

To add DiLoCo to your own loop: `from diloco_jax import library`
(algorithm/library.py, docs/library.md). To read the code, start with
run/train.py (train_and_evaluate), algorithm/outer_step.py (the outer
step), parallel/placement.py (where arrays live) and run/loop.py (the
loop). docs/architecture.md has the picture.
"""

import importlib as _importlib
import warnings as _warnings

# Modules users import by their names before the layers (every config file
# imports config_schema; scripts call train.train_and_evaluate): still
# importable from here, with a warning naming the new place.
_MOVED = {"config_schema": "diloco_jax.config.schema",
          "train": "diloco_jax.run.train"}


# The public API (docs/library.md): `from diloco_jax import library`.
__all__ = ["library"]


def __getattr__(name: str):
  if name == "library":
    module = globals()[name] = _importlib.import_module(
        "diloco_jax.algorithm.library")
    return module
  if name in _MOVED:
    _warnings.warn(f"diloco_jax.{name} moved to {_MOVED[name]}; import it "
                   "from there", DeprecationWarning, stacklevel=2)
    module = globals()[name] = _importlib.import_module(_MOVED[name])
    return module
  raise AttributeError(f"module 'diloco_jax' has no attribute {name!r}")
