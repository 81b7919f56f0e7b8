"""The outer object's argument checks (outer.py calls them): each misuse
one plain ValueError or TypeError naming what is wrong and the fix, raised
before it reaches jax.vmap or a collective. They read shapes, structures
and the state's recipe only, so they work under jit too."""

import jax

from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.algorithm import library_checks
from diloco_jax.algorithm import outer_overlaps
from diloco_jax.algorithm import outer_state


def check_state(outer, state, function: str) -> None:
  """`state` is an OuterState made by an object equal to `outer`."""
  if not isinstance(state, outer_state.OuterState):
    raise TypeError(f"{function}: state is a {type(state).__name__}, not "
                    "an OuterState: make it with outer.init(params, "
                    "num_islands)")
  if state.recipe is None or (state.recipe.codec, state.recipe.overlap,
                              state.recipe.error_feedback) != (
                                  outer.codec, outer.overlap,
                                  outer.error_feedback):
    made = "nothing" if state.recipe is None else state.recipe.describe()
    this = outer_state.Recipe(outer.codec, outer.overlap,
                              outer.error_feedback).describe()
    raise ValueError(
        f"{function}: the state was made by another outer object "
        f"({made}), this one has {this}: make the state with this "
        "object's init, or call the object that made it")


def check_outer_optimizer(outer, params, state, function: str) -> None:
  """state.outer_opt_state has the structure outer.outer_tx.init gives
  (one per fragment under streaming): a state made with another outer
  optimizer would fail deep inside optax, or step with the wrong one."""
  made = state.outer_opt_state
  if isinstance(outer.overlap, outer_overlaps.Streaming):
    expected = tuple(
        jax.eval_shape(outer.outer_tx.init,
                       fragments_lib.select(params, state.recipe.assignment,
                                            f))
        for f in range(outer.overlap.num_fragments))
  else:
    expected = jax.eval_shape(outer.outer_tx.init, params)
  if jax.tree.structure(made) != jax.tree.structure(expected):
    raise ValueError(
        f"{function}: state.outer_opt_state is not this object's outer "
        f"optimizer's state (its tree is {jax.tree.structure(made)}, "
        f"outer_tx.init gives {jax.tree.structure(expected)}): the state "
        "was made with another outer_tx; make it with this object's init")


def check_update(outer, params, island_params, state, weights, axis_name,
                 fragment, function: str) -> bool:
  """Every argument against the others; returns whether stacked."""
  check_state(outer, state, function)
  check_outer_optimizer(outer, params, state, function)
  stacked = state.included.ndim == 1
  check_form(stacked, axis_name, function)
  check_fragment_of(outer, fragment, function)
  k = library_checks.check_update(
      params, island_params, residuals=state.residuals,
      codec_state=state.codec_state, weights=weights,
      compression=outer.codec, axis_name=axis_name, made_by="outer.init",
      used_by=f"outer.{function}")
  if stacked and k != state.included.shape[0]:
    raise ValueError(
        f"{function}: island_params hold {k} islands but the state was "
        f"made for {state.included.shape[0]}: give every island's params "
        f"stacked [k, ...], or make the state with init(params, {k})")
  return stacked


def check_fragment_of(outer, fragment, function: str) -> None:
  """`fragment` is one of a streaming object's fragments, and None for
  any other overlap."""
  if isinstance(outer.overlap, outer_overlaps.Streaming):
    if fragment is None:
      raise ValueError(
          f"{function}: streaming sends one fragment at a time: give "
          f"fragment=p (0..{outer.overlap.num_fragments - 1}, e.g. from "
          "outer.schedule(step, ...))")
    library_checks.check_fragment(fragment, outer.overlap.num_fragments,
                                  function)
  elif fragment is not None:
    raise ValueError(f"{function}: fragment={fragment!r} with overlap "
                     f"{outer.overlap}: only streaming(...) sends "
                     "fragments; leave fragment out")


def check_form(stacked: bool, axis_name, function: str) -> None:
  """A stacked state goes with axis_name None, one island's with one."""
  if stacked and axis_name is not None:
    raise ValueError(
        f"{function}: axis_name={axis_name!r} but the state is stacked "
        "(made with num_islands=k): inside shard_map give each device "
        "this_island(state) (with island_specs(state, axis) as its spec), "
        "or leave axis_name out for the stacked form")
  if not stacked and axis_name is None:
    raise ValueError(
        f"{function}: the state is one island's (made with "
        "num_islands=None), so this runs per island: inside shard_map or "
        "pmap give axis_name=<the islands' mesh axis>; for stacked islands "
        "[k, ...] make the state with init(params, num_islands=k)")


def check_window(outer, state, function: str) -> None:
  """Results that arrive one at a time (outer_windows.py): the plain
  outer step, on a stacked state this object made."""
  if not isinstance(outer.overlap, outer_overlaps.NoOverlap):
    raise ValueError(
        f"{function}: results that arrive one at a time take the plain "
        f"outer step; overlap {outer.overlap} has no rounds to overlap "
        "here (build it with diloco(..., overlap=no_overlap()))")
  check_state(outer, state, function)
  if state.included.ndim != 1:
    raise ValueError(
        f"{function}: the state is one island's (made with "
        "num_islands=None); results that arrive one at a time meet where "
        "x is: make the state with init(params, num_islands=k)")


def check_merge(outer, params, island_params, state, fragment) -> None:
  """`merge`'s arguments: a streaming object, a fragment of it, islands
  shaped as the state's form."""
  check_state(outer, state, "merge")
  if not isinstance(outer.overlap, outer_overlaps.Streaming):
    raise ValueError(f"merge: overlap {outer.overlap} has no fragments; "
                     "merge belongs to diloco(overlap=streaming(...))")
  library_checks.check_fragment(fragment, outer.overlap.num_fragments,
                                "merge")
  library_checks.check_islands(params, island_params,
                               state.included.ndim == 1)
