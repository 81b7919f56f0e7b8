"""DiLoCo's state: one pytree holding x, the islands and what they carry.

Layout: the global params x and the outer optimizer state are the same for
every island; island params y_i and inner optimizer states are stacked with
a leading axis of the k logical islands, split over the mesh's 'island'
device slots (k / slots islands folded on each, see parallel/mesh.py).
Inside an island, arrays are replicated over its 'data' devices, or split
over them with FSDP (placement.fsdp_spec). Checkpoints hold this pytree
whole, so its fields are the checkpoint format.

An island of S > 1 pipeline stages (parallel/stages.py) runs on the staged
state: every params-shaped field (x, the outer state, the islands, their
inner states, residuals, the update in flight, anchors) holds a stage axis
of S, after the island axis where there is one ([k, S, ...]), split over
'stage': each stage keeps its own layers' params and inner and outer
optimizer states (DiLoCoX's dual optimizer). `stage_state` and
`unstage_state` convert between that and the logical state checkpoints
hold. The codec's state is per stage in both (its bases fit the stages'
pieces of the params).
"""

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax.algorithm import optimizers
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.algorithm import outer_state
# The islands' tree helpers, used with the state everywhere.
from diloco_jax.algorithm.island_trees import (  # pylint: disable=unused-import
    init_codec_state, islands_average, stack_islands, zeros_per_island)
from diloco_jax.parallel.mesh import DATA, ISLAND, STAGE
from diloco_jax.parallel import placement
from diloco_jax.parallel import stages as stages_lib

BATCH_SPEC = P(ISLAND, DATA)  # batches are [islands, per-island batch, L+1]


class TrainState(flax.struct.PyTreeNode):
  """Everything a DiLoCo run carries from step to step.

  Attributes:
    step: inner steps taken by every island so far.
    global_params: x, the outer parameters (the same for every island).
    island_params: y, stacked [islands, ...], split over 'island'.
    inner_opt_state: the inner optimizers' states, stacked the same way.
    outer: the outer object's state (outer_state.OuterState, stacked
      form): its outer optimizer state, codec state, residuals, the mean
      in flight, the islands' own points, the rounds taken, and (static)
      the codec, overlap and error feedback that made it.
  """
  step: jax.Array
  global_params: Any
  island_params: Any
  inner_opt_state: Any
  outer: outer_state.OuterState

  @property
  def round(self) -> jax.Array:
    """Outer steps taken so far."""
    return self.outer.round


def num_islands(state: TrainState) -> int:
  """k, the number of logical islands in `state`."""
  return jax.tree.leaves(state.island_params)[0].shape[0]


def init_state(params, inner_opt: optax.GradientTransformation, outer,
               num_islands: int, *, seed: int = 0,
               layout: stages_lib.StageLayout | None = None) -> TrainState:
  """Every island starts from the same params with a fresh inner state.

  Args:
    params: x.
    inner_opt: the islands' optimizer.
    outer: the outer object (outer.DiLoCo); its `init` makes the outer
      state, the codec's seeded by `seed` (one per stage of `layout`,
      when given).
    num_islands: k.

  The state is logical (`stage_state` stages it).
  """
  island_params = stack_islands(params, num_islands)
  outer_state_ = outer.init(params, num_islands, seed=seed)
  if layout is not None:
    outer_state_ = outer_state_.replace(codec_state=init_codec_state(
        params, outer.codec, seed, layout))
  return TrainState(
      step=jnp.zeros((), jnp.int32),
      global_params=params,
      island_params=island_params,
      inner_opt_state=jax.vmap(inner_opt.init)(island_params),
      outer=outer_state_)


def eager(state: TrainState) -> bool:
  """Whether `state` was made for eager updates (its outer optimizer
  state is each island's)."""
  return isinstance(state.outer.recipe.overlap, outer_overlaps.Eager)


# The outer state's params-shaped fields: per island, or one for x.
_OUTER_PER_ISLAND = ("residuals", "anchors", "own_shares")
_OUTER_SHARED = ("in_flight",)


def _params_shaped(state: TrainState) -> dict:
  """{name: (per_island, tree)} of every params-shaped part of `state`
  (outer parts named 'outer.<field>'), None parts left out."""
  outer = state.outer
  parts = {"global_params": (False, state.global_params),
           "island_params": (True, state.island_params),
           "inner_opt_state": (True, state.inner_opt_state),
           "outer.outer_opt_state": (eager(state), outer.outer_opt_state)}
  for name in _OUTER_PER_ISLAND + _OUTER_SHARED:
    parts["outer." + name] = (name in _OUTER_PER_ISLAND, getattr(outer, name))
  return {name: part for name, part in parts.items() if part[1] is not None}


