"""The outer step's collective: each island's pseudo-gradient (plus its
error-feedback residual) through the codec into the cross-island mean.

`sync_island` is one island's part, called wherever the islands are named
by an axis (a mesh's, shard_map's or vmap's); `make_island_sync` maps it
over a mesh's islands for the built-in steps (outer_step.py,
fragments.py); library.py calls it over stacked islands or in shard_map.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import guards
from diloco_jax.parallel import communication
from diloco_jax.parallel.mesh import DATA, ISLAND, STAGE
from diloco_jax.parallel import placement
from diloco_jax.parallel.placement import PER_ISLAND, REPLICATED
from diloco_jax.parallel import stages as stages_lib
from diloco_jax.parallel.stages import per_stage


def rounding_key(rounding_seed: int | None, round_index, island=None):
  """The codec's stochastic rounding key of a round (or a fragment's
  send), and of one island where `island` is given; None without a seed
  (round to nearest). Every runtime draws its noise from this one key, so
  a resumed run, an elastic island and the SPMD step draw the same."""
  if rounding_seed is None:
    return None
  key = jax.random.fold_in(jax.random.key(rounding_seed), round_index)
  return key if island is None else jax.random.fold_in(key, island)


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

  On a mesh with 'stage' > 1 the trees are staged: each stage reduces its
  own layers across the islands, through the codec (a collective per
  stage, among the devices holding that stage in every island, with the
  codec's state per stage); an island whose pseudo-gradient is not finite
  on any stage is left out on all of them.
  """
  compression = compression_lib.as_compression(compression)
  stages = mesh.shape[STAGE]
  if stripes is None:
    # With FSDP each of an island's 'data' devices sends its own shards.
    stripes = mesh.shape[DATA] if fsdp else 1

  def island_sync(reference, island_params, residuals, codec_state,
                  weight, round_index):
    key = rounding_key(rounding_seed, round_index,
                       communication.island_index())
    return sync_island(reference, island_params, residuals, codec_state,
                       weight, compression, key, stripes=stripes,
                       stage_axis=stages > 1)

  # Staged trees: each device takes its own stage (the 'stage' axis
  # manual), so each collective stays among the devices of one stage.
  staged = (lambda spec: spec if stages == 1 else
            P(ISLAND, STAGE) if spec == PER_ISLAND else P(STAGE))
  return placement.island_map(
      island_sync, mesh,
      in_specs=(staged(PER_ISLAND if reference_per_island else REPLICATED),
                staged(PER_ISLAND), staged(PER_ISLAND), staged(REPLICATED),
                PER_ISLAND, REPLICATED),
      out_specs=(staged(REPLICATED), staged(PER_ISLAND), staged(REPLICATED),
                 PER_ISLAND, PER_ISLAND),
      # A compressed mean ends in an all_gather, whose result is the same
      # on every island but is typed as varying; the replicated out_specs
      # are right by construction (tests check islands agree bit for bit).
      check_vma=False, stage_manual=stages > 1)


def sync_island(reference, island_params, residuals, codec_state, weight,
                compression: compression_lib.Compression, key=None, *,
                axes=communication.ISLANDS, stripes: int = 1,
                stages: int = 1, stage_axis: bool = False):
  """One island's part of the outer step's collective (traceable).

  Call it once per island where the islands are named by `axes`: inside
  placement.island_map or shard_map (each device or device group an
  island), or under jax.vmap(..., axis_name=axes) over stacked islands.

  Args:
    reference: the x this island started the round from (or its anchor).
    island_params: the island's params y_i after its inner steps.
    residuals: the island's error-feedback residual (params-shaped), or
      None without error feedback.
    codec_state: the codec's state (init_codec_state; the same on every
      island), or None for codecs without one.
    weight: the island's scalar weight (0: it sends nothing this round).
    compression: the codec and its settings.
    key: PRNG key for stochastic rounding (per island), or None.
    axes: the island axis name(s).
    stripes: rows each island's arrays are cut into (FSDP; dense codecs).
    stages: > 1 for staged trees: each stage reduces its own layers.
    stage_axis: the trees hold this device's stage only (a leading stage
      axis of 1) of staged trees whose stages are a manual 'stage' mesh
      axis (make_island_sync's): the stages agree on `finite` over it.

  Returns:
    (mean, residuals, codec_state, included, finite): the weighted mean of
    the islands' pseudo-gradients reference - y_i (plus their residuals,
    decayed by compression.feedback_decay) through the codec, the same on
    every island; this island's new residual (what the codec left unsent);
    the next codec state; whether this island took part and whether its
    pseudo-gradient was finite. An island with weight 0 or a non-finite
    pseudo-gradient is masked before any arithmetic and keeps its residual.
  """
  pseudo_grad = jax.tree.map(jnp.subtract, reference, island_params)
  if residuals is not None:
    decay = compression.feedback_decay  # SparseLoCo's beta; else 1
    pseudo_grad = jax.tree.map(
        lambda g, e: g + (e if decay == 1.0 else decay * e),
        pseudo_grad, residuals)
  # An island without weight (not synced this round) or whose
  # pseudo-gradient is not finite (it diverged) takes no part: its values
  # are zeroed before any arithmetic, since NaN x 0 is still NaN.
  finite = guards.all_finite(pseudo_grad)
  if stage_axis:  # not finite on any stage: on none
    finite = jax.lax.psum((~finite).astype(jnp.int32), STAGE) == 0
  included = (weight > 0) & finite
  weight = jnp.where(included, weight, 0.0)
  pseudo_grad = jax.tree.map(lambda g: jnp.where(included, g, 0),
                             pseudo_grad)

  def stage_mean(tree, codec_state, key):
    if key is not None and (stages > 1 or stage_axis):
      key = jax.random.fold_in(key, stages_lib.stage_index())
    return compression_lib.island_mean(tree, weight, compression,
                                       codec_state, key, axes=axes,
                                       stripes=stripes)

  if stage_axis:  # this device's stage, its axis of 1 dropped and back
    drop = lambda tree: jax.tree.map(lambda a: a[0], tree)
    mean, sent, codec_state = jax.tree.map(
        lambda a: a[None], stage_mean(drop(pseudo_grad), drop(codec_state),
                                      key))
  else:
    mean, sent, codec_state = per_stage(stage_mean, stages,
                                        in_axes=(0, 0, None))(
                                            pseudo_grad, codec_state, key)
  if residuals is not None:
    # An island that took no part keeps the residual it had.
    residuals = jax.tree.map(
        lambda old, new: jnp.where(included, new, old), residuals,
        jax.tree.map(jnp.subtract, pseudo_grad, sent))
  return mean, residuals, codec_state, included, finite
