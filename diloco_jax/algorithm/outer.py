"""DiLoCo's outer algorithm as one object, in optax's manner.

    outer = diloco(codec=codec("int8"), overlap=one_step_delay())
    state = outer.init(x, num_islands=k)
    for each round:
      ... every island trains H inner steps from islands[i] ...
      x, islands, state = outer.update(x, islands, state)
    x, islands, state = outer.finish(x, state)

`diloco(outer_tx, codec, overlap, error_feedback)` fixes what the outer
step is: the outer optimizer (None: the one measured for the overlap),
what crosses the link, and how the step meets the islands' training
(outer_overlaps.py). The object's state holds everything that changes
from round to round (the outer optimizer's, the codec's, error feedback's
residuals, the mean in flight, each island's own point), and it remembers
which object made it, so nothing is given twice.

Every call works in two forms: stacked (islands' trees [k, ...],
`init(x, k)`, axis_name=None) and per island (inside shard_map, one
island's trees, `init(x)` or `this_island` of a stacked state, axis_name
the islands' mesh axis). A stacked state's per-island fields split over
the islands' axis with library_specs.island_specs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.algorithm import library_checks
from diloco_jax.algorithm import library_diloco
from diloco_jax.algorithm import library_streaming
from diloco_jax.algorithm import outer_checks
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.algorithm import outer_state
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import overlap as overlap_lib
from diloco_jax.algorithm import state as state_lib

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
    return self._anchored

  def without_error_feedback(self) -> "DiLoCo":
    """This algorithm with its residuals kept elsewhere (islands that
    encode their own pseudo-gradients keep theirs)."""
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

  @property
  def _anchored(self) -> bool:
    return self._eager or (isinstance(self.overlap,
                                      outer_overlaps.OneStepDelay)
                           and self.overlap.rebase)

  def init(self, params, num_islands: int | None = None, *,
           seed: int = 0) -> OuterState:
    """The state before the first round, for the global `params` x:
    stacked for `num_islands` k islands, or one island's with None (the
    per-island form). `seed` seeds the codec's initial state (low-rank
    bases)."""
    library_checks.check_num_islands(num_islands, "init")
    per_island = ((lambda tree: tree) if num_islands is None else
                  (lambda tree: state_lib.stack_islands(tree, num_islands)))
    zeros32 = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32),
                           params)
    assignment = None
    if self._streaming:
      assignment = self.overlap.assignment or (
          library_streaming.fragment_assignment(params,
                                                self.overlap.num_fragments))
      library_streaming.check_assignment(params, assignment,
                                         self.overlap.num_fragments)
      outer_opt_state = tuple(
          self.outer_tx.init(fragments_lib.select(params, assignment, f))
          for f in range(self.overlap.num_fragments))
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
        codec_state=state_lib.init_codec_state(params, self.codec, seed),
        residuals=(per_island(jax.tree.map(jnp.zeros_like, params))
                   if self.error_feedback else None),
        in_flight=zeros32 if self._delayed else None,
        in_flight_valid=jnp.zeros((), bool) if self._delayed else None,
        anchors=per_island(params) if self._anchored else None,
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
    if self._streaming:
      return self._send(params, island_params, state, weights, key,
                        axis_name, fragment)
    return self.apply(params, island_params, state,
                      self.mean(params, island_params, state,
                                weights=weights, key=key,
                                axis_name=axis_name),
                      weights=weights, axis_name=axis_name)

  def mean(self, params, island_params, state: OuterState, *, weights=None,
           key: jax.Array | None = None,
           axis_name: str | None = None) -> library_diloco.IslandMean:
    """The round's collective alone: the islands' weighted mean of their
    pseudo-gradients (against x, or their anchors) through the codec,
    with error feedback. `apply` takes it from there; `update` is the
    two."""
    reference = state.anchors if self._anchored else params
    return library_diloco.island_mean(
        reference, island_params, weights=weights, residuals=state.residuals,
        codec_state=state.codec_state, compression=self.codec,
        axis_name=axis_name, key=key, stacked_reference=self._anchored)

  def apply(self, params, island_params, state: OuterState,
            synced: library_diloco.IslandMean, *, weights=None,
            axis_name: str | None = None) -> Update:
    """The outer step on a round's mean formed elsewhere (`mean`'s, or one
    decoded from payloads the islands encoded themselves): the codec and
    residual state it carries taken, x stepped (or the mean put in
    flight), the islands' starts made. `island_params` are needed only
    where the islands keep their own progress (the delay with rebase,
    eager updates); else None will do."""
    form = outer_state.form_of(state, axis_name)
    state = state.replace(
        residuals=synced.residuals, round=state.round + 1,
        included=synced.included,
        codec_state=outer_step_lib.keep_unless(
            synced.anyone, synced.codec_state, state.codec_state))
    if self._eager:
      return self._eager_steps(params, island_params, state, synced,
                               weights, form)
    if not self._delayed:
      x, outer_opt_state = outer_step_lib.outer_update(
          self.outer_tx, params, state.outer_opt_state, synced.mean,
          synced.anyone)
      return Update(x, form.copies(x),
                    state.replace(outer_opt_state=outer_opt_state))
    # The delay: x steps on the mean that has had this round to arrive;
    # this round's waits in flight.
    x, state = self._apply_in_flight(params, state)
    state = state.replace(
        in_flight=jax.tree.map(lambda m: m.astype(jnp.float32),
                               synced.mean),
        in_flight_valid=synced.anyone)
    if not self._anchored:
      return Update(x, form.copies(x), state)
    islands, anchors = overlap_lib.rebase(
        form.one(island_params), form.one(state.anchors), x,
        form.one(synced.included))
    return Update(x, form.unone(islands),
                  state.replace(anchors=form.unone(anchors)))

  def finish(self, params, state: OuterState, *,
             axis_name: str | None = None) -> Update:
    """The end of a run: the mean still in flight is applied (the delay),
    or the islands settle on their average point (eager), so every island
    holds the final x and a run extended later starts anew. Streaming:
    after the schedule's last sends and merges, as it is."""
    outer_checks.check_state(self, state, "finish")
    outer_checks.check_form(state.included.ndim == 1, axis_name, "finish")
    form = outer_state.form_of(state, axis_name)
    if self._eager:
      return self._settle(state, form)
    x = params
    if self._delayed:
      x, state = self._apply_in_flight(params, state)
      if self._anchored:
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
    stacked = state.included.ndim == 1
    outer_checks.check_form(stacked, axis_name, "model")
    if stacked:
      return state_lib.islands_average(state.anchors)
    return jax.tree.map(lambda a: outer_state.mean_over(a, axis_name),
                        state.anchors)

  def merge(self, params, island_params, state: OuterState, *,
            fragment: int):
    """Streaming: the islands with fragment `fragment`'s leaves taken from
    x (blended by the overlap's alpha); an island whose fragment is not
    finite takes x. Call it `fragment_delay` inner steps after the send."""
    outer_checks.check_state(self, state, "merge")
    if not self._streaming:
      raise ValueError(f"merge: overlap {self.overlap} has no fragments; "
                       "merge belongs to diloco(overlap=streaming(...))")
    library_checks.check_fragment(fragment, self.overlap.num_fragments,
                                  "merge")
    stacked = state.included.ndim == 1
    library_checks.check_islands(params, island_params, stacked)
    assignment = state.recipe.assignment
    x = fragments_lib.select(params, assignment, fragment)
    y = fragments_lib.select(island_params, assignment, fragment)
    if not stacked:
      y = [leaf[None] for leaf in y]
    merged = fragments_lib.blend(x, y, self.overlap.alpha)
    if not stacked:
      merged = [leaf[0] for leaf in merged]
    return fragments_lib.replace(island_params, assignment, fragment,
                                 merged)

  def schedule(self, step: int, *, inner_steps: int,
               total_steps: int) -> list[tuple[str, int]]:
    """Streaming: what to run after inner step `step` (1-based), in order:
    ("send", p): `update(..., fragment=p)`; ("merge", p): `merge`."""
    if not self._streaming:
      raise ValueError(f"schedule: overlap {self.overlap} syncs the whole "
                       "model every inner_steps steps; schedule belongs to "
                       "streaming(...)")
    return library_streaming.streaming_schedule(
        step, inner_steps=inner_steps,
        num_fragments=self.overlap.num_fragments, total_steps=total_steps,
        fragment_delay=self.overlap.fragment_delay)

  # The pieces.

  def _recipe(self, assignment=None) -> outer_state.Recipe:
    return outer_state.Recipe(self.codec, self.overlap, self.error_feedback,
                              assignment)

  def _apply_in_flight(self, x, state: OuterState):
    """x steps on the mean in flight, which is then spent."""
    x, outer_opt_state = outer_step_lib.outer_update(
        self.outer_tx, x, state.outer_opt_state, state.in_flight,
        state.in_flight_valid)
    return x, state.replace(
        outer_opt_state=outer_opt_state,
        in_flight=jax.tree.map(jnp.zeros_like, state.in_flight),
        in_flight_valid=jnp.zeros((), bool))

  def _eager_steps(self, params, island_params, state, synced, weights,
                   form: outer_state.Form) -> Update:
    """Each island's own outer step on the landed mean with its part
    swapped (outer_step.eager_steps), the round's mean put in flight."""
    weights = jnp.broadcast_to(
        jnp.asarray(1.0 if weights is None else weights, jnp.float32),
        synced.included.shape)
    # The share rule's total is over the weights every island knows before
    # the collective.
    total = None if form.stacked else jax.lax.psum(weights, form.axis_name)
    mean = jax.tree.map(lambda m: m.astype(jnp.float32), synced.mean)
    waited = None
    if self.overlap.warmup_rounds:
      # state.round counts this round already.
      waited = (state.round <= self.overlap.warmup_rounds, mean,
                synced.anyone)
    points, outer_states, shares = outer_step_lib.eager_steps(
        self.outer_tx, form.one(state.anchors), form.one(island_params),
        form.one(state.outer_opt_state), form.one(state.own_shares),
        state.in_flight, state.in_flight_valid, form.one(weights),
        form.one(synced.finite & (weights > 0)),
        own_weight=self.overlap.own_weight, waited=waited,
        total_weight=total)
    points = form.unone(points)
    return Update(params, points, state.replace(
        anchors=points, outer_opt_state=form.unone(outer_states),
        own_shares=form.unone(shares), in_flight=mean,
        in_flight_valid=synced.anyone))

  def _settle(self, state: OuterState, form: outer_state.Form) -> Update:
    """Eager's end: the last mean lands, each island steps on the rest of
    it, and every island, x and the outer state become their average."""
    points, outer_states = outer_step_lib.eager_last_steps(
        self.outer_tx, form.one(state.anchors),
        form.one(state.outer_opt_state), form.one(state.own_shares),
        state.in_flight, state.in_flight_valid)
    if form.stacked:
      x = state_lib.islands_average(points)
      average_state = state_lib.islands_average(outer_states)
    else:
      average = lambda tree: jax.tree.map(
          lambda a: outer_state.mean_over(a[0], form.axis_name), tree)
      x, average_state = average(points), average(outer_states)
    islands = form.copies(x)
    return Update(x, islands, state.replace(
        anchors=islands, outer_opt_state=form.copies(average_state),
        own_shares=jax.tree.map(jnp.zeros_like, state.own_shares),
        in_flight=jax.tree.map(jnp.zeros_like, state.in_flight),
        in_flight_valid=jnp.zeros((), bool)))

  def _send(self, params, island_params, state, weights, key, axis_name,
            fragment) -> Update:
    """Streaming: one fragment's mean and outer step (its residuals and
    codec state only), merged at once with no fragment_delay."""
    sent = library_streaming.send_fragment(
        params, island_params, state.outer_opt_state, state.codec_state,
        state.residuals, state.recipe.assignment, fragment, self.outer_tx,
        weights=weights, compression=self.codec, axis_name=axis_name,
        key=key)
    state = state.replace(outer_opt_state=sent.outer_opt_states,
                          codec_state=sent.codec_state,
                          residuals=sent.residuals, included=sent.included,
                          round=state.round + 1)
    islands = island_params
    if self.overlap.fragment_delay == 0:
      islands = self.merge(sent.params, island_params, state,
                           fragment=fragment)
    return Update(sent.params, islands, state)

  # The checks.


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
  if not isinstance(overlap, (outer_overlaps.NoOverlap,
                              outer_overlaps.OneStepDelay,
                              outer_overlaps.Eager,
                              outer_overlaps.Streaming)):
    raise TypeError(f"overlap={overlap!r}: give no_overlap(), "
                    "one_step_delay(), eager() or streaming(num_fragments)")
  sparseloco = codec.name == compression_lib.SPARSELOCO
  if error_feedback is None:
    error_feedback = sparseloco
  library_checks.check_error_feedback(codec, error_feedback, "diloco")
  if outer_tx is None:
    if sparseloco:  # x - alpha * mean, alpha 1
      outer_tx = library_diloco.sparseloco()[0]
    else:
      outer_tx = library_diloco.nesterov(
          *outer_overlaps.nesterov_defaults(overlap))
  return DiLoCo(outer_tx, codec, overlap, bool(error_feedback))
