"""DiLoCo's state and its two compiled steps, as pure functions over pytrees.

State layout: the global params x and the outer optimizer state are the same
for every island; island params y_i and inner optimizer states are stacked
with a leading axis of the k logical islands, split over the mesh's 'island'
device slots (k / slots islands folded on each, see mesh.py). Inside an
island, arrays are replicated over its 'data' devices, or split over them
with FSDP (placement.fsdp_spec). The inner step advances every island at
once; the outer step averages the pseudo-gradients x - y_i across islands
(through the communication boundary), applies the outer optimizer and
resets every island to the new x. With one-step-delay overlap the outer
step applies the previous round's mean instead and leaves this round's in
flight; its rebasing variant keeps each island's own progress of the round
on top of the new x (see make_outer_step).

The same inner step serves all three modes: `ddp` additionally averages the
gradients across islands every step, `single` is one island that never syncs.
"""

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax.parallel import communication
from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import optimizers
from diloco_jax.parallel import placement
from diloco_jax.parallel.mesh import DATA, ISLAND
from diloco_jax.parallel.placement import PER_ISLAND, REPLICATED

LossFn = Callable[[Any, jax.Array], jax.Array]  # (params, sequences) -> loss


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
      like island_params; or None.
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


# How the outer step meets the local training (config.diloco.overlap):
# 'none' applies each round's mean at once (the islands wait for the
# collective); 'one_step_delay' applies it one round late, so the collective
# of round r has all of round r + 1 to arrive, and every island starts round
# r + 1 from x_r; 'one_step_delay_rebase' has the same timing, but an island
# starts round r + 1 from x_r plus its own progress of round r, whose mean
# is still in flight, instead of discarding that progress until it lands.
OVERLAPS = ("none", "one_step_delay", "one_step_delay_rebase")
DELAYED_OVERLAPS = OVERLAPS[1:]


def _stack(tree, n: int):
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), tree)


def _zero_residuals(params, num_islands: int):
  return jax.tree.map(
      lambda x: jnp.zeros((num_islands,) + x.shape, jnp.float32), params)


def num_islands(state: TrainState) -> int:
  """k, the number of logical islands in `state`."""
  return jax.tree.leaves(state.island_params)[0].shape[0]


def init_state(params, inner_opt: optax.GradientTransformation,
               outer_opt: optax.GradientTransformation,
               num_islands: int, error_feedback: bool = False,
               compression=None, seed: int = 0,
               overlap: str = "none") -> TrainState:
  """Every island starts from the same params with a fresh inner state.

  With `error_feedback` the state holds zero residuals; with a `compression`
  (as make_outer_step takes it) that keeps state, its initial codec state
  (seeded by `seed`); with a delayed `overlap`, an empty slot for the
  update in flight, and with 'one_step_delay_rebase' every island's anchor
  at `params`.
  """
  island_params = _stack(params, num_islands)
  delayed = is_delayed(overlap)
  return TrainState(
      anchors=island_params if rebases(overlap) else None,
      in_flight=(jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32),
                              params) if delayed else None),
      in_flight_valid=jnp.zeros((), jnp.bool_) if delayed else None,
      codec_state=compression_lib.init_codec_state(
          params, compression_lib.as_compression(compression), seed),
      residuals=(_zero_residuals(params, num_islands) if error_feedback
                 else None),
      step=jnp.zeros((), jnp.int32),
      round=jnp.zeros((), jnp.int32),
      global_params=params,
      outer_opt_state=outer_opt.init(params),
      island_params=island_params,
      inner_opt_state=jax.vmap(inner_opt.init)(island_params),
  )


def state_partition_specs(state: TrainState, data_size: int = 1,
                          fsdp: bool = False) -> TrainState:
  """Where each part of the state lives on the (island, data, stage) mesh.

  With `fsdp`, params, optimizer states and residuals are split over the
  island's `data_size` devices by placement.fsdp_spec; the codec state
  (small bases) is replicated.
  """
  shared = lambda tree: placement.tree_specs(tree, data_size, fsdp, False)
  per_island = lambda tree: placement.tree_specs(tree, data_size, fsdp, True)
  return TrainState(
      step=P(), round=P(),
      global_params=shared(state.global_params),
      outer_opt_state=shared(state.outer_opt_state),
      island_params=per_island(state.island_params),
      inner_opt_state=per_island(state.inner_opt_state),
      residuals=per_island(state.residuals),
      codec_state=jax.tree.map(lambda _: P(), state.codec_state),
      in_flight=shared(state.in_flight),
      in_flight_valid=jax.tree.map(lambda _: P(), state.in_flight_valid),
      anchors=per_island(state.anchors),
  )


