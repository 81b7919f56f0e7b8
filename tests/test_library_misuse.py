"""The library's misuses (library_checks.py): each one a plain ValueError or
TypeError naming the argument, what is wrong and the fix, raised before the
misuse reaches jax.vmap or a collective. Tiny pytrees, no training: each
call raises before any arithmetic.
"""
import collections
import functools
import math

import jax
import jax.numpy as jnp
import pytest

from diloco_jax.algorithm import library as diloco
from diloco_jax.codecs import dense as dense_codecs

K = 2
TX = diloco.nesterov()


def _params():
  # w is 16 x 16 so the low-rank codecs factor it at ranks 2 and 4.
  return {"b": jnp.zeros((3,)), "w": jnp.zeros((16, 16))}


def _islands(k=K):
  return diloco.island_copies(_params(), k)


# --- codec options -------------------------------------------------------


@pytest.mark.parametrize("make, error, message", [
    (lambda: diloco.codec("int8", block_size=0), ValueError,
     r"block_size=0 is out of range .* positive int"),
    (lambda: diloco.codec("int4", block_size=3), ValueError,
     r"block_size=3 .* even"),
    (lambda: diloco.codec("topk", fallback="fp4", block_size=5), ValueError,
     r"block_size=5 .* even"),
    (lambda: diloco.codec("int8", block_size=2.5), TypeError,
     r"block_size=2\.5 must be a positive int"),
    (lambda: dense_codecs.make_codec("fp4", -2), ValueError,
     r"block_size=-2 is out of range"),
    (lambda: diloco.codec("topk", topk_fraction=2), ValueError,
     r"topk_fraction=2 is out of range: give a value in \(0, 1\)"),
    (lambda: diloco.codec("sign_prune", prune_rate=1.5), ValueError,
     r"prune_rate=1\.5 is out of range"),
    (lambda: diloco.codec("lowrank", rank=0), ValueError,
     r"rank=0 is out of range: give a value in \[1, inf\)"),
    (lambda: diloco.codec("lowrank", rank=2.0), TypeError,
     r"rank=2\.0 must be an int"),
    (lambda: diloco.codec("adaptive_lowrank", min_rank=-1), ValueError,
     r"min_rank=-1 is out of range"),
    (lambda: diloco.codec("adaptive_lowrank", rank=4, min_rank=8),
     ValueError, r"min_rank=8 exceeds rank=4: .* give min_rank <= rank"),
    (lambda: diloco.codec("adaptive_lowrank", energy_fraction=math.nan),
     ValueError, r"energy_fraction=nan is out of range"),
    (lambda: diloco.codec("sparseloco", density=-0.1), ValueError,
     r"density=-0\.1 is out of range"),
    (lambda: diloco.sparseloco(density=0), ValueError,
     r"density=0 is out of range"),
    (lambda: diloco.codec("sparseloco", chunk_size=1), ValueError,
     r"chunk_size=1 is out of range"),
    (lambda: diloco.codec("sparseloco", bits=9), ValueError,
     r"bits=9 is out of range: give a value in \[2, 8\]"),
    (lambda: diloco.codec("sparseloco", beta=1.0), ValueError,
     r"beta=1\.0 is out of range: give a value in \[0, 1\)"),
    (lambda: diloco.codec("topk", topk_fraction="0.1"), TypeError,
     r"topk_fraction='0\.1' must be a number"),
], ids=["block_size_0", "block_size_odd_int4", "block_size_odd_fallback",
        "block_size_float", "make_codec_block_size", "topk_fraction",
        "prune_rate", "rank_0", "rank_float", "min_rank_negative",
        "min_rank_above_rank", "energy_fraction_nan", "density_negative",
        "sparseloco_density_0", "chunk_size", "bits", "beta", "not_a_number"])
def test_codec_options_out_of_range(make, error, message):
  with pytest.raises(error, match=message):
    make()


def test_num_islands_must_be_a_positive_int():
  with pytest.raises(ValueError, match=r"init: num_islands=0 must be at "
                     "least 1"):
    diloco.init(_params(), TX, 0)
  with pytest.raises(TypeError, match=r"eager_init: num_islands=2\.0 must "
                     "be a positive int"):
    diloco.eager_init(_params(), TX, 2.0)
  with pytest.raises(TypeError, match=r"island_copies: num_islands=None"):
    diloco.island_copies(_params(), None)


