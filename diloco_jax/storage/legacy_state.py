"""Checkpoints written before the TrainState held the outer object's state
as one field (`state.outer`), read into today's state.

Those checkpoints hold the outer fields beside the islands' at the top of
the state (round, outer_opt_state, residuals, codec_state, in_flight,
in_flight_valid, anchors; with eager updates also island_outer_opt_state,
each island's outer optimizer state, and own_shares). They are read as
that older pytree (so their saved digests check every array bit for bit)
and then moved into today's fields: no value is computed, except that
eager updates' x-side outer optimizer state (the islands' average, which
today's state forms when it needs it) is dropped and every island counts
as included in the last round.
"""

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from diloco_jax.algorithm import state as state_lib

# The outer state's fields that kept their names at the top of the older
# state.
_SAME_NAMES = ("round", "residuals", "codec_state", "in_flight",
               "in_flight_valid", "anchors", "own_shares")


class LegacyTrainState(flax.struct.PyTreeNode):
  """The TrainState's fields as checkpoints before `state.outer` held them
  (the older class; fields None were not saved)."""
  step: Any
  round: Any
  global_params: Any
  outer_opt_state: Any
  island_params: Any
  inner_opt_state: Any
  residuals: Any = None
  codec_state: Any = None
  in_flight: Any = None
  in_flight_valid: Any = None
  anchors: Any = None
  island_outer_opt_state: Any = None
  own_shares: Any = None


def is_legacy(saved_fields) -> bool:
  """Whether a checkpoint's saved top-level fields are the older state's."""
  saved_fields = set(saved_fields)
  return "global_params" in saved_fields and "outer" not in saved_fields


def target(abstract: state_lib.TrainState) -> LegacyTrainState:
  """The older state's abstract arrays for today's `abstract` (with its
  shardings): what to read such a checkpoint into."""
  outer = abstract.outer
  fields = {name: getattr(outer, name) for name in _SAME_NAMES}
  if state_lib.eager(abstract):
    fields["island_outer_opt_state"] = outer.outer_opt_state
    # x's own outer state, read and dropped: one island's shapes, with
    # x's shardings.
    x_sharding = jax.tree.leaves(abstract.global_params)[0].sharding
    fields["outer_opt_state"] = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(
            a.shape[1:], a.dtype,
            sharding=_without_island_axis(a.sharding, x_sharding)),
        outer.outer_opt_state)
  else:
    fields["outer_opt_state"] = outer.outer_opt_state
  return LegacyTrainState(step=abstract.step,
                          global_params=abstract.global_params,
                          island_params=abstract.island_params,
                          inner_opt_state=abstract.inner_opt_state, **fields)


def _without_island_axis(sharding, fallback):
  """A per-island leaf's sharding with its leading island axis taken off
  (a replicated one where the leaf has no sharding to take it from)."""
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return fallback if sharding is None else sharding
  return jax.sharding.NamedSharding(sharding.mesh,
                                    jax.sharding.PartitionSpec(*spec[1:]))


def current(legacy: LegacyTrainState,
            abstract: state_lib.TrainState) -> state_lib.TrainState:
  """Today's state from an older one read with `target(abstract)`."""
  fields = {name: getattr(legacy, name) for name in _SAME_NAMES}
  fields["outer_opt_state"] = (legacy.island_outer_opt_state
                               if state_lib.eager(abstract)
                               else legacy.outer_opt_state)
  included = abstract.outer.included
  fields["included"] = jax.device_put(
      jnp.ones(included.shape, bool), getattr(included, "sharding", None))
  return abstract.replace(
      step=legacy.step, global_params=legacy.global_params,
      island_params=legacy.island_params,
      inner_opt_state=legacy.inner_opt_state,
      outer=abstract.outer.replace(**fields))


def layout_record(record: list[str]) -> list[str]:
  """An older checkpoint's state layout record (layout_records) named as
  today's state names the same leaves; a record of today's as it is."""
  if any(name.startswith(".outer.") for name in record):
    return record
  eager = any(name.startswith(".island_outer_opt_state") for name in record)
  renamed = []
  for name in record:
    field = name[1:].split("[", 1)[0].split(".", 1)[0].split(" ", 1)[0]
    if field == "outer_opt_state" and eager:
      continue  # x's own, dropped
    if field == "island_outer_opt_state":
      renamed.append(".outer.outer_opt_state" + name[len(".island_outer_opt_"
                                                         "state"):])
    elif field in _SAME_NAMES or field == "outer_opt_state":
      renamed.append(".outer" + name)
    else:
      renamed.append(name)
  return sorted(renamed + [".outer.included"])