def is_delayed(overlap: str) -> bool:
  """Whether `overlap` applies each round's mean one round late."""
  if overlap not in OVERLAPS:
    raise ValueError(f"overlap={overlap!r} is not one of {OVERLAPS}")
  return overlap in DELAYED_OVERLAPS


def rebases(overlap: str) -> bool:
  """Whether `overlap` keeps the islands' progress across the delay."""
  return is_delayed(overlap) and overlap == "one_step_delay_rebase"


def rebase(island_params, anchors, x, keep: jax.Array):
  """(island params, anchors) for the next round of the rebasing delay.

  An island in `keep` [islands] starts it from x plus its progress since
  its anchor, y_i <- x + (y_i - a_i), the rest from x; either way its new
  anchor is where it starts. Sums in float32, so low-precision params lose
  no more than their own rounding.
  """
  def one(y, a, new_x):
    progress = y.astype(jnp.float32) - a.astype(jnp.float32)
    kept = keep.reshape((-1,) + (1,) * (y.ndim - 1))
    return jnp.where(kept, new_x.astype(jnp.float32)[None] + progress,
                     new_x[None]).astype(y.dtype)
  island_params = jax.tree.map(one, island_params, anchors, x)
  return island_params, island_params


def next_round(state: TrainState, x, restart: jax.Array, keep: jax.Array,
               inner_opt: optax.GradientTransformation | None = None
               ) -> TrainState:
  """`state` with x and every island set up for the next round (traceable).

  Every island starts from x; with anchors (the rebasing delay) an island
  in `keep` [islands] starts from x plus its progress (see `rebase`).
  Given `inner_opt`, islands in `restart` [islands] also get a fresh inner
  optimizer state, counted from the current step so the learning rate
  schedule goes on.
  """
  inner_opt_state = state.inner_opt_state
  if inner_opt is not None:
    fresh = optimizers.with_step_counts(
        jax.vmap(inner_opt.init)(_stack(x, num_islands(state))), state.step)
    inner_opt_state = jax.tree.map(
        lambda f, old: jnp.where(
            restart.reshape((-1,) + (1,) * (old.ndim - 1)), f, old),
        fresh, inner_opt_state)
  if state.anchors is None:
    island_params, anchors = _stack(x, num_islands(state)), None
  else:
    island_params, anchors = rebase(state.island_params, state.anchors, x,
                                    keep)
  return state.replace(global_params=x, island_params=island_params,
                       anchors=anchors, inner_opt_state=inner_opt_state)


def outer_update(outer_opt, global_params, outer_opt_state, update,
                 takes_effect):
  """(x, outer state) after the outer optimizer's step on `update`, or both
  unchanged when `takes_effect` is False (momentum alone would move x)."""
  updates, new_state = outer_opt.update(update, outer_opt_state,
                                        global_params)
  new_global = optax.apply_updates(global_params, updates)
  unless_not = lambda new, old: jax.tree.map(
      lambda n, o: jnp.where(takes_effect, n, o), new, old)
  return (unless_not(new_global, global_params),
          unless_not(new_state, outer_opt_state))