# --- the islands' trees ----------------------------------------------------


def _forgotten_axis_calls():
  """Each update given one island's trees with axis_name=None."""
  x, y = _params(), _params()
  points, eager_state = diloco.eager_init(x, TX, K)
  one_point = _params()
  return {
      "outer_update": lambda: diloco.outer_update(
          x, y, diloco.init(x, TX, K), TX),
      "pseudo_gradient_mean": lambda: diloco.pseudo_gradient_mean(x, y),
      "eager_update": lambda: diloco.eager_update(
          one_point, one_point, eager_state, TX),
      "eager_settle": lambda: diloco.eager_settle(one_point, eager_state,
                                                  TX),
      "fragment_send": lambda: diloco.fragment_send(
          x, y, diloco.streaming_init(x, TX, 2, K), 0, TX),
  }


@pytest.mark.parametrize("function", list(_forgotten_axis_calls()))
def test_a_forgotten_axis_name_says_so(function):
  """Per-island trees in the stacked form (axis_name=None): before, vmap
  mapped the first param axis as islands or failed at a rank-0 leaf."""
  islands = "points" if function.startswith("eager") else "island_params"
  with pytest.raises(ValueError, match=(
      rf"{islands} has no leading island axis .* axis_name=None \(the "
      r"stacked form\) .* pass axis_name=")):
    _forgotten_axis_calls()[function]()


def test_the_checks_run_under_jit_on_abstract_values():
  x = _params()
  state = diloco.init(x, TX, K)
  update = jax.jit(functools.partial(diloco.outer_update, outer_tx=TX))
  with pytest.raises(ValueError, match="has no leading island axis"):
    update(x, x, state)


def test_stacked_trees_in_the_per_island_form_say_so():
  x = _params()
  state = diloco.init(x, TX)
  with pytest.raises(ValueError, match=(
      r"island_params\['b'\] has shape \(2, 3\) but global_params\['b'\] "
      r"has \(3,\): in the per-island form .* looks stacked")):
    diloco.outer_update(x, _islands(), state, TX, axis_name="islands")


def test_island_axes_that_differ_between_leaves():
  y = _islands()
  y["w"] = y["w"][:1]
  with pytest.raises(ValueError, match=(
      r"island_params's leading \(island\) axes differ: \['b'\] has 2 "
      r"islands, \['w'\] has 1")):
    diloco.outer_update(_params(), y, diloco.init(_params(), TX, K), TX)


def test_weights_for_another_number_of_islands():
  x = _params()
  with pytest.raises(ValueError, match=(
      r"weights has shape \(3,\) but island_params hold 2 islands: .* "
      r"shape \(2,\)")):
    diloco.outer_update(x, _islands(), diloco.init(x, TX, K), TX,
                        weights=jnp.ones(3))
  with pytest.raises(ValueError, match=(
      r"weights has shape \(2,\): in the per-island form .* scalar")):
    diloco.outer_update(x, x, diloco.init(x, TX), TX, weights=jnp.ones(2),
                        axis_name="islands")


def test_a_state_made_for_another_number_of_islands():
  x = _params()
  state = diloco.init(x, TX, 3, error_feedback=True)
  with pytest.raises(ValueError, match=(
      r"state\.residuals\['b'\] has shape \(3, 3\) but island_params\['b'\] "
      r"has \(2, 3\); .* init\(\.\.\., num_islands=k\)")):
    diloco.outer_update(x, _islands(), state, TX)
  points, eager_state = diloco.eager_init(x, TX, 3)
  with pytest.raises(ValueError, match=(
      r"state\.own_shares\['b'\] has shape \(3, 3\) but points\['b'\] has "
      r"\(2, 3\); eager_update: .* eager_init\(\.\.\., num_islands=k\)")):
    diloco.eager_update(_islands(), _islands(), eager_state, TX)


def test_eager_islands_and_points_of_another_number_of_islands():
  points, state = diloco.eager_init(_params(), TX, K)
  with pytest.raises(ValueError, match=(
      r"island_params\['b'\] has shape \(3, 3\) but points\['b'\] has "
      r"\(2, 3\); island_params are the islands after their inner steps")):
    diloco.eager_update(points, _islands(3), state, TX)


