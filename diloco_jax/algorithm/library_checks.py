"""The library's argument checks (library.py's public functions call them).

Each misuse becomes one plain ValueError or TypeError whose message names
the argument, what is wrong and the fix, raised before the misuse reaches
jax.vmap or a collective (where it would surface as a deep JAX error, or
not at all). Pure functions over settings, pytrees and shapes: they read
shapes, dtypes and tree structures only, never values, so they work the
same on concrete arrays and on abstract ones under jit (at trace time).
"""

import math
import numbers

import jax
import numpy as np

from diloco_jax.algorithm import compression as compression_lib

_SAME_CODEC = "give the same codec to {made_by} and {used_by}"


def check_number(name: str, value, low: float, high: float,
                 bounds: str = "()", integer: bool = False,
                 meaning: str = "") -> None:
  """`value` of argument `name` is a number (an int if `integer`) in the
  range from `low` to `high`, each end included where `bounds` has "[" or
  "]" (NaN is in no range). TypeError for a non-number, else ValueError.
  """
  kind = numbers.Integral if integer else numbers.Real
  interval = f"{bounds[0]}{low:g}, {high:g}{bounds[1]}"
  what = f" ({meaning})" if meaning else ""
  if isinstance(value, bool) or not isinstance(value, kind):
    kind_name = "an int" if integer else "a number"
    raise TypeError(f"{name}={value!r} must be {kind_name} in "
                    f"{interval}{what}")
  above = low <= value if bounds[0] == "[" else low < value
  below = value <= high if bounds[1] == "]" else value < high
  if not (above and below):
    raise ValueError(f"{name}={value!r} is out of range: give a value in "
                     f"{interval}{what}")


def check_codec_options(name: str, *, prune_rate, topk_fraction, rank,
                        min_rank, energy_fraction, chunk_size, density,
                        bits, beta) -> None:
  """`codec`'s options: each in the range its collective needs (the same
  ranges config validation enforces on config.diloco). `block_size` is
  the dense codec's own check (codecs/dense.py)."""
  check_number("prune_rate", prune_rate, 0, 1,
               meaning="the fraction of each column sign_prune drops")
  check_number("topk_fraction", topk_fraction, 0, 1,
               meaning="the fraction of each matrix topk keeps, e.g. 0.01")
  check_number("rank", rank, 1, math.inf, "[)", integer=True,
               meaning="the low-rank codecs' (top) rank")
  if min_rank is not None:
    check_number("min_rank", min_rank, 1, math.inf, "[)", integer=True,
                 meaning="adaptive_lowrank's lowest rank")
    if name == "adaptive_lowrank" and min_rank > rank:
      raise ValueError(f"min_rank={min_rank} exceeds rank={rank}: "
                       "adaptive_lowrank's ranks go from min_rank up to "
                       "rank; give min_rank <= rank")
  check_number("energy_fraction", energy_fraction, 0, 1,
               meaning="the energy adaptive_lowrank's rank keeps")
  check_number("chunk_size", chunk_size, 2, 2 ** 24, "[]", integer=True,
               meaning="sparseloco's values per top-k chunk")
  check_number("density", density, 0, 1,
               meaning="the fraction of each chunk sparseloco keeps")
  check_number("bits", bits, 2, 8, "[]", integer=True,
               meaning="the bits of each value sparseloco sends")
  check_number("beta", beta, 0, 1, "[)",
               meaning="sparseloco's decay of the error feedback")


def check_num_islands(num_islands, function: str) -> None:
  """num_islands is None (the per-island form) or a positive int."""
  if num_islands is None:
    return
  if isinstance(num_islands, bool) or not isinstance(num_islands,
                                                      numbers.Integral):
    raise TypeError(f"{function}: num_islands={num_islands!r} must be a "
                    "positive int (k, the stacked form) or None (the "
                    "per-island form)")
  if num_islands < 1:
    raise ValueError(f"{function}: num_islands={num_islands} must be at "
                     "least 1 (k, the stacked form) or None (the "
                     "per-island form)")


def check_error_feedback(compression, error_feedback: bool,
                         function: str) -> None:
  """SparseLoCo's codec needs error feedback: its residual is the outer
  momentum, and without it the run is silently worse."""
  compression = compression_lib.as_compression(compression)
  if compression.name == compression_lib.SPARSELOCO and not error_feedback:
    raise ValueError(
        f"{function}(compression=<sparseloco codec>, error_feedback="
        f"{error_feedback!r}): SparseLoCo's outer momentum is the islands' "
        "error-feedback residual, so it needs error_feedback=True; call "
        f"{function}(..., compression=compression, error_feedback=True)")


def check_residuals_for_codec(residuals, compression, made_by: str,
                              used_by: str) -> None:
  """A SparseLoCo codec at an update needs a state with residuals."""
  compression = compression_lib.as_compression(compression)
  if compression.name == compression_lib.SPARSELOCO and residuals is None:
    raise ValueError(
        f"{used_by}: compression is SparseLoCo's, whose outer momentum is "
        "the error-feedback residual, but state.residuals is None: make "
        f"the state with {made_by}(..., compression=compression, "
        "error_feedback=True) (and " + _SAME_CODEC.format(
            made_by=made_by, used_by=used_by) + ")")