def state_shardings(state: TrainState, mesh, fsdp: bool = False) -> TrainState:
  """NamedShardings for `state` on `mesh` (see state_partition_specs)."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                      state_partition_specs(state, mesh.shape[DATA], fsdp),
                      is_leaf=lambda x: isinstance(x, P))


BATCH_SPEC = P(ISLAND, DATA)  # batches are [islands, per-island batch, L+1]


def _without_island_axis(specs):
  """Per-island specs P(ISLAND, ...) as seen inside one island: P(...)."""
  return jax.tree.map(lambda spec: P(*spec[1:]), specs,
                      is_leaf=lambda x: isinstance(x, P))


def _value_and_grad(loss_fn: LossFn, params, sequences, microbatches: int):
  """Mean loss and gradient over `sequences` [B, L + 1], in `microbatches`.

  Gradient accumulation: the batch is cut into `microbatches` equal parts
  run one after another (lax.scan), so activations of only B / microbatches
  sequences are alive at once; the result is the full batch's mean.
  Microbatch i takes sequences i, i + n, i + 2n, ..., which keeps each
  microbatch split over the island's 'data' devices like the whole batch.
  """
  sequences = jax.lax.with_sharding_constraint(sequences, P(DATA))
  if microbatches == 1:
    return jax.value_and_grad(loss_fn)(params, sequences)
  batch, length = sequences.shape
  parts = sequences.reshape(batch // microbatches, microbatches, length)
  parts = jax.lax.with_sharding_constraint(parts.swapaxes(0, 1),
                                           P(None, DATA))

  def accumulate(totals, part):
    loss, grads = jax.value_and_grad(loss_fn)(params, part)
    return jax.tree.map(lambda t, g: t + g.astype(jnp.float32), totals,
                        (loss, grads)), None

  # The carry's zeros are derived from the inputs (zeros_like, a sum of
  # zeros for the loss) so they are typed as varying over islands like the
  # values the scan adds to them; XLA folds them to constants.
  zeros = (jnp.zeros_like(sequences, jnp.float32).sum(),
           jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params))
  (loss, grads), _ = jax.lax.scan(accumulate, zeros, parts)
  grads = jax.tree.map(lambda g, p: (g / microbatches).astype(p.dtype),
                       grads, params)
  return loss / microbatches, grads


def make_inner_step(loss_fn: LossFn, inner_opt: optax.GradientTransformation,
                    mesh, sync_gradients_across_islands: bool = False,
                    microbatches: int = 1, fsdp: bool = False):
  """Builds the jitted inner step for all islands at once.

  Each island computes the gradient of its batch (split over its 'data'
  devices, in `microbatches` accumulated parts) and takes one inner
  optimizer step. With `sync_gradients_across_islands` (ddp mode) the
  gradients are also averaged across islands through the communication
  boundary, every step. With `fsdp`, params, gradients and optimizer
  states stay split over the island's 'data' devices.

  Returns:
    step(state, batch) -> (state, metrics) with metrics['loss'] of shape
    [islands]; `state` is donated.
  """

  def step(state: TrainState, batch: jax.Array):
    specs = state_partition_specs(state, mesh.shape[DATA], fsdp)
    param_specs = _without_island_axis(specs.island_params)
    opt_specs = _without_island_axis(specs.inner_opt_state)

    def island_update(params, opt_state, sequences):
      loss, grads = _value_and_grad(loss_fn, params, sequences, microbatches)
      if fsdp:  # reduce-scatter the gradient rather than all-reduce it
        grads = placement.constrain(grads, param_specs)
      if sync_gradients_across_islands:
        grads = communication.island_mean(grads, jnp.float32(1.0))
      updates, opt_state = inner_opt.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      if fsdp:
        params = placement.constrain(params, param_specs)
        opt_state = placement.constrain(opt_state, opt_specs)
      return params, opt_state, loss, optax.tree.norm(grads)

    update = placement.island_map(
        island_update, mesh, in_specs=(PER_ISLAND,) * 3,
        out_specs=(PER_ISLAND,) * 4,
        # ddp's mean psums a weight that is the same on every island, which
        # the varying-axes check rejects for folded (vmapped) islands.
        check_vma=not sync_gradients_across_islands)
    params, opt_state, loss, grad_norm = update(
        state.island_params, state.inner_opt_state, batch)
    state = state.replace(step=state.step + 1, island_params=params,
                          inner_opt_state=opt_state)
    state = placement.constrain(state, state_shardings(state, mesh, fsdp))
    return state, {"loss": loss, "grad_norm": grad_norm}

  return jax.jit(step, donate_argnums=0)


def make_island_sync(mesh, compression=None,
                     rounding_seed: int | None = None, fsdp: bool = False,
                     stripes: int | None = None,
                     reference_per_island: bool = False):
  """The cross-island part of an outer step, for any subtree of the params.

  Returns sync(reference, island_params, residuals, codec_state,
  weights, round_index) -> (mean, residuals, codec_state, included, finite)
  (traceable; call it inside jit): the weighted mean of the islands'
  pseudo-gradients reference - y_i (plus their residuals) through
  `compression`, where the reference is x, the same for every island, or
  with `reference_per_island` each island's own anchor a_i (stacked);
  each island's new residual, the next codec state, and per island whether
  it took part and whether its pseudo-gradient was finite. An island with
  weight 0 or a non-finite pseudo-gradient is masked before any arithmetic
  and keeps its residual. `round_index` seeds stochastic rounding (with
  `rounding_seed`) with the island's index, so a resumed run draws the
  same noise.

  `stripes` (default: the mesh's 'data' size with `fsdp`, else 1) is how
  many rows the codec cuts each island's tree into (placement.stripe): the
  outer devices of outer_placement='host' hold whole islands and encode
  them as the islands' FSDP devices would.
  """
  compression = compression_lib.as_compression(compression)
  if stripes is None:
    # With FSDP each of an island's 'data' devices sends its own shards.
    stripes = mesh.shape[DATA] if fsdp else 1

  def island_sync(reference, island_params, residuals, codec_state,
                  weight, round_index):
    """One island's pseudo-gradient through the codec: the mean, what the
    codec left unsent (error feedback) and the next codec state."""
    pseudo_grad = jax.tree.map(jnp.subtract, reference, island_params)
    if residuals is not None:
      pseudo_grad = jax.tree.map(jnp.add, pseudo_grad, residuals)
    # An island without weight (not synced this round) or whose
    # pseudo-gradient is not finite (it diverged) takes no part: its values
    # are zeroed before any arithmetic, since NaN x 0 is still NaN.
    finite = all_finite(pseudo_grad)
    included = (weight > 0) & finite
    weight = jnp.where(included, weight, 0.0)
    pseudo_grad = jax.tree.map(lambda g: jnp.where(included, g, 0),
                               pseudo_grad)
    key = None
    if rounding_seed is not None:
      key = jax.random.fold_in(
          jax.random.fold_in(jax.random.key(rounding_seed), round_index),
          communication.island_index())
    mean, sent, codec_state = compression_lib.island_mean(
        pseudo_grad, weight, compression, codec_state, key, stripes=stripes)
    if residuals is not None:
      # An island that took no part keeps the residual it had.
      residuals = jax.tree.map(
          lambda old, new: jnp.where(included, new, old), residuals,
          jax.tree.map(jnp.subtract, pseudo_grad, sent))
    return mean, residuals, codec_state, included, finite

  return placement.island_map(
      island_sync, mesh,
      in_specs=(PER_ISLAND if reference_per_island else REPLICATED,
                PER_ISLAND, PER_ISLAND, REPLICATED, PER_ISLAND, REPLICATED),
      out_specs=(REPLICATED, PER_ISLAND, REPLICATED, PER_ISLAND, PER_ISLAND),
      # A compressed mean ends in an all_gather, whose result is the same
      # on every island but is typed as varying; the replicated out_specs
      # are right by construction (tests check islands agree bit for bit).
      check_vma=False)


def make_outer_step(outer_opt: optax.GradientTransformation, mesh,
                    compression=None, rounding_seed: int | None = None,
                    fsdp: bool = False,
                    inner_opt: optax.GradientTransformation | None = None,
                    restart_dropped: bool = False, overlap: str = "none"):
  """Builds the jitted outer step: one program holding the collective.

  `compression` (a compression.Compression, a codecs.DenseCodec, or None
  for fp32) says how pseudo-gradients cross the island link; its codec
  state, if any, lives in the TrainState. When the state carries residuals,
  error feedback adds each island's residual to its pseudo-gradient and
  keeps what the codec did not send. With `rounding_seed` the codec rounds
  stochastically, with noise derived from (seed, round, island) so a
  resumed run draws the same noise.

  With `fsdp` (params split over each island's 'data' devices) each
  device reduces its own shards across islands: the whole model is never
  gathered on one device (dense codecs only).

  An island with weight 0 (not synced this round) or a non-finite
  pseudo-gradient (it diverged) is left out of the mean: masked before any
  arithmetic, so NaN never reaches x; it keeps its error-feedback residual
  and, like every island, restarts from the new x; given `inner_opt`, a
  diverged island also restarts with a fresh inner optimizer state (its
  moments are not finite either), counted from the current step so the
  learning rate schedule goes on; with `restart_dropped` so does an island
  with weight 0 (config.diloco.dropped_islands='idle': it rejoins fresh).
  If no island takes part, x, the outer optimizer state and the codec
  state do not change.

  With `overlap` 'one_step_delay' (DiLoCoX's overlap of communication with
  local training), round r's pseudo-gradients are taken against the x the
  islands started from, s_r, and their mean D(r) is left in flight
  (state.in_flight); the outer optimizer steps on D(r - 1), the mean that
  had all of round r to arrive: x_r = OuterOpt(x_{r-1}, D(r - 1)), and
  round r + 1 starts from s_{r+1} = x_r. Round 0 applies nothing (s_0 = s_1
  = x_0); make_flush applies the last mean at the end of the run.

  With `overlap` 'one_step_delay_rebase' the timing is the same, but no
  island discards its round: its pseudo-gradient is taken against its
  anchor a_i (where it started the round), and it starts round r + 1 from
  x_r + (y_i - a_i), its own progress of round r rebased onto x_r, which
  becomes its anchor. When D(r) lands (at the end of round r + 1) x takes
  the islands' mean of that progress and each island's own copy of it is
  dropped by the next rebase. An island left out of the mean (weight 0 or
  diverged) starts from x_r alone.

  Returns:
    outer(state, weights) -> state, where `weights` [islands] are the islands'
    weights in the mean (tokens processed this round). `state` is donated.
  """

  delayed, rebased = is_delayed(overlap), rebases(overlap)
  sync = make_island_sync(mesh, compression, rounding_seed, fsdp,
                          reference_per_island=rebased)

  def outer(state: TrainState, weights: jax.Array):
    mean, residuals, codec_state, included, finite = sync(
        state.anchors if rebased else state.global_params,
        state.island_params, state.residuals, state.codec_state, weights,
        state.round)
    anyone = jnp.any(included)
    # With no island taking part, the codec state stays as it was.
    codec_state = jax.tree.map(lambda n, o: jnp.where(anyone, n, o),
                               codec_state, state.codec_state)
    # The outer optimizer runs once per device on the replicated x, not once
    # per folded island.
    if delayed:
      new_global, outer_state = outer_update(
          outer_opt, state.global_params, state.outer_opt_state,
          state.in_flight, state.in_flight_valid)
      state = state.replace(
          in_flight=jax.tree.map(lambda m: m.astype(jnp.float32), mean),
          in_flight_valid=anyone)
    else:
      new_global, outer_state = outer_update(
          outer_opt, state.global_params, state.outer_opt_state, mean,
          anyone)
    restart = ~finite
    if restart_dropped:
      restart = restart | (weights <= 0)
    state = next_round(state, new_global, restart, included, inner_opt)
    state = state.replace(round=state.round + 1, outer_opt_state=outer_state,
                          residuals=residuals, codec_state=codec_state)
    # The state keeps its declared layout, so the compiled steps take it.
    return placement.constrain(state, state_shardings(state, mesh, fsdp))

  return jax.jit(outer, donate_argnums=0)


def make_flush(outer_opt: optax.GradientTransformation, mesh,
               fsdp: bool = False):
  """Builds the jitted end of a one-step-delay run: flush(state) -> state.

  The mean still in flight after the last round is received and applied
  (x_R = OuterOpt(x_{R-1}, D(R - 1))), every island is set to the final x
  (with the rebasing delay, its anchor too: the last round's progress is
  in x_R), and the slot is emptied, so a run extended later starts its
  delay anew. `state` is donated.
  """

  def flush(state: TrainState) -> TrainState:
    new_global, outer_state = outer_update(
        outer_opt, state.global_params, state.outer_opt_state,
        state.in_flight, state.in_flight_valid)
    nobody = jnp.zeros((num_islands(state),), jnp.bool_)
    state = next_round(state, new_global, nobody, nobody).replace(
        outer_opt_state=outer_state,
        in_flight=jax.tree.map(jnp.zeros_like, state.in_flight),
        in_flight_valid=jnp.zeros((), jnp.bool_))
    return placement.constrain(state, state_shardings(state, mesh, fsdp))

  return jax.jit(flush, donate_argnums=0)


def islands_finite(state: TrainState) -> jax.Array:
  """[islands] bool: whether each island's params are all finite (the
  islands the outer step will include, weights permitting)."""
  return jax.vmap(all_finite)(state.island_params)


def poison_island(state: TrainState, island: int) -> TrainState:
  """`state` with island `island`'s params set to NaN (tests of diverged
  islands, through config.testing.nan_island)."""
  return state.replace(island_params=jax.tree.map(
      lambda y: y.at[island].set(jnp.nan), state.island_params))


def all_finite(tree) -> jax.Array:
  """Whether every value of `tree` is finite (a scalar bool)."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf))
                            for leaf in jax.tree.leaves(tree)]))


