"""The outer step: the islands' pseudo-gradients averaged across the island
link, the outer optimizer's step on x, and the islands reset for the next
round.

It is built from pure pieces that run wherever the outer side lives:
island_sync.py (each island's part of the collective through the codec),
`receive` (a round's mean into the outer side's state), `apply_in_flight`
(the delayed mean applied), `eager_islands` (eager updates: each island's
own outer step) and `next_round` (the islands set up again).
`make_outer_step` and `make_flush` compose them into one compiled program
on the compute devices; with config.diloco.outer_placement='host' the run
layer runs the same pieces on devices of their own. overlap.py states the
overlap rules they follow.
"""

import jax
import jax.numpy as jnp
import optax

from diloco_jax.algorithm import island_sync as island_sync_lib
from diloco_jax.algorithm import overlap as overlap_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.algorithm.state import TrainState
from diloco_jax.parallel.mesh import STAGE
from diloco_jax.parallel.stages import per_stage


def keep_unless(changed, new, old):
  """`new` where the scalar bool `changed` holds, else `old` (leafwise)."""
  return jax.tree.map(lambda n, o: jnp.where(changed, n, o), new, old)


def outer_update(outer_opt, global_params, outer_opt_state, update,
                 takes_effect, stages: int = 1):
  """(x, outer state) after the outer optimizer's step on `update`, or both
  unchanged when `takes_effect` is False (momentum alone would move x).
  With `stages` > 1 (staged trees) each stage steps its own layers with
  its own outer state."""
  def step(x, opt_state, update):
    updates, new_state = outer_opt.update(update, opt_state, x)
    return optax.apply_updates(x, updates), new_state

  new_global, new_state = per_stage(step, stages)(global_params,
                                                  outer_opt_state, update)
  return (keep_unless(takes_effect, new_global, global_params),
          keep_unless(takes_effect, new_state, outer_opt_state))


def receive(outer_opt: optax.GradientTransformation, sync, delayed: bool,
            outer: TrainState, island_params, weights, reference,
            stages: int = 1):
  """A round's pseudo-gradients into the outer side's state (traceable).

  `outer` needs x and the outer fields only (not the islands'); `sync` is
  make_island_sync's, `reference` the x the islands started the round from
  or, with the rebasing delay, their anchors. The mean goes through the
  codec (its state and the residuals advance, unless no island took part)
  and then either steps x with the outer optimizer or, `delayed`, waits in
  flight for apply_in_flight.

  Returns:
    (outer, included, finite): the new outer state, with its round counted;
    per island whether it took part in the mean and whether its
    pseudo-gradient was finite.
  """
  mean, residuals, codec_state, included, finite = sync(
      reference, island_params, outer.residuals, outer.codec_state, weights,
      outer.round)
  anyone = jnp.any(included)
  outer = outer.replace(
      residuals=residuals, round=outer.round + 1,
      # With no island taking part, the codec state stays as it was.
      codec_state=keep_unless(anyone, codec_state, outer.codec_state))
  if delayed:
    return outer.replace(
        in_flight=jax.tree.map(lambda m: m.astype(jnp.float32), mean),
        in_flight_valid=anyone), included, finite
  # The outer optimizer runs once per device on the replicated x, not once
  # per folded island.
  x, outer_state = outer_update(outer_opt, outer.global_params,
                                outer.outer_opt_state, mean, anyone, stages)
  return (outer.replace(global_params=x, outer_opt_state=outer_state),
          included, finite)


def apply_in_flight(outer_opt: optax.GradientTransformation,
                    outer: TrainState, stages: int = 1) -> TrainState:
  """One-step delay: x steps on the mean in flight, which is then spent
  (traceable; `outer` needs x and the outer fields only)."""
  x, outer_state = outer_update(outer_opt, outer.global_params,
                                outer.outer_opt_state, outer.in_flight,
                                outer.in_flight_valid, stages)
  return outer.replace(
      global_params=x, outer_opt_state=outer_state,
      in_flight=jax.tree.map(jnp.zeros_like, outer.in_flight),
      in_flight_valid=jnp.zeros((), jnp.bool_))


