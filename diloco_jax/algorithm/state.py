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

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import optimizers
from diloco_jax.algorithm import overlap as overlap_lib
from diloco_jax.parallel import placement
from diloco_jax.parallel import stages as stages_lib
from diloco_jax.parallel.mesh import DATA, ISLAND, STAGE

BATCH_SPEC = P(ISLAND, DATA)  # batches are [islands, per-island batch, L+1]


class TrainState(flax.struct.PyTreeNode):
  """Everything a DiLoCo run carries from step to step.

  Attributes:
    step: inner steps taken by every island so far.
    round: outer steps taken so far.
    global_params: x, the outer parameters (the same for every island).
    outer_opt_state: the outer optimizer's state (likewise).
    island_params: y, stacked [islands, ...], split over 'island'.
    inner_opt_state: the inner optimizers' states, stacked the same way.
    residuals: error feedback: per island, the part of its pseudo-gradients
      the codec has not sent yet (stacked like island_params), or None.
    codec_state: what the codec carries across rounds (replicated; the
      low-rank codecs' warm-start bases and ranks), or None.
    in_flight: one-step-delay overlap: the mean pseudo-gradient of the last
      round, sent but not yet applied (float32, shaped like x), or None.
    in_flight_valid: whether `in_flight` holds an update to apply (a bool;
      False before the first round ends, after the final one is applied,
      or when no island took part in that round), or None.
    anchors: overlap 'one_step_delay_rebase': per island, the params its
      current round started from, a_i (its progress is y_i - a_i), stacked
      like island_params; overlap 'eager': per island, its own outer point
      x_m (where its round started); or None.
    island_outer_opt_state: overlap 'eager': per island, the outer
      optimizer state of its own x_m (stacked like island_params), or None.
    own_shares: overlap 'eager': per island, its share w_m d_m / sum_j w_j
      of the mean in flight (float32, stacked like island_params), which
      the mean replaces when it lands; or None.
  """
  step: jax.Array
  round: jax.Array
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