def resize_islands(state: TrainState, num_islands: int,
                   inner_opt: optax.GradientTransformation) -> TrainState:
  """Changes the number of islands, e.g. when a run restarts on a new fleet.

  Islands that stay keep their params, anchors and inner optimizer state;
  new islands start from the global params (their anchor too) with a fresh
  inner optimizer state; removed islands are dropped with whatever progress
  they made since the last outer step.
  """
  old = jax.tree.leaves(state.island_params)[0].shape[0]
  kept = min(old, num_islands)
  added = num_islands - kept
  take = lambda tree: jax.tree.map(lambda y: y[:kept], tree)
  params = take(state.island_params)
  anchors = take(state.anchors)
  opt_state = take(state.inner_opt_state)
  residuals = take(state.residuals)
  if added:
    new_params = _stack(state.global_params, added)
    new_opt_state = jax.vmap(inner_opt.init)(new_params)
    join = lambda a, b: jnp.concatenate([a, b.astype(a.dtype)])
    params = jax.tree.map(join, params, new_params)
    opt_state = jax.tree.map(join, opt_state, new_opt_state)
    if anchors is not None:
      anchors = jax.tree.map(join, anchors, new_params)
    if residuals is not None:  # new islands have sent nothing yet
      residuals = jax.tree.map(
          join, residuals, _zero_residuals(state.global_params, added))
  return state.replace(island_params=params, anchors=anchors,
                       inner_opt_state=opt_state, residuals=residuals)