def eager_islands(outer_opt: optax.GradientTransformation,
                  state: TrainState, landed, landed_valid, weights,
                  sends: jax.Array, stages: int = 1,
                  own_weight: float | None = None,
                  waited=None) -> TrainState:
  """Eager updates: every island's own outer step (traceable).

  Island m steps its x_m (its anchor, where its round started) with its
  own outer state on D~_m = D(r-1) - u_m(r-1) + u_m(r) (overlap.py):
  `landed` is D(r-1), the mean that has had this round to arrive (with
  `landed_valid`, whether it holds one), u_m(r-1) the share kept in
  `state`, and u_m(r) its fresh pseudo-gradient x_m - y_m weighted by
  `weights` [islands] (or by `own_weight`, if set) if it is in `sends`
  [islands] (it has weight and a finite pseudo-gradient). An island whose
  D~_m is exactly zero (no mean landed and no share of its own) keeps its
  x_m and outer state: momentum alone would move it.

  `waited` = (blocking, D(r), valid): in a warm-up round (`blocking`, a
  traced bool) every island steps on its round's own mean D(r) instead
  (overlap.block_on_mean).

  Returns `state` with x_m(r) as the anchors (where next_round starts
  the islands), the islands' outer states and u_m(r).
  """
  anchors, outer_states, shares = eager_steps(
      outer_opt, state.anchors, state.island_params,
      state.island_outer_opt_state, state.own_shares, landed, landed_valid,
      weights, sends, stages, own_weight, waited)
  return state.replace(anchors=anchors, island_outer_opt_state=outer_states,
                       own_shares=shares)


def eager_steps(outer_opt: optax.GradientTransformation, points,
                island_params, outer_states, old_shares, landed,
                landed_valid, weights, sends, stages: int = 1,
                own_weight: float | None = None, waited=None,
                total_weight=None):
  """Eager updates' rule on stacked islands [islands, ...] (see
  eager_islands): each island's point x_m steps with its own outer state
  on D(r-1) - u_m(r-1) + u_m(r), u_m(r) from its fresh pseudo-gradient
  x_m - y_m. Returns (points, outer_states, shares u_m(r)).
  `total_weight`: the islands' total weight where `weights` are only some
  of them (default their sum)."""
  pseudo_grads = jax.tree.map(
      lambda a, y: a.astype(jnp.float32) - y.astype(jnp.float32),
      points, island_params)
  shares = overlap_lib.own_shares(pseudo_grads, weights, sends, own_weight,
                                  total_weight)
  updates = overlap_lib.eager_updates(landed, landed_valid, old_shares,
                                      shares)
  if waited is not None:
    updates, shares = overlap_lib.block_on_mean(*waited, updates, shares)
  points, outer_states = island_outer_steps(outer_opt, points, outer_states,
                                            updates, stages)
  return points, outer_states, shares


def eager_last_steps(outer_opt: optax.GradientTransformation, points,
                     outer_states, shares, in_flight, in_flight_valid,
                     stages: int = 1):
  """The end of an eager run on stacked islands: the last mean lands and
  each island steps its point on the rest of it, D(R) - u_m(R) (exactly
  zero with one island). Returns (points, outer_states)."""
  updates = overlap_lib.eager_updates(
      in_flight, in_flight_valid, shares,
      jax.tree.map(jnp.zeros_like, shares))
  return island_outer_steps(outer_opt, points, outer_states, updates, stages)


def island_outer_steps(outer_opt: optax.GradientTransformation, points,
                       outer_states, updates, stages: int = 1):
  """(x_m, outer states) [islands, ...] after every island's own outer step
  from its point x_m on its `updates` (eager updates); an island whose
  update is zero does not step (momentum alone would move it)."""
  def one_island(x, opt_state, update):
    moves = jnp.any(jnp.stack([jnp.any(u != 0)
                               for u in jax.tree.leaves(update)]))
    return outer_update(outer_opt, x, opt_state, update, moves, stages)

  return jax.vmap(one_island)(points, outer_states, updates)