def _with_parts(state: TrainState, parts: dict) -> TrainState:
  """`state` with the parts named as `_params_shaped` names them."""
  outer = {name[len("outer."):]: tree for name, tree in parts.items()
           if name.startswith("outer.")}
  top = {name: tree for name, tree in parts.items()
         if not name.startswith("outer.")}
  return state.replace(outer=state.outer.replace(**outer), **top)


def state_partition_specs(state: TrainState, data_size: int = 1,
                          fsdp: bool = False, stages: int = 1,
                          staged: bool = True) -> TrainState:
  """Where each part of the state lives on the (island, data, stage) mesh.

  With `fsdp`, params, optimizer states and residuals are split over the
  island's `data_size` devices by placement.fsdp_spec; the codec state
  (small bases) is replicated. With `stages` > 1: a `staged` state's stage
  axis is split over 'stage' (each stage's values on its own devices); a
  logical one (as checkpoints hold it) has every leaf split over 'stage'
  where a dimension divides (placement.stage_split_spec), so no device
  holds the whole model while converting between the two.
  """
  if stages == 1 or not staged:
    rule = lambda shape: placement.stage_split_spec(shape, data_size, fsdp,
                                                    stages)
  else:
    rule = lambda shape: P(STAGE, *placement.fsdp_spec(shape[1:], data_size,
                                                       fsdp))
  shared = lambda tree: jax.tree.map(lambda x: rule(tuple(x.shape)), tree)
  per_island = lambda tree: jax.tree.map(
      lambda x: P(ISLAND, *rule(tuple(x.shape[1:]))), tree)
  per_stage = P(STAGE) if stages > 1 else P()
  replicated = lambda tree: jax.tree.map(lambda _: P(), tree)
  outer = state.outer
  specs = state.replace(
      step=P(),
      outer=outer.replace(
          round=P(), included=P(ISLAND),
          in_flight_valid=replicated(outer.in_flight_valid),
          codec_state=jax.tree.map(lambda _: per_stage, outer.codec_state)))
  return _with_parts(specs, {
      name: (per_island if island_axis else shared)(tree)
      for name, (island_axis, tree) in _params_shaped(state).items()})


def state_shardings(state: TrainState, mesh, fsdp: bool = False,
                    staged: bool = True) -> TrainState:
  """NamedShardings for `state` on `mesh` (see state_partition_specs; the
  mesh's 'stage' axis says how many stages)."""
  specs = state_partition_specs(state, mesh.shape[DATA], fsdp,
                                mesh.shape[STAGE], staged)
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                      is_leaf=lambda x: isinstance(x, P))


def constrain_state(state: TrainState, mesh, fsdp: bool = False
                    ) -> TrainState:
  """`state` held to its declared layout (inside jit), so the compiled
  steps that take it next need no resharding."""
  return placement.constrain(state, state_shardings(state, mesh, fsdp))


def stage_state(state: TrainState, layout: stages_lib.StageLayout,
                skip: tuple[str, ...] = ()) -> TrainState:
  """The staged state the compiled steps take, from a logical one
  (traceable); the parts named in `skip` (as `_params_shaped` names them)
  are left as they are."""
  return _with_parts(state, {
      name: _each_island(layout.split, tree) if island_axis
      else layout.split(tree)
      for name, (island_axis, tree) in _params_shaped(state).items()
      if name not in skip})


def _each_island(fn, tree):
  """fn over the islands' leading axis. A tree with no arrays (an outer
  state that holds none: SparseLoCo's per-island SGD) has no axis to map,
  and vmap refuses it: fn takes it as it is."""
  return jax.vmap(fn)(tree) if jax.tree.leaves(tree) else fn(tree)


def unstage_state(state: TrainState, layout: stages_lib.StageLayout,
                  logical: TrainState, skip: tuple[str, ...] = ()
                  ) -> TrainState:
  """The logical state (as checkpoints hold it) from a staged one;
  `logical`: the logical state's shapes (traceable); `skip` as in
  `stage_state`."""
  shapes = _params_shaped(logical)
  fields = {}
  for name, (island_axis, staged) in _params_shaped(state).items():
    if name in skip:
      continue
    if not island_axis:
      fields[name] = layout.join(staged, shapes[name][1])
      continue
    # The logical shapes without their island axis.
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype),
                       shapes[name][1])
    fields[name] = _each_island(lambda t, one=one: layout.join(t, one),
                                staged)
  return _with_parts(state, fields)