def check_codec_state(codec_state, compression, params, made_by: str,
                      used_by: str,
                      name: str = "state.codec_state") -> None:
  """`codec_state` is what `made_by` makes for `compression` on `params`
  (one copy's shapes): None for a stateless codec, else one entry per
  factored matrix with a [cols, top rank] basis."""
  compression = compression_lib.as_compression(compression)
  same = _SAME_CODEC.format(made_by=made_by, used_by=used_by)
  if not compression.is_lowrank:
    if codec_state is not None:
      raise ValueError(
          f"{used_by}: {name} holds a codec's state (low-rank "
          f"bases and ranks) but compression={compression.name!r} keeps "
          f"none: the state was made for another codec; {same} (a codec "
          "left out of the update runs fp32)")
    return
  if codec_state is None:
    raise ValueError(
        f"{used_by}: compression={compression.name!r} keeps state (bases "
        f"and ranks) but {name} is None: the state was made "
        f"without that codec; {same}")
  shapes = [leaf.shape for leaf in jax.tree.leaves(params)]
  matrices = [s for s in shapes if compression.is_structured_leaf(s)]
  if not isinstance(codec_state, (tuple, list)) or len(codec_state) != len(
      matrices):
    count = (len(codec_state) if isinstance(codec_state, (tuple, list))
             else "no")
    raise ValueError(
        f"{used_by}: {name} has {count} entries but "
        f"compression={compression.name!r} factors {len(matrices)} "
        f"matrices of these params: the state was made for another codec "
        f"or other params; {same}")
  for j, (shape, entry) in enumerate(zip(matrices, codec_state)):
    basis = entry.get("basis") if isinstance(entry, dict) else None
    want = (shape[-1], compression.ranks[-1])
    if basis is None or tuple(np.shape(basis)) != want:
      raise ValueError(
          f"{used_by}: {name}'s basis {j} has shape "
          f"{None if basis is None else tuple(np.shape(basis))}, not "
          f"{want} (columns, top rank {compression.ranks[-1]}): the state "
          f"was made for another rank; {same}")


def _paths(tree) -> tuple[list[str], list]:
  with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
  return ([jax.tree_util.keystr(path) or "<root>" for path, _ in with_paths],
          [leaf for _, leaf in with_paths])


def _few(names) -> str:
  names = list(names)
  return ", ".join(names[:3]) + (f" and {len(names) - 3} more"
                                 if len(names) > 3 else "")


def check_structure(tree, like, tree_name: str, like_name: str,
                    fix: str) -> tuple[list[str], list, list]:
  """`tree` has `like`'s tree structure; returns (leaf names, tree's
  leaves, like's leaves)."""
  names, leaves = _paths(tree)
  like_names, like_leaves = _paths(like)
  if jax.tree.structure(tree) != jax.tree.structure(like):
    missing = [n for n in like_names if n not in names]
    extra = [n for n in names if n not in like_names]
    detail = "; ".join(
        part for part in (f"it lacks {_few(missing)}" if missing else "",
                          f"it has {_few(extra)} that {like_name} lacks"
                          if extra else "") if part) or (
        "the same leaves in other containers: "
        f"{jax.tree.structure(tree)} vs {jax.tree.structure(like)}")
    raise ValueError(f"{tree_name} does not have {like_name}'s tree "
                     f"structure: {detail}; {fix}")
  return names, leaves, like_leaves