def settle_eager(outer_opt: optax.GradientTransformation,
                 state: TrainState, stages: int = 1) -> TrainState:
  """The end of an eager run (traceable): the last mean lands and each
  island steps its point on the rest of it, D(R) - u_m(R) (the rule's
  next round, with no share of its own; exactly zero with one island).
  Then every island, x and the outer state become the islands' average
  (state.eager_consensus), so the islands agree again and a run extended later
  starts anew; the slot in flight and the shares are spent."""
  anchors, outer_states = eager_last_steps(
      outer_opt, state.anchors, state.island_outer_opt_state,
      state.own_shares, state.in_flight, state.in_flight_valid, stages)
  state = state.replace(anchors=anchors, island_outer_opt_state=outer_states)
  x, outer_state = state_lib.eager_consensus(state)
  islands = state_lib.num_islands(state)
  return state.replace(
      global_params=x, outer_opt_state=outer_state,
      anchors=state_lib.stack_islands(x, islands),
      island_outer_opt_state=state_lib.stack_islands(outer_state, islands),
      own_shares=jax.tree.map(jnp.zeros_like, state.own_shares),
      in_flight=jax.tree.map(jnp.zeros_like, state.in_flight),
      in_flight_valid=jnp.zeros((), jnp.bool_))


def next_round(state: TrainState, x, restart: jax.Array, keep: jax.Array,
               inner_opt: optax.GradientTransformation | None = None,
               stages: int = 1) -> TrainState:
  """`state` with x and every island set up for the next round (traceable).

  Every island starts from x; with anchors (the rebasing delay) an island
  in `keep` [islands] starts from x plus its progress (overlap.rebase);
  with eager updates each island starts from its own x_m, its anchor
  (set by `eager_islands`).
  Given `inner_opt`, islands in `restart` [islands] also get a fresh inner
  optimizer state, counted from the current step so the learning rate
  schedule goes on (one per stage of a staged state of `stages`).
  """
  inner_opt_state = state.inner_opt_state
  islands = state_lib.num_islands(state)
  if inner_opt is not None:
    inner_opt_state = state_lib.restart_inner_states(
        inner_opt, inner_opt_state, state_lib.stack_islands(x, islands),
        state.step, restart, stages)
  if state.anchors is None:
    island_params, anchors = state_lib.stack_islands(x, islands), None
  elif state.own_shares is not None:  # eager: from x_m
    island_params, anchors = state.anchors, state.anchors
  else:
    island_params, anchors = overlap_lib.rebase(
        state.island_params, state.anchors, x, keep)
  return state.replace(global_params=x, island_params=island_params,
                       anchors=anchors, inner_opt_state=inner_opt_state)