def stack_islands(tree, n: int):
  """`tree` broadcast to `n` islands: [n, ...] per leaf."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), tree)


def _zeros_per_island(params, num_islands: int):
  return jax.tree.map(
      lambda x: jnp.zeros((num_islands,) + x.shape, jnp.float32), params)


def num_islands(state: TrainState) -> int:
  """k, the number of logical islands in `state`."""
  return jax.tree.leaves(state.island_params)[0].shape[0]


def init_state(params, inner_opt: optax.GradientTransformation,
               outer_opt: optax.GradientTransformation,
               num_islands: int, error_feedback: bool = False,
               compression=None, seed: int = 0,
               overlap: str = "none",
               layout: stages_lib.StageLayout | None = None) -> TrainState:
  """Every island starts from the same params with a fresh inner state.

  With `error_feedback` the state holds zero residuals; with a `compression`
  (as outer_step.make_outer_step takes it) that keeps state, its initial
  codec state (seeded by `seed`; per stage of `layout`, when given); with a
  delayed `overlap`, an empty slot for the update in flight; with
  'one_step_delay_rebase' or 'eager' every island's anchor at `params`, and
  with 'eager' each island's own outer state and an empty share. The state
  is logical (`stage_state` stages it).
  """
  island_params = stack_islands(params, num_islands)
  delayed = overlap_lib.is_delayed(overlap)
  eager = overlap_lib.is_eager(overlap)
  return TrainState(
      anchors=island_params if overlap_lib.anchored(overlap) else None,
      island_outer_opt_state=(jax.vmap(outer_opt.init)(island_params)
                              if eager else None),
      own_shares=_zeros_per_island(params, num_islands) if eager else None,
      in_flight=(jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32),
                              params) if delayed else None),
      in_flight_valid=jnp.zeros((), jnp.bool_) if delayed else None,
      codec_state=init_codec_state(params, compression, seed, layout),
      residuals=(_zeros_per_island(params, num_islands) if error_feedback
                 else None),
      step=jnp.zeros((), jnp.int32),
      round=jnp.zeros((), jnp.int32),
      global_params=params,
      outer_opt_state=outer_opt.init(params),
      island_params=island_params,
      inner_opt_state=jax.vmap(inner_opt.init)(island_params),
  )


def init_codec_state(params, compression, seed: int,
                     layout: stages_lib.StageLayout | None = None):
  """The codec's initial state for logical `params`: one per stage of
  `layout` (stacked [S, ...]), or one for the whole tree."""
  compression = compression_lib.as_compression(compression)
  if layout is None:
    return compression_lib.init_codec_state(params, compression, seed)
  return jax.vmap(lambda piece: compression_lib.init_codec_state(
      piece, compression, seed))(layout.split_params(params))


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
  return TrainState(
      step=P(), round=P(),
      global_params=shared(state.global_params),
      outer_opt_state=shared(state.outer_opt_state),
      island_params=per_island(state.island_params),
      inner_opt_state=per_island(state.inner_opt_state),
      residuals=per_island(state.residuals),
      codec_state=jax.tree.map(lambda _: per_stage, state.codec_state),
      in_flight=shared(state.in_flight),
      in_flight_valid=jax.tree.map(lambda _: P(), state.in_flight_valid),
      anchors=per_island(state.anchors),
      island_outer_opt_state=per_island(state.island_outer_opt_state),
      own_shares=per_island(state.own_shares),
  )


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


_SHARED_PARAMS = ("global_params", "outer_opt_state", "in_flight")
_PER_ISLAND_PARAMS = ("island_params", "inner_opt_state", "residuals",
                      "anchors", "island_outer_opt_state", "own_shares")


def stage_state(state: TrainState, layout: stages_lib.StageLayout
                ) -> TrainState:
  """The staged state the compiled steps take, from a logical one
  (traceable)."""
  fields = {name: layout.split(getattr(state, name))
            for name in _SHARED_PARAMS if getattr(state, name) is not None}
  fields.update({name: _each_island(layout.split, getattr(state, name))
                 for name in _PER_ISLAND_PARAMS
                 if getattr(state, name) is not None})
  return state.replace(**fields)


def _each_island(fn, tree):
  """fn over the islands' leading axis. A tree with no arrays (an outer
  state that holds none: SparseLoCo's per-island SGD) has no axis to map,
  and vmap refuses it: fn takes it as it is."""
  return jax.vmap(fn)(tree) if jax.tree.leaves(tree) else fn(tree)


def unstage_state(state: TrainState, layout: stages_lib.StageLayout,
                  logical: TrainState) -> TrainState:
  """The logical state (as checkpoints hold it) from a staged one;
  `logical`: the logical state's shapes (traceable)."""
  fields = {name: layout.join(getattr(state, name), getattr(logical, name))
            for name in _SHARED_PARAMS if getattr(state, name) is not None}
  for name in _PER_ISLAND_PARAMS:
    staged, shapes = getattr(state, name), getattr(logical, name)
    if staged is not None:
      # The logical shapes without their island axis.
      one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:],
                                                        a.dtype), shapes)
      fields[name] = _each_island(lambda t, one=one: layout.join(t, one),
                                  staged)
  return state.replace(**fields)


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
  old = jax.tree.leaves(state.island_params)[0].shape[0]
  kept = min(old, num_islands)
  added = num_islands - kept
  take = lambda tree: jax.tree.map(lambda y: y[:kept], tree)
  params = take(state.island_params)
  anchors = take(state.anchors)
  opt_state = take(state.inner_opt_state)
  residuals = take(state.residuals)
  island_outer = take(state.island_outer_opt_state)
  shares = take(state.own_shares)
  if added:
    start = state.global_params
    if island_outer is not None:  # eager: the kept islands' average
      start, average_outer = eager_consensus(state.replace(
          anchors=anchors, island_outer_opt_state=island_outer))
    new_params = stack_islands(start, added)
    new_opt_state = jax.vmap(inner_opt.init)(new_params)
    join = lambda a, b: jnp.concatenate([a, b.astype(a.dtype)])
    params = jax.tree.map(join, params, new_params)
    opt_state = jax.tree.map(join, opt_state, new_opt_state)
    if anchors is not None:
      anchors = jax.tree.map(join, anchors, new_params)
    if residuals is not None:  # new islands have sent nothing yet
      residuals = jax.tree.map(
          join, residuals, _zeros_per_island(state.global_params, added))
    if island_outer is not None:  # nothing in flight yet
      island_outer = jax.tree.map(
          join, island_outer, stack_islands(average_outer, added))
      shares = jax.tree.map(
          join, shares, _zeros_per_island(state.global_params, added))
  return state.replace(island_params=params, anchors=anchors,
                       inner_opt_state=opt_state, residuals=residuals,
                       island_outer_opt_state=island_outer,
                       own_shares=shares)


def eager_consensus(state: TrainState):
  """(x, outer state): the islands' average outer point and outer state,
  the model an eager run is judged by (traceable). Computing it is a
  full-precision mean over the islands (an fp32 all-reduce of the params
  across the island link), so runs form it to evaluate, to start new
  islands and at the end, never in a round."""
  return (islands_average(state.anchors),
          islands_average(state.island_outer_opt_state))


def islands_average(tree):
  """The float32 mean over the leading islands axis of every floating
  leaf (in its dtype); other leaves (step counts) from island 0."""
  return jax.tree.map(
      lambda v: (jnp.mean(v.astype(jnp.float32), axis=0).astype(v.dtype)
                 if jnp.issubdtype(v.dtype, jnp.floating) else v[0]),
      tree)


def evaluation_params(state: TrainState, mode: str):
  """The params a run is judged by: x for DiLoCo (with eager updates the
  islands' average point, `eager_consensus`), island 0's otherwise.

  `single` has one island and `ddp` keeps its islands identical, so island 0
  is their model. Call inside jit so XLA moves the slice where it is needed.
  """
  if mode == "diloco":
    if state.own_shares is not None:
      return eager_consensus(state)[0]
    return state.global_params
  return jax.tree.map(lambda y: y[0], state.island_params)


def poison_island(state: TrainState, island: int) -> TrainState:
  """`state` with island `island`'s params set to NaN (tests of diverged
  islands, through config.testing.nan_island)."""
  return state.replace(island_params=jax.tree.map(
      lambda y: y.at[island].set(jnp.nan), state.island_params))