def check_islands(reference, island_params, stacked: bool | None,
                  reference_name: str = "global_params",
                  islands_name: str = "island_params") -> int | None:
  """`island_params` are the islands' trees of `reference` (one copy's
  shapes): with `stacked` True, every leaf the reference's with one
  leading axis of the same k; False, the reference's shapes (one island's,
  inside shard_map); None, either form (the same for every leaf).
  Returns k (None for one island's trees)."""
  fix = (f"give {islands_name} the same model's params as "
         f"{reference_name}")
  names, leaves, ref_leaves = check_structure(
      island_params, reference, islands_name, reference_name, fix)
  if not leaves:
    return None
  shapes = [tuple(np.shape(leaf)) for leaf in leaves]
  ref_shapes = [tuple(np.shape(leaf)) for leaf in ref_leaves]
  if stacked is None:
    stacked = len(shapes[0]) > len(ref_shapes[0])
  if not stacked:
    for name, shape, ref in zip(names, shapes, ref_shapes):
      if shape == ref:
        continue
      looks_stacked = shape[1:] == ref
      raise ValueError(
          f"{islands_name}{name} has shape {shape} but {reference_name}"
          f"{name} has {ref}: in the per-island form (axis_name given) "
          f"{islands_name} is this island's trees, shaped like "
          f"{reference_name}" + (
              f"; it looks stacked (a leading axis of {shape[0]}): inside "
              "shard_map take a[0] of each island's [1, ...] block, or "
              "drop axis_name for the stacked form" if looks_stacked
              else ""))
    return None
  if all(shape == ref for shape, ref in zip(shapes, ref_shapes)):
    raise ValueError(
        f"{islands_name} has no leading island axis (its leaves have "
        f"{reference_name}'s shapes, e.g. {names[0]} {shapes[0]}): with "
        f"axis_name=None (the stacked form) {islands_name} needs a leading "
        "axis of k islands (island_copies(x, k)); inside shard_map or "
        "pmap, pass axis_name=<the islands' mesh axis>")
  for name, shape, ref in zip(names, shapes, ref_shapes):
    if shape[1:] != ref:
      raise ValueError(
          f"{islands_name}{name} has shape {shape} but {reference_name}"
          f"{name} has {ref}: in the stacked form each leaf of "
          f"{islands_name} is (k,) + the leaf's shape; give the islands "
          f"of {reference_name}'s model")
  k = shapes[0][0]
  for name, shape in zip(names, shapes):
    if shape[0] != k:
      raise ValueError(
          f"{islands_name}'s leading (island) axes differ: {names[0]} has "
          f"{k} islands, {name} has {shape[0]}; every leaf needs the same "
          "k (island_copies(x, k))")
  return k


def check_like(tree, like, tree_name: str, like_name: str,
               fix: str) -> None:
  """`tree` has `like`'s structure and each leaf its shape (a state's
  per-island part against the islands' trees); `tree` None passes."""
  if tree is None:
    return
  names, leaves, like_leaves = check_structure(tree, like, tree_name,
                                               like_name, fix)
  for name, leaf, other in zip(names, leaves, like_leaves):
    if tuple(np.shape(leaf)) != tuple(np.shape(other)):
      raise ValueError(
          f"{tree_name}{name} has shape {tuple(np.shape(leaf))} but "
          f"{like_name}{name} has {tuple(np.shape(other))}; {fix}")


def check_weights(weights, num_islands: int | None, stacked: bool) -> None:
  """weights: [k] in the stacked form, a scalar per island (None: all 1).
  Reads the shape only."""
  if weights is None:
    return
  shape = tuple(np.shape(weights))
  if stacked and shape != (num_islands,):
    raise ValueError(
        f"weights has shape {shape} but island_params hold {num_islands} "
        f"islands: the stacked form takes one weight per island, shape "
        f"({num_islands},) (or None for all 1)")
  if not stacked and shape != ():
    raise ValueError(
        f"weights has shape {shape}: in the per-island form (axis_name "
        "given) weights is this island's scalar (e.g. weight[0] of its "
        "[1] block)")


def check_fragment(fragment, num_fragments: int, function: str) -> None:
  """fragment is a Python int in 0..num_fragments - 1 (static under jit)."""
  if isinstance(fragment, bool) or not isinstance(fragment,
                                                   numbers.Integral):
    raise TypeError(
        f"{function}: fragment={fragment!r} must be a Python int in "
        f"0..{num_fragments - 1} (under jit mark it static: "
        "static_argnums)")
  if not 0 <= fragment < num_fragments:
    raise ValueError(
        f"{function}: fragment={fragment} is out of range: this state has "
        f"{num_fragments} fragments, so give fragment in "
        f"0..{num_fragments - 1}")


def check_assignment(assignment, params, function: str) -> None:
  """A streaming state's assignment has one fragment per leaf of params."""
  leaves = len(jax.tree.leaves(params))
  if len(assignment) != leaves:
    raise ValueError(
        f"{function}: state.assignment gives {len(assignment)} leaves a "
        f"fragment but global_params has {leaves} leaves: the state was "
        "made for other params; make it with streaming_init(global_params, "
        "...)")


def check_update(reference, island_params, *, residuals, codec_state,
                 weights, compression, axis_name, made_by: str,
                 used_by: str, reference_name: str = "global_params",
                 islands_name: str = "island_params",
                 state_name: str = "state.") -> int | None:
  """Every check of an update's arguments against each other: the
  islands' trees against `reference` (one copy's shapes) in the form
  `axis_name` says, the weights, the state's residuals (shaped like the
  islands' trees) and codec state (made for `compression`). Returns k
  (None per island)."""
  stacked = axis_name is None
  k = check_islands(reference, island_params, stacked, reference_name,
                    islands_name)
  check_weights(weights, k, stacked)
  check_like(residuals, island_params, f"{state_name}residuals",
             islands_name,
             f"error feedback's residuals are shaped like {islands_name}: "
             f"make the state with {made_by}(..., num_islands=k) for the "
             "stacked form's k islands, or num_islands=None per island")
  if state_name:
    check_residuals_for_codec(residuals, compression, made_by, used_by)
  check_codec_state(codec_state, compression, reference, made_by, used_by,
                    f"{state_name}codec_state")
  return k
