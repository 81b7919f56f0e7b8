"""Streaming DiLoCo on pipelined islands: one fragment per pipeline stage.

An island of S pipeline stages (parallel/stages.py) keeps each layer on one
stage and a 1 / S piece of the embedding, final norm and head on each. With
Streaming DiLoCo each stage is one fragment: fragment s is everything
stage s holds, synced at steps t = s H / S (mod H). So the stages' syncs
are staggered, and each stage's link carries its own share only, once per
round, while the other stages train.

A stage's send and merge are fragments.py's, run on the stage's own
devices over its part of the staged state (parallel/stage_parts.py): the
trees they take keep the stage axis, of size 1 (a shared field's first
dimension, a per-island field's second). The outer optimizer keeps one
state per stage (the staged outer state's row s); checkpoints hold the
tuple of them (`split_outer_states`), as they hold one state per fragment
without stages.
"""

from typing import Sequence

import jax
import jax.numpy as jnp
import optax

from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.algorithm import guards
from diloco_jax.algorithm import state as state_lib


def init_outer_states(params, outer_opt: optax.GradientTransformation,
                      layout) -> tuple:
  """One outer optimizer state per stage of `layout` (a
  stages.StageLayout), over that stage's share of `params` (logical)."""
  staged = layout.split_params(params)
  return tuple(outer_opt.init(jax.tree.map(lambda a, s=s: a[s], staged))
               for s in range(layout.stages))


def stack_outer_states(states: Sequence) -> object:
  """The per-stage outer states stacked on a leading stage axis: the
  staged outer state the compiled steps take."""
  return jax.tree.map(lambda *rows: jnp.stack(rows), *states)


def split_outer_states(staged, stages: int) -> tuple:
  """stack_outer_states inverted: one state per stage."""
  return tuple(jax.tree.map(lambda a, s=s: a[s], staged)
               for s in range(stages))


def _drop(tree, axis: int):
  return jax.tree.map(lambda a: jnp.squeeze(a, axis), tree)


def _restore(tree, axis: int):
  return jax.tree.map(lambda a: jnp.expand_dims(a, axis), tree)


def make_stage_send(outer, sync, stages: int, stage: int):
  """send(parts, island_part, weights, step) -> parts (traceable): stage
  `stage`'s fragment send on its part of the staged state.

  `parts`: a fragments.FragmentParts of the stage's part of x, the outer
  state, the residuals (or None) and the codec state (or None);
  `island_part`: its part of the islands' params; `outer`: the run's
  outer object; `sync`: island_sync's make_island_sync on the stage's own
  devices (a mesh whose 'stage' axis has size 1). The mean, the codec and
  the outer step are the unpipelined send's (fragments.make_send_parts),
  on the stage's share.
  """
  send_parts = fragments_lib.make_send_parts(outer, sync)

  def send(parts: fragments_lib.FragmentParts, island_part, weights, step):
    new = send_parts(
        fragments_lib.FragmentParts(
            _drop(parts.x, 0), _drop(parts.outer_opt_state, 0),
            None if parts.residuals is None else _drop(parts.residuals, 1),
            (None if parts.codec_state is None
             else _drop(parts.codec_state, 0))),
        _drop(island_part, 1), weights,
        fragments_lib.send_index(step, stages, stage))
    return fragments_lib.FragmentParts(
        _restore(new.x, 0), _restore(new.outer_opt_state, 0),
        None if new.residuals is None else _restore(new.residuals, 1),
        None if new.codec_state is None else _restore(new.codec_state, 0))

  return send


def make_stage_merge(alpha: float,
                     inner_opt: optax.GradientTransformation | None = None):
  """merge(x_part, island_part, inner_part, step) -> (island_part,
  inner_part) (traceable): a stage's fragment merge on its part of the
  staged state, fragments.blend's: every island's share becomes alpha * y
  + (1 - alpha) * x (an island whose share is not finite takes x).

  Given `inner_opt` (the islands' optimizer), an island whose share is
  finite after the merge but whose inner state for this stage is not
  restarts the stage's state fresh, counted from `step`: each stage's
  inner optimizer is its own.
  """

  def merge(x_part, island_part, inner_part, step):
    x, y = _drop(x_part, 0), _drop(island_part, 1)
    x_leaves, treedef = jax.tree.flatten(x)
    merged = jax.tree.unflatten(treedef, fragments_lib.blend(
        x_leaves, jax.tree.leaves(y), alpha))
    inner = _drop(inner_part, 1)
    if inner_opt is not None:
      params_ok = jax.vmap(guards.all_finite)(merged)
      state_ok = jax.vmap(guards.all_finite)(inner)
      inner = state_lib.restart_inner_states(inner_opt, inner, merged, step,
                                             params_ok & ~state_ok)
    return _restore(merged, 1), _restore(inner, 1)

  return merge