def test_stacked_references_of_another_number_of_islands():
  with pytest.raises(ValueError, match=(
      r"island_params\['b'\] has shape \(2, 3\) but reference\['b'\] has "
      r"\(3, 3\); with stacked_reference")):
    diloco.pseudo_gradient_mean(_islands(3), _islands(),
                                stacked_reference=True)


@pytest.mark.parametrize("change, message", [
    (lambda y: {"w": y["w"]},
     r"island_params does not have global_params's tree structure: it "
     r"lacks \['b'\]"),
    (lambda y: {**y, "extra": y["b"]},
     r"it has \['extra'\] that global_params lacks"),
    (lambda y: collections.OrderedDict(y),
     r"the same leaves in other containers"),
    (lambda y: {**y, "w": y["w"][:, :8]},
     r"island_params\['w'\] has shape \(2, 8, 16\) but global_params\['w'\] "
     r"has \(16, 16\)"),
], ids=["missing_leaf", "extra_leaf", "other_container", "leaf_shape"])
def test_island_trees_that_do_not_match_the_params(change, message):
  x = _params()
  with pytest.raises(ValueError, match=message):
    diloco.outer_update(x, change(_islands()), diloco.init(x, TX, K), TX)


# --- the codec given to init and to the update -----------------------------


ADAPTIVE = dict(name="adaptive_lowrank", rank=4, min_rank=2)


def _update(function, made_with, used_with):
  """`function` with a state made for codec `made_with`, given codec
  `used_with` (None: fp32)."""
  x, y = _params(), _islands()
  if function == "outer_update":
    state = diloco.init(x, TX, K, compression=made_with)
    return lambda: diloco.outer_update(x, y, state, TX,
                                       compression=used_with)
  if function == "eager_update":
    points, state = diloco.eager_init(x, TX, K, compression=made_with)
    return lambda: diloco.eager_update(points, y, state, TX,
                                       compression=used_with)
  state = diloco.streaming_init(x, TX, 2, K, compression=made_with)
  return lambda: diloco.fragment_send(x, y, state, 0, TX,
                                      compression=used_with)


MADE_BY = {"outer_update": "init", "eager_update": "eager_init",
           "fragment_send": "streaming_init"}


@pytest.mark.parametrize("function", list(MADE_BY))
@pytest.mark.parametrize("made, used, message", [
    (None, ADAPTIVE, r"compression='adaptive_lowrank' keeps state .* but "
     r"state\.codec_state is None"),
    (ADAPTIVE, None, r"state\.codec_state holds a codec's state .* but "
     r"compression='fp32' keeps none"),
    ({**ADAPTIVE, "rank": 2, "min_rank": 1}, ADAPTIVE,
     r"state\.codec_state's basis 0 has shape \(16, 2\), not \(16, 4\)"),
], ids=["left_out_of_init", "left_out_of_update", "another_rank"])
def test_the_codec_given_to_init_and_the_update_must_match(function, made,
                                                           used, message):
  codec = lambda settings: None if settings is None else diloco.codec(
      **settings)
  with pytest.raises(ValueError, match=(
      rf"{function}: {message}.* give the same codec to "
      rf"{MADE_BY[function]} and {function}")):
    _update(function, codec(made), codec(used))()


def test_a_codec_state_for_other_params():
  x = _params()
  state = diloco.init({"w": x["w"], "v": x["w"]}, TX, K,
                      compression=diloco.codec(**ADAPTIVE))
  with pytest.raises(ValueError, match=(
      r"outer_update: state\.codec_state has 2 entries but "
      r"compression='adaptive_lowrank' factors 1 matrices")):
    diloco.outer_update(x, _islands(), state, TX,
                        compression=diloco.codec(**ADAPTIVE))


def test_pseudo_gradient_mean_without_the_codec_state():
  with pytest.raises(ValueError, match=(
      r"pseudo_gradient_mean: compression='adaptive_lowrank' keeps state "
      r".* but codec_state is None")):
    diloco.pseudo_gradient_mean(_params(), _islands(),
                                compression=diloco.codec(**ADAPTIVE))


# --- SparseLoCo needs error feedback --------------------------------------