def restart_islands(finite, weights, restart_dropped: bool,
                    reset_inner: bool) -> jax.Array:
  """Which islands start the next round with a fresh inner optimizer
  state [islands]: the diverged ones (their moments are not finite), with
  `restart_dropped` those not synced, with `reset_inner` all of them."""
  restart = ~finite
  if restart_dropped:
    restart = restart | (weights <= 0)
  if reset_inner:
    restart = jnp.ones_like(restart)
  return restart


def restart_inner_states(inner_opt: optax.GradientTransformation,
                         inner_opt_state, island_params, step,
                         restart: jax.Array, stages: int = 1):
  """The islands' inner states, fresh for the islands in `restart`
  [islands]: initialized at their params (one state per stage of a staged
  state of `stages`) and counted from `step`, so the learning rate
  schedule goes on where the run is."""
  fresh = optimizers.with_step_counts(
      jax.vmap(stages_lib.per_stage(inner_opt.init, stages))(island_params),
      step)
  return jax.tree.map(
      lambda f, old: jnp.where(
          restart.reshape((-1,) + (1,) * (old.ndim - 1)), f, old),
      fresh, inner_opt_state)


def resize_islands(state: TrainState, num_islands: int,
                   inner_opt: optax.GradientTransformation) -> TrainState:
  """Changes the number of islands, e.g. when a run restarts on a new fleet.

  Islands that stay keep their params, anchors and inner optimizer state
  (with eager updates, their outer state and share in flight too). New
  islands start from the global params (their anchor too; with eager
  updates, from the kept islands' average point and outer state, with no
  share in flight) and a fresh inner optimizer state. Removed islands are
  dropped with whatever progress they made since the last outer step.
  """
  kept = min(jax.tree.leaves(state.island_params)[0].shape[0], num_islands)
  added = num_islands - kept
  take = lambda tree: jax.tree.map(lambda y: y[:kept], tree)
  outer = state.outer
  per_island = {"island_params": state.island_params,
                "inner_opt_state": state.inner_opt_state,
                "outer.included": outer.included}
  per_island.update({name: tree for name, (island_axis, tree)
                     in _params_shaped(state).items() if island_axis})
  parts = {name: take(tree) for name, tree in per_island.items()}
  if added:
    start = state.global_params
    new = {"outer.included": jnp.ones((added,), bool)}
    if eager(state):  # the kept islands' average point and outer state
      start = islands_average(parts["outer.anchors"])
      new["outer.outer_opt_state"] = stack_islands(
          islands_average(parts["outer.outer_opt_state"]), added)
      # nothing in flight yet
      new["outer.own_shares"] = zeros_per_island(state.global_params, added)
    new_params = stack_islands(start, added)
    new["island_params"] = new_params
    new["inner_opt_state"] = jax.vmap(inner_opt.init)(new_params)
    new["outer.anchors"] = new_params
    # new islands have sent nothing yet
    new["outer.residuals"] = zeros_per_island(state.global_params, added)
    join = lambda a, b: jnp.concatenate([a, b.astype(a.dtype)])
    parts = {name: (jax.tree.map(join, tree, new[name]) if name in new
                    else tree) for name, tree in parts.items()}
  return _with_parts(state, parts)


def eager_consensus(state: TrainState):
  """(x, outer state): the islands' average outer point and outer state,
  the model an eager run is judged by (traceable). Computing it is a
  full-precision mean over the islands (an fp32 all-reduce of the params
  across the island link), so runs form it to evaluate, to start new
  islands and at the end, never in a round."""
  return (islands_average(state.outer.anchors),
          islands_average(state.outer.outer_opt_state))


def evaluation_params(state: TrainState, mode: str):
  """The params a run is judged by: x for DiLoCo (with eager updates the
  islands' average point, `eager_consensus`), island 0's otherwise.

  `single` has one island and `ddp` keeps its islands identical, so island 0
  is their model. Call inside jit so XLA moves the slice where it is needed.
  """
  if mode == "diloco":
    if eager(state):
      return eager_consensus(state)[0]
    return state.global_params
  return jax.tree.map(lambda y: y[0], state.island_params)


def poison_island(state: TrainState, island: int) -> TrainState:
  """`state` with island `island`'s params set to NaN (tests of diverged
  islands, through config.testing.nan_island)."""
  return state.replace(island_params=jax.tree.map(
      lambda y: y.at[island].set(jnp.nan), state.island_params))