def make_outer_step(outer_opt: optax.GradientTransformation, mesh,
                    compression=None, rounding_seed: int | None = None,
                    fsdp: bool = False,
                    inner_opt: optax.GradientTransformation | None = None,
                    restart_dropped: bool = False, overlap: str = "none",
                    reset_inner: bool = False,
                    eager_own_weight: float | None = None,
                    warmup_rounds: int = 0):
  """Builds the jitted outer step: one program holding the collective.

  `compression` (a compression.Compression, a dense codec, or None for
  fp32) says how pseudo-gradients cross the island link; its codec state,
  if any, lives in the TrainState. When the state carries residuals, error
  feedback adds each island's residual to its pseudo-gradient and keeps
  what the codec did not send. With `rounding_seed` the codec rounds
  stochastically, with noise derived from (seed, round, island) so a
  resumed run draws the same noise.

  With `fsdp` (params split over each island's 'data' devices) each device
  reduces its own shards across islands (dense codecs only).

  An island with weight 0 (not synced this round) or a non-finite
  pseudo-gradient (it diverged) is left out of the mean: masked before any
  arithmetic, so NaN never reaches x; it keeps its error-feedback residual
  and, like every island, restarts from the new x; given `inner_opt`, a
  diverged island also restarts with a fresh inner optimizer state (its
  moments are not finite either), counted from the current step so the
  learning rate schedule goes on; with `restart_dropped` so does an island
  with weight 0 (config.diloco.dropped_islands='idle': it rejoins fresh),
  and with `reset_inner` every island (config.diloco.inner_state='reset').
  If no island takes part, x, the outer state and the codec state stay.

  `overlap` picks the rule algorithm/overlap.py states. The delayed modes
  leave round r's mean D(r) in flight (state.in_flight) and apply it a
  round later: 'one_step_delay' restarts every island from x_r,
  'one_step_delay_rebase' from x_r plus its own progress since its anchor
  (overlap.rebase; an island left out of the mean from x_r alone), and
  'eager' and 'eager_share' step each island's own point at once
  (`eager_islands`; its own part weighted by `eager_own_weight`, 1 if None,
  or its share of the mean; the first `warmup_rounds` rounds wait for
  their own mean); a diverged island then starts from its own point with
  a fresh inner state, and x, the islands' average point
  (state.eager_consensus), is formed only to evaluate and at the end.
  Round 0 applies nothing; make_flush applies the last mean at the end.

  Returns:
    outer(state, weights) -> state, where `weights` [islands] are the islands'
    weights in the mean (tokens processed this round). `state` is donated.
  """
  delayed = overlap_lib.is_delayed(overlap)
  anchored = overlap_lib.anchored(overlap)
  eager = overlap_lib.is_eager(overlap)
  own_weight = overlap_lib.own_weight(overlap, eager_own_weight)
  stages = mesh.shape[STAGE]
  sync = island_sync_lib.make_island_sync(
      mesh, compression, rounding_seed, fsdp, reference_per_island=anchored)

  def outer(state: TrainState, weights: jax.Array):
    # s_r (or the anchors), before a delayed mean moves x to x_r.
    reference = state.anchors if anchored else state.global_params
    landed, landed_valid = state.in_flight, state.in_flight_valid
    warming_up = state.round < warmup_rounds  # before receive counts it
    if delayed and not eager:
      state = apply_in_flight(outer_opt, state, stages)
    state, included, finite = receive(outer_opt, sync, delayed, state,
                                      state.island_params, weights, reference,
                                      stages)
    if eager:
      waited = ((warming_up, state.in_flight, state.in_flight_valid)
                if warmup_rounds else None)
      state = eager_islands(outer_opt, state, landed, landed_valid, weights,
                            finite & (weights > 0), stages, own_weight, waited)
    restart = state_lib.restart_islands(finite, weights, restart_dropped,
                                        reset_inner)
    state = next_round(state, state.global_params, restart, included,
                       inner_opt, stages)
    # The state keeps its declared layout, so the compiled steps take it.
    return state_lib.constrain_state(state, mesh, fsdp)

  return jax.jit(outer, donate_argnums=0)


def make_flush(outer_opt: optax.GradientTransformation, mesh,
               fsdp: bool = False):
  """Builds the jitted end of a one-step-delay run: flush(state) -> state.

  The mean still in flight after the last round is received and applied
  (x_R = OuterOpt(x_{R-1}, D(R - 1))), every island is set to the final x
  (with the rebasing delay, its anchor too: the last round's progress is
  in x_R), and the slot is emptied, so a run extended later starts its
  delay anew. With eager updates the islands settle instead
  (`settle_eager`). `state` is donated.
  """
  stages = mesh.shape[STAGE]

  def flush(state: TrainState) -> TrainState:
    if state.own_shares is not None:  # eager updates
      state = settle_eager(outer_opt, state, stages)
    else:
      state = apply_in_flight(outer_opt, state, stages)
    nobody = jnp.zeros((state_lib.num_islands(state),), jnp.bool_)
    state = next_round(state, state.global_params, nobody, nobody)
    return state_lib.constrain_state(state, mesh, fsdp)

  return jax.jit(flush, donate_argnums=0)
