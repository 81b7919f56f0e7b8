"""The outer side on devices of its own (config.diloco.outer_placement).

  'device'  x, the outer optimizer state, the codec's state and the
            cross-island collective live on the compute devices, and a
            round ends with one compiled program holding all of it
            (algorithm/outer_step.py).
  'host'    they live on one other device per process
            (parallel/outer_devices.py): the host's CPU device beside GPUs
            or TPUs (DiLoCo and OpenDiLoCo keep the outer state in host
            memory, off the accelerator), or a CPU device set aside on
            CPU-only hosts. The islands' params cross to it at a round's
            end (FSDP islands' shards gathered from their devices) and the
            new x comes back.

XLA runs one device's programs in order, so a collective on the compute
devices waits for the inner steps queued there and they wait for it. On a
device of its own, the collective of a round with
overlap='one_step_delay' runs while the islands train the next round: the
next round needs only x_r, which depends on the previous round's mean,
already arrived. With 'one_step_delay_rebase' the islands' anchors cross
too (the pseudo-gradients are taken against them) but stay with the
islands, which rebase their progress onto x_r themselves. With 'eager' the
anchors cross the same way, and the mean that has landed (not x_r) comes
back: the islands step their own outer points and states, which stay with
them, at home.

Streaming DiLoCo's sends go there the same way, one fragment at a time:
only that fragment's island leaves cross, the collective and the outer
optimizer's step run on the outer devices while the islands train, and the
merge `fragment_delay` steps later takes the fragment's new x back.

`build` gives the loop an object with the same `outer_step(state,
weights)` and `flush(state)` (RoundOuter), or per-fragment `sends`
(host_fragments.FragmentOuter), as the compiled on-device programs; the islands' side of
the state then carries no outer fields (`strip`), and `assemble` puts them
back for a checkpoint, which stays the same pytree whichever the placement.
"""

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax.algorithm import guards
from diloco_jax.algorithm.island_mean import IslandMean
from diloco_jax.algorithm import island_sync as island_sync_lib
from diloco_jax.algorithm import outer as outer_lib
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.compiled import host_fragments
from diloco_jax.compiled import stage_sends
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel.outer_devices import move
from diloco_jax.parallel import placement
# The base every outer side extends, and the islands' side of a state.
from diloco_jax.compiled.outer_side import OuterSide, outer_part, strip  # pylint: disable=unused-import