@pytest.mark.parametrize("function", ["init", "eager_init",
                                      "streaming_init"])
def test_sparseloco_without_error_feedback(function):
  """SparseLoCo's momentum is the error feedback: without it a run was
  silently worse (0.727 against 0.613 test MSE)."""
  outer_tx, compression = diloco.sparseloco()
  extra = (2,) if function == "streaming_init" else ()
  with pytest.raises(ValueError, match=(
      rf"{function}\(compression=<sparseloco codec>, error_feedback=False\)"
      rf": .* needs error_feedback=True; call {function}\(\.\.\., "
      r"compression=compression, error_feedback=True\)")):
    getattr(diloco, function)(_params(), outer_tx, *extra, K,
                              compression=compression)


def test_sparseloco_update_on_a_state_without_residuals():
  outer_tx, compression = diloco.sparseloco()
  x = _params()
  state = diloco.init(x, outer_tx, K)  # the codec left out of init
  with pytest.raises(ValueError, match=(
      r"outer_update: compression is SparseLoCo's, .* state\.residuals is "
      r"None: make the state with init\(\.\.\., compression=compression, "
      r"error_feedback=True\)")):
    diloco.outer_update(x, _islands(), state, outer_tx,
                        compression=compression)


# --- Streaming DiLoCo's fragments ------------------------------------------


@pytest.mark.parametrize("function", ["fragment_send", "fragment_merge"])
@pytest.mark.parametrize("fragment", [2, -1])
def test_a_fragment_out_of_range(function, fragment):
  x = _params()
  state = diloco.streaming_init(x, TX, 2, K)
  extra = (TX,) if function == "fragment_send" else ()
  with pytest.raises(ValueError, match=(
      rf"{function}: fragment={fragment} is out of range: this state has 2 "
      r"fragments, so give fragment in 0\.\.1")):
    getattr(diloco, function)(x, _islands(), state, fragment, *extra)


def test_a_traced_fragment():
  x = _params()
  state = diloco.streaming_init(x, TX, 2, K)
  with pytest.raises(TypeError, match=(
      r"fragment_merge: fragment=.* must be a Python int in 0\.\.1 .* "
      "static_argnums")):
    jax.jit(diloco.fragment_merge)(x, _islands(), state, 0)


def test_a_streaming_state_for_other_params():
  x = _params()
  state = diloco.streaming_init({**x, "v": x["b"]}, TX, 2, K)
  with pytest.raises(ValueError, match=(
      r"fragment_merge: state\.assignment gives 3 leaves a fragment but "
      r"global_params has 2 leaves")):
    diloco.fragment_merge(x, _islands(), state, 0)


def test_merge_trees_that_do_not_match_the_params():
  x = _params()
  state = diloco.streaming_init(x, TX, 2, K)
  y = _islands()
  y["w"] = y["w"][:1]
  with pytest.raises(ValueError, match=r"leading \(island\) axes differ"):
    diloco.fragment_merge(x, y, state, 0)


# --- the outer object (diloco(...)) ---------------------------------------