def evaluation_params(state: TrainState, mode: str):
  """The params a run is judged by: x for DiLoCo, island 0's otherwise.

  `single` has one island and `ddp` keeps its islands identical, so island 0
  is their model. Call inside jit so XLA moves the slice where it is needed.
  """
  if mode == "diloco":
    return state.global_params
  return jax.tree.map(lambda y: y[0], state.island_params)


def island_mean_params(state: TrainState):
  """The plain average of the island params (what FedAvg would serve).

  Evaluated just before an outer step, it is the counterpart of the global
  params after it: Streaming DiLoCo found the outer params evaluate better.
  Computing it is a full-precision mean over the islands: one fp32
  all-reduce of the params across the island link.
  """
  return jax.tree.map(lambda y: jnp.mean(y, axis=0), state.island_params)


def make_evaluate(loss_fn: LossFn, mode: str):
  """Builds evaluate(state, batch) -> mean loss of `evaluation_params`.

  The eval batch is split over the islands. DiLoCo's x is on every island
  already. ddp and single keep their islands identical, so each island
  scores its own share with its own params: island 0's params never cross
  the island link (a slice y[0] would send them to every other island, a
  full copy of the model per eval batch), only the per-island losses do.
  """

  def evaluate(state: TrainState, batch: jax.Array) -> jax.Array:
    if mode == "diloco":
      return loss_fn(state.global_params, batch)
    islands = num_islands(state)
    shares = batch.reshape((islands, -1) + batch.shape[1:])
    return jnp.mean(jax.vmap(loss_fn)(state.island_params, shares))

  return jax.jit(evaluate)


def make_evaluate_island_mean(loss_fn: LossFn):
  """Builds evaluate(state, batches) -> the islands' average's mean loss
  over a tuple of eval batches.

  One program for all the batches, so the average (an fp32 all-reduce of
  the params) crosses the island link once per evaluation, not once per
  batch.
  """

  def evaluate(state: TrainState, batches) -> jax.Array:
    params = island_mean_params(state)
    return jnp.mean(jnp.stack([loss_fn(params, b) for b in batches]))

  return jax.jit(evaluate)
