"""Streaming DiLoCo: the parameters in fragments, synced on staggered
schedules.

The params are split into P fragments of consecutive transformer blocks.
Fragment p is synced once every H inner steps, at steps t with
t = p * H / P (mod H), so one fragment's worth of bytes crosses the link at
a time: the peak bandwidth is 1/P of DiLoCo's. A sync is two programs:

- send: the fragment's pseudo-gradients x_p - y_{i,p} are averaged across
  islands (through the run's codec, with error feedback if configured) and
  the outer optimizer steps x_p with them (its state is kept per fragment);
  the islands go on training meanwhile;
- merge, `fragment_delay` (tau) inner steps later: each island's fragment
  becomes alpha * y_{i,p} + (1 - alpha) * x_p (`fragment_alpha`).

With one fragment, tau = 0 and alpha = 0 this is DiLoCo's outer step. The
host-side order of sends and merges is schedule.py's. On pipelined islands
fragment s is pipeline stage s instead (stage_fragments.py), run with
these sends and merges on each stage's share.
"""

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from diloco_jax.algorithm import guards
from diloco_jax.algorithm import island_mean as island_mean_lib
from diloco_jax.algorithm import island_sync as island_sync_lib
from diloco_jax.algorithm import state as state_lib


def leaf_fragments(params, num_fragments: int) -> tuple[int, ...]:
  """The fragment of each leaf of `params`, in jax.tree.leaves order.

  Transformer block i of L goes to fragment i * P // L, so fragments are
  consecutive blocks of equal count (within one); the token embedding goes
  with the first blocks, everything else (the final norm, an output head)
  with the last.

  Raises:
    ValueError: P is not in [1, number of blocks].
  """
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  layers = [block_index(path) for path in paths]
  num_layers = max((i for i in layers if i is not None), default=-1) + 1
  if not 1 <= num_fragments <= max(num_layers, 1):
    raise ValueError(f"{num_fragments} fragments need 1 to {num_layers} "
                     "transformer blocks (config.model.num_layers)")
  assignment = []
  for path, layer in zip(paths, layers):
    if layer is not None:
      assignment.append(layer * num_fragments // num_layers)
    elif "embed" in jax.tree_util.keystr(path):
      assignment.append(0)
    else:
      assignment.append(num_fragments - 1)
  return tuple(assignment)


def block_index(path) -> int | None:
  """i for a leaf under ['blocks'][i], else None."""
  for key, index in zip(path, path[1:]):
    if isinstance(key, jax.tree_util.DictKey) and key.key == "blocks":
      # NNX state keys a list's items by their int index.
      if isinstance(index, jax.tree_util.SequenceKey):
        return index.idx
      if isinstance(index, jax.tree_util.DictKey) and isinstance(index.key,
                                                                 int):
        return index.key
  return None


def select(tree, assignment: Sequence[int], fragment: int) -> list:
  """The leaves of `tree` (shaped like the params, or stacked per island)
  in `fragment`, in leaf order."""
  return [leaf for leaf, f in zip(jax.tree.leaves(tree), assignment)
          if f == fragment]


def replace(tree, assignment: Sequence[int], fragment: int, leaves):
  """`tree` with its leaves in `fragment` replaced by `leaves`."""
  all_leaves, treedef = jax.tree.flatten(tree)
  new = iter(leaves)
  return jax.tree.unflatten(treedef, [
      next(new) if f == fragment else leaf
      for leaf, f in zip(all_leaves, assignment)])


def codec_positions(params, compression, assignment, fragment) -> list[int]:
  """Where `fragment`'s matrices sit in the codec state (one entry per
  leaf the structured codec factors, in leaf order)."""
  positions, position = [], 0
  for leaf, f in zip(jax.tree.leaves(params), assignment):
    if compression.is_lowrank and compression.is_structured_leaf(leaf.shape):
      if f == fragment:
        positions.append(position)
      position += 1
  return positions


class FragmentParts(NamedTuple):
  """The outer side's share of one fragment: its leaves of x, its outer
  optimizer state, its leaves of the residuals (or None) and its entries of
  the codec state (or None)."""
  x: list
  outer_opt_state: Any
  residuals: list | None
  codec_state: tuple | None


def fragment_parts(params, outer, fragment: int) -> FragmentParts:
  """`fragment`'s parts of x `params` and the outer state `outer` (an
  OuterState of arrays, abstract arrays or shardings, whose recipe names
  each leaf's fragment and the codec)."""
  assignment = outer.recipe.assignment
  codec_state = (None if outer.codec_state is None else tuple(
      outer.codec_state[i] for i in codec_positions(
          params, outer.recipe.codec, assignment, fragment)))
  return FragmentParts(
      select(params, assignment, fragment),
      outer.outer_opt_state[fragment],
      (None if outer.residuals is None
       else select(outer.residuals, assignment, fragment)),
      codec_state)


def with_fragment_parts(params, outer, fragment: int, parts: FragmentParts):
  """(params, outer) with `fragment`'s parts replaced by `parts`."""
  assignment = outer.recipe.assignment
  outer_states = list(outer.outer_opt_state)
  outer_states[fragment] = parts.outer_opt_state
  codec_state = outer.codec_state
  if codec_state is not None:
    codec_state = list(codec_state)
    for i, entry in zip(codec_positions(params, outer.recipe.codec,
                                        assignment, fragment),
                        parts.codec_state):
      codec_state[i] = entry
    codec_state = tuple(codec_state)
  return (replace(params, assignment, fragment, parts.x),
          outer.replace(
              outer_opt_state=tuple(outer_states),
              residuals=(None if outer.residuals is None else replace(
                  outer.residuals, assignment, fragment, parts.residuals)),
              codec_state=codec_state))


def make_send_parts(outer, sync):
  """send(parts, island_leaves, weights, send_index) -> parts (traceable):
  a fragment's send on its parts alone, wherever they are (the compute
  devices, the outer devices of outer_placement='host', a pipeline stage).

  `outer`: the run's outer object (outer.DiLoCo, streaming);
  `island_leaves`: the fragment's leaves of every island's params
  (stacked along the island axis); `sync`: island_sync_lib.make_island_sync's
  collective. The pseudo-gradients go through the codec (the fragment's
  residuals and codec state only) and the object steps x with the
  weighted mean (`outer.step_fragment`); islands with weight 0 or a
  non-finite pseudo-gradient are left out, and a send in which none takes
  part changes nothing.
  """

  def send(parts: FragmentParts, island_leaves, weights, send_index):
    return outer.step_fragment(parts, _synced(sync(
        parts.x, island_leaves, parts.residuals, parts.codec_state, weights,
        send_index)))

  return send


def _synced(sync_out):
  """island_sync's (mean, residuals, codec state, included, finite) as the
  outer object's IslandMean (`anyone`: some island took part)."""
  return island_mean_lib.IslandMean(*sync_out, jnp.any(sync_out[3]))


def make_fragment_send(outer, mesh, fragment: int,
                       rounding_seed: int | None = None, fsdp: bool = False):
  """Builds send(state, weights) -> state for one fragment on the compute
  devices (jitted; `state` is donated): make_send_parts over the state's
  fragment, its collective over the island mesh. The islands' params are
  untouched: make_fragment_merge folds x in later. As on the outer devices
  and per stage, the state's round and included stay (the schedule counts
  the sends)."""
  send_parts = make_send_parts(outer, island_sync_lib.make_island_sync(
      mesh, outer.codec, rounding_seed, fsdp))
  num_fragments = outer.overlap.num_fragments

  def send(state: state_lib.TrainState, weights: jax.Array):
    # Each send of each fragment draws its own rounding noise.
    parts = send_parts(
        fragment_parts(state.global_params, state.outer, fragment),
        select(state.island_params, state.outer.recipe.assignment, fragment),
        weights, send_index(state.step, num_fragments, fragment))
    x, outer_state = with_fragment_parts(state.global_params, state.outer,
                                         fragment, parts)
    state = state.replace(global_params=x, outer=outer_state)
    return state_lib.constrain_state(state, mesh, fsdp)

  return jax.jit(send, donate_argnums=0)


def send_index(step, num_fragments: int, fragment: int):
  """The count of sends before this one, had every fragment sent at every
  step: seeds the send's stochastic rounding, distinct per send."""
  return step * num_fragments + fragment


def blend(x_leaves, island_leaves, alpha: float) -> list:
  """A fragment's merge: every island's leaves become alpha * y + (1 -
  alpha) * x, stacked [islands, ...] like `island_leaves`; an island whose
  fragment is not finite (it diverged) takes x as it is."""
  islands = island_leaves[0].shape[0]
  finite = jax.vmap(guards.all_finite)(island_leaves)

  def one(x_leaf, y_leaf):
    keep = jnp.where(finite, alpha, 0.0).astype(y_leaf.dtype)
    keep = keep.reshape((islands,) + (1,) * x_leaf.ndim)
    y_leaf = jnp.where(finite.reshape(keep.shape), y_leaf, 0)
    return (keep * y_leaf + (1 - keep) * x_leaf[None]).astype(y_leaf.dtype)

  return [one(x, y) for x, y in zip(x_leaves, island_leaves)]


def make_fragment_merge(mesh, num_fragments: int, fragment: int,
                        alpha: float, fsdp: bool = False,
                        inner_opt: optax.GradientTransformation | None = None):
  """Builds merge(state, x=None) -> state for one fragment (jitted; `state`
  is donated): every island's fragment becomes alpha * y + (1 - alpha) * x.

  `x`: the fragment's leaves of x, where the outer side keeps x elsewhere
  (outer_placement='host'); they replace the state's copy first. Without
  it the state's own global params are x.

  An island whose fragment is not finite (it diverged) takes x as it is;
  given `inner_opt`, an island whose params are all finite again after the
  merge but whose inner optimizer state is not restarts that state fresh,
  counted from the current step.
  """

  def merge(state: state_lib.TrainState, x=None):
    assignment = leaf_fragments(state.global_params, num_fragments)
    if x is not None:
      state = state.replace(global_params=replace(
          state.global_params, assignment, fragment, x))
    x = select(state.global_params, assignment, fragment)
    y = select(state.island_params, assignment, fragment)
    island_params = replace(state.island_params, assignment, fragment,
                            blend(x, y, alpha))
    inner_opt_state = state.inner_opt_state
    if inner_opt is not None:
      params_ok = jax.vmap(guards.all_finite)(island_params)
      state_ok = jax.vmap(guards.all_finite)(inner_opt_state)
      inner_opt_state = state_lib.restart_inner_states(
          inner_opt, inner_opt_state, island_params, state.step,
          params_ok & ~state_ok)
    state = state.replace(island_params=island_params,
                          inner_opt_state=inner_opt_state)
    return state_lib.constrain_state(state, mesh, fsdp)

  return jax.jit(merge, donate_argnums=0)