def _outer_misuses():
  """name -> (call that misuses the object, error, message)."""
  x = _params()
  int8 = diloco.diloco(codec=diloco.codec("int8"))
  streams = diloco.diloco(overlap=diloco.streaming(2, assignment=(0, 1)))
  return {
      "another object's state": (
          lambda: diloco.diloco().update(x, _islands(), int8.init(x, K)),
          ValueError, r"update: the state was made by another outer object "
          r"\(codec 'int8'.*this one has codec 'fp32'"),
      "not an OuterState": (
          lambda: int8.update(x, _islands(), diloco.init(x, TX, K)),
          TypeError, r"state is a DiLoCoState, not an OuterState"),
      "a forgotten axis_name": (
          lambda: int8.update(x, _params(), int8.init(x)), ValueError,
          r"the state is one island's .* give axis_name=<the islands' mesh "
          r"axis>"),
      "axis_name with a stacked state": (
          lambda: int8.update(x, _params(), int8.init(x, K),
                              axis_name="islands"), ValueError,
          r"the state is stacked .* this_island\(state\)"),
      "islands without the k axis": (
          lambda: int8.update(x, _params(), int8.init(x, K)), ValueError,
          r"island_params has no leading island axis"),
      "another number of islands": (
          lambda: int8.update(x, _islands(3), int8.init(x, K)), ValueError,
          r"island_params hold 3 islands but the state was made for 2"),
      "islands of another model": (
          lambda: int8.update(x, {"b": _islands()["b"]}, int8.init(x, K)),
          ValueError, r"island_params"),
      "no fragment under streaming": (
          lambda: streams.update(x, _islands(), streams.init(x, K)),
          ValueError, r"streaming sends one fragment at a time: give "
          r"fragment=p \(0\.\.1"),
      "a fragment out of range": (
          lambda: streams.update(x, _islands(), streams.init(x, K),
                                 fragment=2), ValueError,
          r"fragment=2 is out of range"),
      "a fragment without streaming": (
          lambda: int8.update(x, _islands(), int8.init(x, K), fragment=0),
          ValueError, r"fragment=0 with overlap .* leave fragment out"),
      "merge without streaming": (
          lambda: int8.merge(x, _islands(), int8.init(x, K), fragment=0),
          ValueError, r"merge: overlap .* has no fragments"),
      "sparseloco without error feedback": (
          lambda: diloco.diloco(codec=diloco.codec("sparseloco"),
                                error_feedback=False), ValueError,
          r"diloco\(codec=<sparseloco codec>, error_feedback=False\): "
          r".* leave error_feedback unset"),
      "another outer optimizer's state": (
          lambda: int8.update(x, _islands(), diloco.diloco(
              outer_tx=diloco.adam(0.1), codec=diloco.codec("int8")).init(
                  x, K)), ValueError,
          r"state.outer_opt_state is not this object's outer optimizer's "
          r"state .* made with another outer_tx"),
      "an overlap that is not one": (
          lambda: diloco.diloco(overlap="one_step_delay"), TypeError,
          r"overlap='one_step_delay': give no_overlap\(\), "
          r"one_step_delay\(\), eager\(\) or streaming"),
      "own_weight out of range": (
          lambda: diloco.eager(own_weight=2), ValueError,
          r"own_weight=2 is out of range"),
      "negative warm-up": (
          lambda: diloco.eager(warmup_rounds=-1), ValueError,
          r"warmup_rounds=-1 is out of range"),
      "no fragments": (
          lambda: diloco.streaming(0), ValueError,
          r"num_fragments=0 is out of range"),
      "alpha out of range": (
          lambda: diloco.streaming(2, alpha=1.5), ValueError,
          r"alpha=1\.5 is out of range"),
      "an assignment of other params": (
          lambda: diloco.diloco(overlap=diloco.streaming(
              2, assignment=(0, 1, 1))).init(x, K), ValueError,
          r"assignment \(0, 1, 1\) must give each of the 2 leaves"),
  }


@pytest.mark.parametrize("name", list(_outer_misuses()))
def test_the_outer_object_s_misuses(name):
  call, error, message = _outer_misuses()[name]
  with pytest.raises(error, match=message):
    call()


def test_the_outer_object_brings_each_overlap_s_outer_step():
  """outer_tx=None takes the outer step measured for the overlap, and
  SparseLoCo's codec its own step and error feedback."""
  x = _params()
  mean = jax.tree.map(jnp.ones_like, x)
  def first_step(outer):  # x's move on a mean of ones, one step
    updates, _ = outer.outer_tx.update(mean, outer.outer_tx.init(x), x)
    return float(updates["b"][0])
  expected = {diloco.no_overlap(): diloco.nesterov(0.7, 0.9),
              diloco.one_step_delay(): diloco.nesterov(0.8, 0.0),
              diloco.eager(): diloco.nesterov(0.5, 0.7),
              diloco.eager(own_weight=None): diloco.nesterov(1.0, 0.0)}
  for overlap, tx in expected.items():
    outer = diloco.diloco(overlap=overlap)
    updates, _ = tx.update(mean, tx.init(x), x)
    assert first_step(outer) == float(updates["b"][0]), overlap
  assert diloco.eager().warmup_rounds == 2
  assert diloco.eager(own_weight=None).warmup_rounds == 0
  sparse = diloco.diloco(codec=diloco.codec("sparseloco"))
  assert sparse.error_feedback and first_step(sparse) == -1.0
  assert sparse.init(x, K).residuals is not None
