"""DiLoCo's outer algorithm as one object, in optax's manner.

    outer = diloco(codec=codec("int8"), overlap=one_step_delay())
    state = outer.init(x, num_islands=k)
    for each round:
      ... every island trains H inner steps from islands[i] ...
      x, islands, state = outer.update(x, islands, state)
    x, islands, state = outer.finish(x, state)

`diloco(outer_tx, codec, overlap, error_feedback)` fixes the outer step
(outer_overlaps.py: the overlaps and their measured outer optimizers); its
state (outer_state.py) holds what changes from round to round and
remembers which object made it, so nothing is given twice. Every runtime
runs it: outer_step.py, compiled/host_outer.py, the elastic coordinator.
Results that arrive one at a time (asynchronous islands) are summed in
windows: `open_window`, `arrival_mean`, `add_arrival` (outer_windows.py).

Every call works stacked (islands' trees [k, ...], `init(x, k)`,
axis_name=None) and per island (inside shard_map: one island's trees,
`init(x)` or `this_island` of a stacked state, axis_name the islands'
axis; library_specs.island_specs split a stacked state over it).
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.algorithm import island_mean as island_mean_lib
from diloco_jax.algorithm import island_trees
from diloco_jax.algorithm import library_checks
from diloco_jax.algorithm import outer_checks
from diloco_jax.algorithm import outer_eager
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.algorithm import outer_rules
from diloco_jax.algorithm import outer_state
from diloco_jax.algorithm import outer_windows
from diloco_jax.algorithm import overlap as overlap_lib
from diloco_jax.algorithm import streaming_rules

# The state and what update returns, beside the object that makes them.
OuterState = outer_state.OuterState
Update = outer_state.Update


@dataclasses.dataclass(frozen=True)
class DiLoCo:
  """One outer algorithm: build it with `diloco(...)`.

  Attributes:
    outer_tx: the outer optimizer.
    codec: what crosses the link.
    overlap: how the step meets the islands' training.
    error_feedback: whether each island keeps what its codec left unsent.
  """
  outer_tx: optax.GradientTransformation
  codec: compression_lib.Compression
  overlap: outer_overlaps.Overlap
  error_feedback: bool

  @property
  def keeps_island_points(self) -> bool:
    """Whether each island starts its rounds from a point of its own (the
    delay with rebase, eager updates) rather than x."""
    return self._eager or (isinstance(self.overlap,
                                      outer_overlaps.OneStepDelay)
                           and self.overlap.rebase)

  def without_error_feedback(self) -> "DiLoCo":
    """This algorithm, its residuals kept elsewhere (on the islands)."""
    return dataclasses.replace(self, error_feedback=False)

  @property
  def _streaming(self) -> bool:
    return isinstance(self.overlap, outer_overlaps.Streaming)

  @property
  def _eager(self) -> bool:
    return isinstance(self.overlap, outer_overlaps.Eager)

  @property
  def _delayed(self) -> bool:
    return isinstance(self.overlap, (outer_overlaps.OneStepDelay,
                                     outer_overlaps.Eager))

  def init(self, params, num_islands: int | None = None, *,
           seed: int = 0) -> OuterState:
    """The state before the first round, for the global `params` x:
    stacked for `num_islands` k islands, or one island's with None (the
    per-island form). `seed` seeds the codec's initial state (low-rank
    bases)."""
    library_checks.check_num_islands(num_islands, "init")
    per_island = ((lambda tree: tree) if num_islands is None else
                  (lambda tree: island_trees.stack_islands(tree, num_islands)))
    zeros32 = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32),
                           params)
    assignment = None
    if self._streaming:
      assignment, outer_opt_state = streaming_rules.init_fragments(
          params, self.overlap, self.outer_tx)
    elif self._eager:
      outer_opt_state = (self.outer_tx.init(params) if num_islands is None
                         else jax.vmap(self.outer_tx.init)(
                             per_island(params)))
    else:
      outer_opt_state = self.outer_tx.init(params)
    return OuterState(
        round=jnp.zeros((), jnp.int32),
        included=per_island(jnp.ones((), bool)),
        outer_opt_state=outer_opt_state,
        codec_state=island_trees.init_codec_state(params, self.codec, seed),
        residuals=(per_island(jax.tree.map(jnp.zeros_like, params))
                   if self.error_feedback else None),
        in_flight=zeros32 if self._delayed else None,
        in_flight_valid=jnp.zeros((), bool) if self._delayed else None,
        anchors=per_island(params) if self.keeps_island_points else None,
        own_shares=per_island(zeros32) if self._eager else None,
        recipe=self._recipe(assignment))

  def update(self, params, island_params, state: OuterState, *,
             weights=None, key: jax.Array | None = None,
             axis_name: str | None = None,
             fragment: int | None = None) -> Update:
    """A round's end (streaming: one fragment's send).

    Args:
      params: x, the global params.
      island_params: the islands after their inner steps ([k, ...]
        stacked, this island's with `axis_name`).
      state: from `init` or the previous call.
      weights: per island ([k], or this island's scalar), e.g. the tokens
        it trained; 0 leaves an island out of the mean (so does a
        pseudo-gradient that is not finite). Default: all 1.
      key: PRNG key for the codec's stochastic rounding, or None.
      axis_name: None for stacked islands, else the islands' axis name
        (inside shard_map or pmap).
      fragment: streaming only: the fragment to send (a Python int).

    Returns:
      Update(params, islands, state). Streaming: x with the fragment
      stepped, and the islands with it merged at once (fragment_delay 0)
      or as they were (merge it later with `merge`).
    """
    outer_checks.check_update(self, params, island_params, state, weights,
                              axis_name, fragment, "update")
    return self.apply(params, island_params, state,
                      self.mean(params, island_params, state,
                                weights=weights, key=key,
                                axis_name=axis_name, fragment=fragment),
                      weights=weights, axis_name=axis_name,
                      fragment=fragment)

  def mean(self, params, island_params, state: OuterState, *, weights=None,
           key: jax.Array | None = None, axis_name: str | None = None,
           fragment: int | None = None) -> island_mean_lib.IslandMean:
    """The round's collective alone: the islands' weighted mean of their
    pseudo-gradients (against x, or their anchors) through the codec,
    with error feedback. Streaming: over `fragment`'s leaves only (a list
    in leaf order), with its residuals and codec state. `apply` takes it
    from there; `update` is the two."""
    outer_checks.check_state(self, state, "mean")
    own = self.keeps_island_points
    reference = state.anchors if own else params
    residuals, codec_state = state.residuals, state.codec_state
    if fragment is not None:
      outer_checks.check_fragment_of(self, fragment, "mean")
      parts = fragments_lib.fragment_parts(params, state, fragment)
      reference, residuals, codec_state = (parts.x, parts.residuals,
                                           parts.codec_state)
      island_params = fragments_lib.select(
          island_params, state.recipe.assignment, fragment)
    return island_mean_lib.island_mean(
        reference, island_params, weights=weights, residuals=residuals,
        codec_state=codec_state, compression=self.codec,
        axis_name=axis_name, key=key, stacked_reference=own)

  def apply(self, params, island_params, state: OuterState,
            synced: island_mean_lib.IslandMean, *, weights=None,
            axis_name: str | None = None, stages: int = 1,
            fragment: int | None = None) -> Update:
    """The outer step on a round's mean formed elsewhere (`mean`'s, or one
    decoded from payloads the islands encoded themselves): the codec and
    residual state it carries taken, x stepped (or the mean put in
    flight), the islands' starts made. `island_params` are needed only
    where the islands keep their own progress (the delay with rebase,
    eager updates); else None will do. `stages` > 1: the trees are a
    pipeline's, each params-shaped leaf with a leading stage axis after
    any island axis, and each stage steps its own outer state.

    Streaming: fragment `fragment`'s step, `synced` over that fragment's
    leaves (a list in leaf order, as `fragments.select` gives them): x's
    leaves of it stepped, and `island_params` (None will do) merged at
    once with no fragment_delay, as `update` does."""
    outer_checks.check_state(self, state, "apply")
    if self._streaming or fragment is not None:
      outer_checks.check_fragment_of(self, fragment, "apply")
      return streaming_rules.apply_fragment(self, params, island_params,
                                            state, synced, fragment)
    landed = (state.in_flight, state.in_flight_valid)
    x, state = self.land(params, state, stages=stages)
    x, state = self.take(x, state, synced, stages=stages)
    islands, state = self.start(
        x, island_params, state, included=synced.included, landed=landed,
        weights=weights, axis_name=axis_name, stages=stages)
    return Update(x, islands, state)

  # apply's three parts, for a runtime that runs them apart: x's side
  # (land, take) where x lives, the islands' side (start) where they do.

  def land(self, params, state: OuterState, *, stages: int = 1):
    """The one-step delay's first part, (params, state): x steps on the
    mean in flight, which is spent. It needs no island: the islands'
    next round can start from this x while the round's collective is
    still on its way. Other overlaps: as given."""
    if not self._delayed or self._eager:
      return params, state
    return self._apply_in_flight(params, state, stages)

  def take(self, params, state: OuterState,
           synced: island_mean_lib.IslandMean, *, stages: int = 1):
    """The round's mean into x's side, (params, state): the codec and
    residual state it carries, the round counted, which islands took
    part; then x steps on it (no overlap), or it waits in flight (the
    delay, eager updates)."""
    state = state.replace(
        residuals=synced.residuals, round=state.round + 1,
        included=synced.included,
        codec_state=outer_rules.keep_unless(
            synced.anyone, synced.codec_state, state.codec_state))
    if not self._delayed:
      x, outer_opt_state = outer_rules.outer_update(
          self.outer_tx, params, state.outer_opt_state, synced.mean,
          synced.anyone, stages)
      return x, state.replace(outer_opt_state=outer_opt_state)
    return params, state.replace(
        in_flight=jax.tree.map(lambda m: m.astype(jnp.float32),
                               synced.mean),
        in_flight_valid=synced.anyone)

  def start(self, params, island_params, state: OuterState, *, included,
            landed=None, mean=None, weights=None,
            axis_name: str | None = None, stages: int = 1,
            wait: bool | None = None):
    """The islands' side, (islands, state): where each island starts its
    next round. From x (`params`, after `take`); with the rebasing delay
    an island in `included` from x plus its progress since its anchor;
    under eager updates each island steps its own point on `landed`, the
    (mean, valid) that was in flight before `take`, its stale share
    swapped for its fresh one (an island not in `included` adds no share
    of its own), or in a warm-up round on this round's `mean` (default:
    the state's in flight, as `take` left it). `state.round` counts this
    round already; `wait` True or False says whether this round waits
    instead (None: the overlap's warm-up rounds decide)."""
    form = outer_state.form_of(state, axis_name, stages)
    if self._eager:
      return outer_eager.start(self.outer_tx, self.overlap, island_params,
                               state, included, landed, mean, weights, form,
                               wait)
    if not self.keeps_island_points:
      return form.copies(params), state
    islands, anchors = overlap_lib.rebase(
        form.one(island_params), form.one(state.anchors), params,
        form.one(included))
    return form.unone(islands), state.replace(anchors=form.unone(anchors))

  def finish(self, params, state: OuterState, *,
             axis_name: str | None = None, stages: int = 1) -> Update:
    """The end of a run: the mean still in flight is applied (the delay),
    or the islands settle on their average point (eager), so every island
    holds the final x and a run extended later starts anew. Streaming
    (after the schedule's last sends and merges): x as it is, every island
    set to it. `stages` as in `apply`."""
    outer_checks.check_state(self, state, "finish")
    outer_checks.check_form(state.included.ndim == 1, axis_name, "finish")
    form = outer_state.form_of(state, axis_name, stages)
    if self._eager:
      return Update(*outer_eager.settle(self.outer_tx, state, form))
    x = params
    if self._delayed:
      x, state = self._apply_in_flight(params, state, form.stages)
      if self.keeps_island_points:
        state = state.replace(anchors=form.copies(x))
    return Update(x, form.copies(x), state)

  def model(self, params, state: OuterState, *,
            axis_name: str | None = None):
    """The params a run is judged by: x, or under eager updates the
    islands' average point (per island: a mean over `axis_name`, an
    all-reduce of the params: form it to evaluate, not every round)."""
    outer_checks.check_state(self, state, "model")
    if not self._eager:
      return params
    outer_checks.check_form(state.included.ndim == 1, axis_name, "model")
    return outer_eager.average_point(state, axis_name)

  def merge(self, params, island_params, state: OuterState, *,
            fragment: int):
    """Streaming: the islands with fragment `fragment`'s leaves taken from
    x (blended by the overlap's alpha); an island whose fragment is not
    finite takes x. Call it `fragment_delay` inner steps after the send."""
    outer_checks.check_merge(self, params, island_params, state, fragment)
    return streaming_rules.merge_fragment(params, island_params,
                                          state.recipe.assignment, fragment,
                                          self.overlap.alpha)

  def step_fragment(self, parts: fragments_lib.FragmentParts,
                    synced: island_mean_lib.IslandMean
                    ) -> fragments_lib.FragmentParts:
    """Streaming, for a run's compiled sends (fragments.make_send_parts):
    a fragment's parts (fragments.fragment_parts) after its outer step on
    `synced`, the mean over its leaves. `apply(..., fragment=p)` is this
    on the whole state, with the round counted."""
    return streaming_rules.step_parts(self.outer_tx, parts, synced)

  def schedule(self, step: int, *, inner_steps: int,
               total_steps: int) -> list[tuple[str, int]]:
    """Streaming: what to run after inner step `step` (1-based), in order:
    ("send", p): `update(..., fragment=p)`; ("merge", p): `merge`. With
    fragment_delay 0 there are no merges: `update` merges at once."""
    return streaming_rules.object_schedule(self.overlap, step,
                                           inner_steps=inner_steps,
                                           total_steps=total_steps)

  # Results that arrive one at a time: outer_windows.py has the loop.

  def open_window(self, params, state: OuterState) -> outer_windows.Window:
    """A window of results opening at x = `params` and stacked `state`."""
    outer_checks.check_window(self, state, "open_window")
    return outer_windows.open_window(params, state)

  def arrival_mean(self, params, state: OuterState, island, island_params,
                   start, *, scale=1.0, key: jax.Array | None = None
                   ) -> island_mean_lib.IslandMean:
    """One island's result for `add_arrival`: its pseudo-gradient against
    `start` (its call's x) times `scale`, through the codec."""
    return outer_windows.arrival_mean(self, params, state, island,
                                      island_params, start, scale=scale,
                                      key=key)

  def add_arrival(self, window: outer_windows.Window,
                  synced: island_mean_lib.IslandMean):
    """(x, state, window): the outer step on the window's results and
    `synced` summed, from the window's first x and state."""
    return outer_windows.add_arrival(self, window, synced)

  # The pieces.

  def _recipe(self, assignment=None) -> outer_state.Recipe:
    return outer_state.Recipe(self.codec, self.overlap, self.error_feedback,
                              assignment)

  def _apply_in_flight(self, x, state: OuterState, stages: int):
    """x steps on the mean in flight, which is then spent."""
    x, outer_opt_state = outer_rules.outer_update(
        self.outer_tx, x, state.outer_opt_state, state.in_flight,
        state.in_flight_valid, stages)
    return x, state.replace(
        outer_opt_state=outer_opt_state,
        in_flight=jax.tree.map(jnp.zeros_like, state.in_flight),
        in_flight_valid=jnp.zeros((), bool))


def diloco(outer_tx: optax.GradientTransformation | None = None,
           codec: compression_lib.Compression | None = None,
           overlap: outer_overlaps.Overlap | None = None, *,
           error_feedback: bool | None = None) -> DiLoCo:
  """The outer algorithm.

  Args:
    outer_tx: the outer optimizer; None takes the one measured for
      `overlap` (outer Nesterov at outer_overlaps.NESTEROV_DEFAULTS), or
      SparseLoCo's x - alpha * mean with its codec.
    codec: what crosses the link (`codec(...)`); None: fp32.
    overlap: no_overlap() (default), one_step_delay(), eager() or
      streaming(...).
    error_feedback: each island keeps what its codec left unsent and adds
      it to its next pseudo-gradient. None: on for SparseLoCo's codec (its
      residual is the outer momentum), off otherwise.
  """
  codec = compression_lib.as_compression(codec)
  overlap = outer_overlaps.NoOverlap() if overlap is None else overlap
  if not isinstance(overlap, outer_overlaps.OVERLAPS):
    raise TypeError(f"overlap={overlap!r}: give no_overlap(), "
                    "one_step_delay(), eager() or streaming(num_fragments)")
  sparseloco = codec.name == compression_lib.SPARSELOCO
  if error_feedback is None:
    error_feedback = sparseloco
  if sparseloco and not error_feedback:
    raise ValueError(
        f"diloco(codec=<sparseloco codec>, error_feedback={error_feedback!r})"
        ": SparseLoCo's outer momentum is the islands' error-feedback "
        "residual, so it needs error feedback; leave error_feedback unset "
        "(it turns on by itself) or give True")
  if outer_tx is None:
    outer_tx = outer_overlaps.default_outer_tx(overlap, sparseloco)
  return DiLoCo(outer_tx, codec, overlap, bool(error_feedback))
