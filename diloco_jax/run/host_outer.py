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
(FragmentOuter), as the compiled on-device programs; the islands' side of
the state then carries no outer fields (`strip`), and `assemble` puts them
back for a checkpoint, which stays the same pytree whichever the placement.
"""

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.algorithm import guards
from diloco_jax.algorithm import island_sync as island_sync_lib
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import overlap as overlap_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel import placement
from diloco_jax.parallel.outer_devices import move
from diloco_jax.run import stage_fragments
# The outer fields, and the base every outer side extends.
from diloco_jax.run.outer_side import OUTER_FIELDS, OuterSide, outer_part, strip  # pylint: disable=unused-import

class RoundOuter(OuterSide):
  """DiLoCo's outer step on the outer devices: at a round's end the
  islands' params (and anchors) go out, the collective and the outer
  optimizer run there, and x comes back."""

  def __init__(self, mesh, islands: int, compute_mesh, *,
               outer_opt: optax.GradientTransformation, sync,
               inner_opt: optax.GradientTransformation, overlap: str,
               restart_dropped: bool, fsdp: bool,
               reset_inner: bool = False,
               eager_own_weight: float | None = None,
               warmup_rounds: int = 0):
    """`sync`: outer_step.make_island_sync's on `mesh`; `eager_own_weight`
    and `warmup_rounds`: config.diloco.eager_own_weight and
    overlap_defaults.warmup_rounds."""
    super().__init__(mesh, islands, compute_mesh, fsdp)
    self._delayed = overlap_lib.is_delayed(overlap)
    self._anchored = overlap_lib.anchored(overlap)
    self._eager = overlap_lib.is_eager(overlap)
    self._warmup_rounds = warmup_rounds
    own_weight = overlap_lib.own_weight(overlap, eager_own_weight)
    stages = mesh.shape[mesh_lib.STAGE]  # each on outer devices of its own
    constrain = lambda outer: placement.constrain(
        outer, self._outer_shardings(outer))
    # The collective of the pseudo-gradients against `reference` (the x
    # the islands started the round from, or their anchors) and, without
    # the delay, the outer optimizer's step on its mean.
    self._send = jax.jit(lambda outer, island_params, weights, reference:
                         constrain(outer_step_lib.receive(
                             outer_opt, sync, self._delayed, outer,
                             island_params, weights, reference,
                             stages)[0]))
    self._apply = jax.jit(lambda outer: constrain(
        outer_step_lib.apply_in_flight(outer_opt, outer, stages)))

    def reset(state, x, restart, keep, ends_round):
      """The islands' side for the next round (outer_step.next_round)."""
      state = outer_step_lib.next_round(state, x, restart, keep,
                                        inner_opt, stages).replace(
                                            round=state.round
                                            + int(ends_round))
      return state_lib.constrain_state(state, compute_mesh, fsdp)

    def eager_reset(state, landed, landed_valid, weights, restart, keep,
                    waited):
      """Eager updates: the islands' own outer steps on the mean that
      landed (in the warm-up, on the round's own mean they `waited` for),
      then the next round (x is not formed in a round)."""
      state = outer_step_lib.eager_islands(outer_opt, state, landed,
                                           landed_valid, weights, keep,
                                           stages, own_weight=own_weight,
                                           waited=waited)
      return reset(state, state.global_params, restart, keep, True)

    def settle(state, landed, landed_valid, outer_state):
      """The end of an eager run, on the islands (outer_step.settle_eager;
      the outer state comes along to take the islands' average)."""
      state = outer_step_lib.settle_eager(outer_opt, state.replace(
          in_flight=landed, in_flight_valid=landed_valid,
          outer_opt_state=outer_state), stages)
      return state_lib.constrain_state(state, compute_mesh, fsdp)

    self._reset = jax.jit(reset, donate_argnums=0, static_argnums=4)
    self._eager_reset = jax.jit(eager_reset, donate_argnums=0)
    self._settle = jax.jit(settle, donate_argnums=0)
    self._spend = jax.jit(lambda outer, x, outer_state: constrain(
        outer.replace(
            global_params=x, outer_opt_state=outer_state,
            in_flight=jax.tree.map(jnp.zeros_like, outer.in_flight),
            in_flight_valid=jnp.zeros((), jnp.bool_))))
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
    reference = (islands_state.anchors if self._anchored
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
      reference = move(state.anchors, self._island_trees)
    else:  # s_r, the x this round started from
      reference = self._outer.global_params
    if self._eager:
      # D(r - 1), which has had this round to arrive, goes to the islands;
      # the new collective is queued on the outer devices, which the
      # islands' next round does not wait for.
      landed, landed_valid = self._landed()
      self._outer = self._send(self._outer, island_params, outer_weights,
                               reference)
      # In the warm-up the islands wait for this round's own mean.
      waited = ((jnp.ones((), bool),) + self._landed()
                if self._warming_up(state) else None)
      return self._eager_reset(state, landed, landed_valid, weights,
                               restart, keep, waited)
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
      # x and the outer state go back to the outer side.
      landed, landed_valid = self._landed()
      outer_state = move(self._outer.outer_opt_state,
                         self._compute_shardings.outer_opt_state)
      state = self._settle(state, landed, landed_valid, outer_state)
      targets = self._outer_shardings(self._outer)
      self._outer = self._spend(
          self._outer, move(state.global_params, targets.global_params),
          move(state.outer_opt_state, targets.outer_opt_state))
      return self._reset(strip(state), state.global_params, nobody, nobody,
                         False)
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
    return (move(self._outer.in_flight, self._x_shardings),
            move(self._outer.in_flight_valid,
                 self._compute_shardings.in_flight_valid))


class FragmentOuter(OuterSide):
  """Streaming DiLoCo's sends on the outer devices: each fragment's island
  leaves go out, its collective and outer step run there while the islands
  train, and its merge takes the fragment's x back (`fragment_x`)."""

  def __init__(self, mesh, islands: int, compute_mesh, *,
               outer_opt: optax.GradientTransformation, sync, compression,
               fragments: int, fsdp: bool):
    super().__init__(mesh, islands, compute_mesh, fsdp)
    self._send_parts = fragments_lib.make_send_parts(outer_opt, sync)
    self._compression = compression_lib.as_compression(compression)
    self._fragments = fragments
    # Per fragment, its jitted send, and where its leaves sit among the
    # params and the codec state (built from the state's layout).
    self._fragment_sends = self._assignment = self._positions = None

  def load(self, state: state_lib.TrainState) -> state_lib.TrainState:
    islands_side = super().load(state)
    self._build_fragment_sends(self._outer)
    return islands_side

  def _build_fragment_sends(self, outer) -> None:
    """Per fragment, send(parts, island_leaves, weights, step) -> parts on
    the outer devices, for the layout of `outer` (the outer side's state,
    concrete or abstract). Each takes and gives its fragment's parts only,
    so a send in flight holds up no other fragment's merge."""
    if self._fragment_sends is not None:
      return
    params = outer.global_params
    self._assignment = fragments_lib.leaf_fragments(params, self._fragments)
    self._positions = [fragments_lib.codec_positions(
        params, self._compression, self._assignment, p)
                       for p in range(self._fragments)]
    shardings = self._outer_shardings(outer)

    def send(fragment, parts, island_leaves, weights, step):
      return self._send_parts(
          parts, island_leaves, weights,
          fragments_lib.send_index(step, self._fragments, fragment))

    self._fragment_sends = [
        jax.jit(functools.partial(send, p),
                out_shardings=self._parts(shardings, p))
        for p in range(self._fragments)]

  def _parts(self, outer, fragment: int) -> fragments_lib.FragmentParts:
    return fragments_lib.fragment_parts(outer, self._assignment,
                                        self._positions[fragment], fragment)

  def compile_in_background(self, state) -> None:
    outer = outer_part(state)
    self._build_fragment_sends(placement.with_shardings(
        outer, self._outer_shardings(outer)))
    super().compile_in_background(state)

  def _compile_all(self, outer, islands_state, weights) -> dict:
    step = jax.ShapeDtypeStruct(islands_state.step.shape,
                                islands_state.step.dtype,
                                sharding=NamedSharding(self.mesh, P()))
    return {"_fragment_sends": [
        send.lower(self._parts(outer, p),
                   fragments_lib.select(islands_state.island_params,
                                        self._assignment, p),
                   weights, step).compile()
        for p, send in enumerate(self._fragment_sends)]}

  @property
  def sends(self) -> tuple:
    """Per fragment, send(state, weights) -> state. The fragment's island
    leaves go out and its collective and outer step are queued on the
    outer devices; the islands' side comes back unchanged (its merge folds
    the new x in, from `fragment_x`)."""
    return tuple(functools.partial(self._send_fragment, p)
                 for p in range(self._fragments))

  def _send_fragment(self, fragment: int, state: state_lib.TrainState,
                     weights: jax.Array) -> state_lib.TrainState:
    self._use_compiled()
    parts = self._fragment_sends[fragment](
        self._parts(self._outer, fragment),
        move(fragments_lib.select(state.island_params, self._assignment,
                                  fragment), self._on_islands),
        move(weights, self._on_islands),
        move(state.step, NamedSharding(self.mesh, P())))
    self._outer = fragments_lib.with_fragment_parts(
        self._outer, self._assignment, self._positions[fragment], fragment,
        parts)
    return state

  def fragment_x(self, fragment: int) -> list:
    """The fragment's leaves of x on the compute devices, for its merge
    (they arrive once its send is done)."""
    select = functools.partial(fragments_lib.select,
                               assignment=self._assignment, fragment=fragment)
    return move(select(self._outer.global_params),
                select(self._x_shardings))

  def current(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """The islands' side with the outer side's x (waits for the fragments
    in flight)."""
    return state.replace(global_params=self._x_on_compute())


def build(outer_devices, islands: int, compute_mesh,
          outer_opt: optax.GradientTransformation, compression,
          inner_opt: optax.GradientTransformation,
          rounding_seed: int | None = None, restart_dropped: bool = False,
          overlap: str = "none", fragments: int | None = None,
          fsdp: bool = False, reset_inner: bool = False,
          eager_own_weight: float | None = None,
          warmup_rounds: int = 0) -> OuterSide:
  """The outer side of a run with outer_placement='host' on
  `outer_devices` (one per process).

  `fragments`: P for Streaming DiLoCo (a FragmentOuter; None: DiLoCo's
  whole-model outer step, a RoundOuter). `fsdp`: the islands' arrays are
  split over their 'data' devices (config.mesh.fsdp); the outer side holds
  whole islands and encodes each in the same stripes as those devices
  would.
  """
  # With pipeline stages, one outer device per stage (per process): each
  # stage's x, outer state and collective on its own, never the whole
  # model on one device.
  mesh = mesh_lib.build_mesh(islands, 1, compute_mesh.shape[mesh_lib.STAGE],
                             outer_devices)
  stripes = compute_mesh.shape[mesh_lib.DATA] if fsdp else 1
  if fragments and mesh.shape[mesh_lib.STAGE] > 1:  # fragment s: stage s
    return stage_fragments.StageFragmentOuter(
        mesh, islands, compute_mesh, outer_opt=outer_opt,
        compression=compression, rounding_seed=rounding_seed,
        stripes=stripes, fsdp=fsdp)
  sync = island_sync_lib.make_island_sync(
      mesh, compression, rounding_seed, stripes=stripes,
      reference_per_island=overlap_lib.anchored(overlap))
  if fragments:
    return FragmentOuter(mesh, islands, compute_mesh,
                         outer_opt=outer_opt, sync=sync,
                         compression=compression, fragments=fragments,
                         fsdp=fsdp)
  return RoundOuter(mesh, islands, compute_mesh, outer_opt=outer_opt,
                    sync=sync, inner_opt=inner_opt, overlap=overlap,
                    restart_dropped=restart_dropped, fsdp=fsdp,
                    reset_inner=reset_inner,
                    eager_own_weight=eager_own_weight,
                    warmup_rounds=warmup_rounds)