class RoundOuter(OuterSide):
  """DiLoCo's outer step on the outer devices: at a round's end the
  islands' params (and anchors) go out, the collective and the outer
  object's x side (`land`, `take`) run there, x comes back, and the
  islands' side (`start`) runs on the islands' devices."""

  def __init__(self, mesh, islands: int, compute_mesh, *,
               algorithm: outer_lib.DiLoCo, sync,
               inner_opt: optax.GradientTransformation,
               restart_dropped: bool, fsdp: bool,
               reset_inner: bool = False):
    """`algorithm`: the run's outer object, whose parts run here (x's side,
    `land` and `take`, on the outer devices; the islands', `start`, on
    theirs); `sync`: outer_step.make_island_sync's on `mesh`."""
    super().__init__(mesh, islands, compute_mesh, fsdp)
    self._delayed = isinstance(algorithm.overlap, (
        outer_overlaps.OneStepDelay, outer_overlaps.Eager))
    self._anchored = algorithm.keeps_island_points
    self._eager = isinstance(algorithm.overlap, outer_overlaps.Eager)
    self._warmup_rounds = (algorithm.overlap.warmup_rounds if self._eager
                           else 0)
    stages = mesh.shape[mesh_lib.STAGE]  # each on outer devices of its own
    constrain = lambda outer: placement.constrain(
        outer, self._outer_shardings(outer))

    def send(outer, island_params, weights, reference):
      """The collective of the pseudo-gradients against `reference` (the
      x the islands started the round from, or their anchors) and the
      object's `take` of its mean (x steps, or it waits in flight)."""
      mean, residuals, codec_state, included, finite = sync(
          reference, island_params, outer.outer.residuals,
          outer.outer.codec_state, weights, outer.round)
      x, outer_state = algorithm.take(
          outer.global_params, outer.outer, IslandMean(
              mean, residuals, codec_state, included, finite,
              jnp.any(included)), stages=stages)
      return constrain(outer.replace(global_params=x, outer=outer_state))

    def land(outer):
      """The delay's x_r: x steps on the mean that has had this round to
      arrive."""
      x, outer_state = algorithm.land(outer.global_params, outer.outer,
                                      stages=stages)
      return constrain(outer.replace(global_params=x, outer=outer_state))

    self._send = jax.jit(send)
    self._apply = jax.jit(land)

    def reset(state, x, restart, keep, ends_round):
      """The islands' side for the next round (the object's `start`: from
      x, or rebased onto it), with fresh inner states for `restart`."""
      islands, outer_state = algorithm.start(x, state.island_params,
                                             state.outer, included=keep,
                                             stages=stages)
      if ends_round:  # the round counted, and who was in its mean
        outer_state = outer_state.replace(round=outer_state.round + 1,
                                          included=keep)
      state = outer_step_lib.start_islands(
          state.replace(outer=outer_state), x, islands, restart, inner_opt,
          stages)
      return state_lib.constrain_state(state, compute_mesh, fsdp)

    def eager_reset(state, landed, landed_valid, mean, mean_valid, weights,
                    restart, keep):
      """Eager updates: the islands' own outer steps (the object's
      `start`) on the mean that landed, or in a warm-up round on this
      round's `mean`; then the next round (x is not formed in a round)."""
      points, outer_state = algorithm.start(
          state.global_params, state.island_params,
          state.outer.replace(round=state.round + 1), included=keep,
          landed=(landed, landed_valid), mean=(mean, mean_valid),
          weights=weights, stages=stages)
      state = outer_step_lib.start_islands(
          state.replace(outer=outer_state.replace(round=state.round + 1,
                                                  included=keep)),
          state.global_params, points, restart, inner_opt, stages)
      return state_lib.constrain_state(state, compute_mesh, fsdp)

    def settle(state, landed, landed_valid):
      """The end of an eager run, on the islands (the object's `finish`):
      every island, x and the islands' outer states become their
      average."""
      update = algorithm.finish(
          state.global_params,
          state.outer.replace(in_flight=landed, in_flight_valid=landed_valid),
          stages=stages)
      state = state.replace(
          global_params=update.params, island_params=update.islands,
          outer=update.state.replace(in_flight=None, in_flight_valid=None))
      return state_lib.constrain_state(state, compute_mesh, fsdp)

    self._reset = jax.jit(reset, donate_argnums=0, static_argnums=4)
    self._eager_reset = jax.jit(eager_reset, donate_argnums=0)
    self._settle = jax.jit(settle, donate_argnums=0)
    self._spend = jax.jit(lambda outer, x: constrain(outer.replace(
        global_params=x, outer=outer.outer.replace(
            in_flight=jax.tree.map(jnp.zeros_like, outer.outer.in_flight),
            in_flight_valid=jnp.zeros((), jnp.bool_)))))
    def round_masks(state, weights):
      """(restart, keep) [islands]: the islands that start the next round
      with a fresh inner state, and those in this round's mean."""
      finite = guards.islands_finite(state)
      return (state_lib.restart_islands(finite, weights, restart_dropped,
                                        reset_inner),
              finite & (weights > 0))

    self._round_masks = jax.jit(round_masks)
    self._end_round = jax.jit(functools.partial(reset, ends_round=True),
                              donate_argnums=0)
    # compile_in_background's abstract islands' side and weights, from
    # which the round end's compute-side programs compile.
    self._islands_abstract = None

  def compile_in_background(self, state) -> None:
    # The round end's programs on the islands' devices compile from the
    # state as the loop holds it (without the outer fields).
    weights = jax.ShapeDtypeStruct(
        (self._islands,), jnp.float32,
        sharding=NamedSharding(self._compute_mesh, P(mesh_lib.ISLAND)))
    x = placement.with_shardings(
        state.global_params, state_lib.state_shardings(
            outer_part(state), self._compute_mesh, self._fsdp).global_params)
    self._islands_abstract = (strip(state), weights, x)
    super().compile_in_background(state)

  def _compile_all(self, outer, islands_state, weights) -> dict:
    reference = (islands_state.outer.anchors if self._anchored
                 else outer.global_params)
    compiled = {"_send": self._send.lower(
        outer, islands_state.island_params, weights, reference).compile(),
                **self._compile_round_end()}
    if self._delayed and not self._eager:
      compiled["_apply"] = self._apply.lower(outer).compile()
    return compiled

  def _compile_round_end(self) -> dict:
    """The islands' side of a round end (its masks and, without eager
    updates, the next round's start), compiled so that the first round
    end waits for no compile."""
    state, weights, x = self._islands_abstract
    round_masks = self._round_masks.lower(state, weights).compile()
    if self._eager:
      return {"_round_masks": round_masks}
    mask = jax.ShapeDtypeStruct((self._islands,), bool,
                                sharding=round_masks.output_shardings[0])
    return {"_round_masks": round_masks,
            "_end_round": self._end_round.lower(state, x, mask,
                                                mask).compile()}

  def outer_step(self, state: state_lib.TrainState, weights: jax.Array):
    """The round's end: the islands' params go out, x comes back."""
    self._use_compiled()
    restart, keep = self._round_masks(state, weights)
    island_params = move(state.island_params, self._island_trees)
    outer_weights = move(weights, self._on_islands)
    if self._anchored:  # each island's a_i (eager: its x_m)
      reference = move(state.outer.anchors, self._island_trees)
    else:  # s_r, the x this round started from
      reference = self._outer.global_params
    if self._eager:
      # D(r - 1), which has had this round to arrive, goes to the islands;
      # the new collective is queued on the outer devices, which the
      # islands' next round does not wait for.
      landed, landed_valid = self._landed()
      self._outer = self._send(self._outer, island_params, outer_weights,
                               reference)
      # In the warm-up the islands wait for this round's own mean; past
      # it they step on the landed mean alone (this round's is not read).
      mean, mean_valid = (self._landed() if self._warming_up(state)
                          else (landed, landed_valid))
      return self._eager_reset(state, landed, landed_valid, mean,
                               mean_valid, weights, restart, keep)
    if self._delayed:
      # x_r from the mean that has had this round to arrive; the new
      # collective is queued after it, on the outer devices only, so the
      # islands' next round waits for x_r alone.
      self._outer = self._apply(self._outer)
      x = self._x_on_compute()
      self._outer = self._send(self._outer, island_params, outer_weights,
                               reference)
    else:
      self._outer = self._send(self._outer, island_params, outer_weights,
                               reference)
      x = self._x_on_compute()
    return self._end_round(state, x, restart, keep)

  def flush(self, state: state_lib.TrainState):
    """The end of a one-step-delay run: the last mean is applied."""
    self._use_compiled()
    nobody = jnp.zeros((state_lib.num_islands(state),), bool)
    if self._eager:
      # The last mean lands on the islands, which settle on their average;
      # x goes back to the outer side, the mean in flight spent.
      landed, landed_valid = self._landed()
      state = self._settle(state, landed, landed_valid)
      self._outer = self._spend(self._outer, move(
          state.global_params,
          self._outer_shardings(self._outer).global_params))
      return state
    self._outer = self._apply(self._outer)
    return self._reset(state, self._x_on_compute(), nobody, nobody, False)

  def _warming_up(self, state: state_lib.TrainState) -> bool:
    """Whether this round is one of the warm-up's, from this process's own
    copy of the replicated round count; once past it, never read again."""
    if self._warmup_rounds and (int(state.round.addressable_shards[0].data)
                                >= self._warmup_rounds):
      self._warmup_rounds = 0
    return self._warmup_rounds > 0

  def _landed(self):
    """The mean in flight (and whether it holds one), on the compute
    devices: eager islands step on it themselves."""
    return (move(self._outer.outer.in_flight, self._x_shardings),
            move(self._outer.outer.in_flight_valid,
                 self._compute_shardings.outer.in_flight_valid))


