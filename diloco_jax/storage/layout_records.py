"""What a checkpoint records of the state's layout (its params' shapes,
its leaves' paths), and the first difference between a record and a
config's state, in one line: resume and warm starts refuse a checkpoint
another config wrote with it."""

import jax
import numpy as np

from diloco_jax.storage import legacy_state


def param_shapes_record(params) -> dict:
  """{'path/to/leaf': [dims]} for the params: compared on restore."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {jax.tree_util.keystr(path): list(np.shape(leaf))
          for path, leaf in flat}


def state_layout_record(state) -> list[str]:
  """The key paths of every leaf of a TrainState (structure, not shapes).

  The layout changes with the optimizers, error feedback and the codec;
  shapes of per-island leaves change with the island count, which resuming
  allows, so only the codec state's (replicated) shapes are recorded.
  """
  record = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    name = jax.tree_util.keystr(path)
    if name.startswith(".outer.codec_state"):
      name += " " + str(tuple(leaf.shape))
    record.append(name)
  return sorted(record)


def layout_mismatch(saved: list[str], current: list[str]) -> str | None:
  """Describes the first leaf only one of two state layouts has (a saved
  record of the older state named as today's, legacy_state.py)."""
  saved = legacy_state.layout_record(saved)
  only_saved = sorted(set(saved) - set(current))
  only_current = sorted(set(current) - set(saved))
  if only_saved:
    return f"the checkpoint holds {only_saved[0]}, which this config lacks"
  if only_current:
    return f"this config needs {only_current[0]}, which the checkpoint lacks"
  return None


def shape_mismatch(saved: dict, current: dict) -> str | None:
  """Describes the first difference between two param_shapes_record()s."""
  for path in sorted(set(saved) | set(current)):
    if saved.get(path) != current.get(path):
      return (f"param {path} has shape {saved.get(path)} in the checkpoint "
              f"but {current.get(path)} in this config")
  return None