def build(outer_devices, islands: int, compute_mesh,
          algorithm: outer_lib.DiLoCo,
          inner_opt: optax.GradientTransformation,
          rounding_seed: int | None = None, restart_dropped: bool = False,
          fsdp: bool = False, reset_inner: bool = False) -> OuterSide:
  """The outer side of a run with outer_placement='host' on
  `outer_devices` (one per process), for the run's outer object
  `algorithm`.

  Streaming DiLoCo (a streaming overlap) gets a FragmentOuter (with
  pipeline stages, a StageFragmentOuter: fragment s is stage s); any other
  overlap DiLoCo's whole-model outer step, a RoundOuter. `fsdp`: the
  islands' arrays are split over their 'data' devices (config.mesh.fsdp);
  the outer side holds whole islands and encodes each in the same stripes
  as those devices would.
  """
  # With pipeline stages, one outer device per stage (per process): each
  # stage's x, outer state and collective on its own, never the whole
  # model on one device.
  mesh = mesh_lib.build_mesh(islands, 1, compute_mesh.shape[mesh_lib.STAGE],
                             outer_devices)
  stripes = compute_mesh.shape[mesh_lib.DATA] if fsdp else 1
  streaming = isinstance(algorithm.overlap, outer_overlaps.Streaming)
  if streaming and mesh.shape[mesh_lib.STAGE] > 1:  # fragment s: stage s
    return stage_sends.StageFragmentOuter(
        mesh, islands, compute_mesh, outer=algorithm,
        rounding_seed=rounding_seed, stripes=stripes, fsdp=fsdp)
  sync = island_sync_lib.make_island_sync(
      mesh, algorithm.codec, rounding_seed, stripes=stripes,
      reference_per_island=algorithm.keeps_island_points)
  if streaming:
    return host_fragments.FragmentOuter(
        mesh, islands, compute_mesh, outer=algorithm, sync=sync, fsdp=fsdp)
  return RoundOuter(mesh, islands, compute_mesh, algorithm=algorithm,
                    sync=sync, inner_opt=inner_opt,
                    restart_dropped=restart_dropped, fsdp=fsdp,
                    reset_inner=reset_inner)
