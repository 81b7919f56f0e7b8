"""The outer object's asynchronous form (algorithm/outer_windows.py): a
loop of a user's own that applies each island's result as it arrives, its
pseudo-gradient scaled by its share of the window's tokens, summed in a
window from whose first x and state x steps. The elastic coordinator runs
the same calls (tests/test_elastic_async.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from diloco_jax.algorithm import library as diloco
from diloco_jax.algorithm import outer_windows

_K = 3
_TOKENS = np.array([3.0, 1.0, 2.0], np.float32)


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(8,)), jnp.float32)}


def _trained(x, seed):
  """k islands' params after their inner steps, stacked [k, ...]."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda a: a[None] + jnp.asarray(
          rng.normal(0, 0.05, (_K,) + a.shape), jnp.float32), x)


def _one(tree, i):
  return jax.tree.map(lambda a: a[i], tree)


def _window_of(outer, x, state, islands):
  """One window: each island's result applied as it arrives (order 2, 0,
  1), each against the x all started from, scaled by its token share."""
  start = x
  window = outer.open_window(x, state)
  for i in (2, 0, 1):
    synced = outer.arrival_mean(x, state, i, _one(islands, i), start,
                                scale=_TOKENS[i] / _TOKENS.sum())
    x, state, window = outer.add_arrival(window, synced)
  return x, state


_EXACT = {
    "fp32-sgd": lambda: diloco.diloco(optax.sgd(0.7)),
    "fp32-nesterov": lambda: diloco.diloco(diloco.nesterov(0.7, 0.9)),
    "fp32-adam": lambda: diloco.diloco(optax.adam(0.1)),
    "sparseloco": lambda: diloco.diloco(codec=diloco.codec(
        "sparseloco", chunk_size=16, density=0.25)),
}


def _two(outer):
  """(window run, round run) after two windows and two rounds: each
  (x, state), the islands trained the same steps from each run's x."""
  x_w = x_r = _params()
  state_w = outer.init(x_w, _K)
  state_r = outer.init(x_r, _K)
  window_step = jax.jit(lambda x, s, y: _window_of(outer, x, s, y))
  for round_ in range(2):
    x_r, _, state_r = outer.update(x_r, _trained(x_r, round_ + 1), state_r,
                                   weights=jnp.asarray(_TOKENS))
    x_w, state_w = window_step(x_w, state_w, _trained(x_w, round_ + 1))
  return (x_w, state_w), (x_r, state_r)


def _close(got, want, tolerance):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("case", sorted(_EXACT))
def test_windows_of_one_result_per_island_equal_rounds(case):
  """Two windows, each of one result per island in another order than
  the islands', move x, the outer optimizer's state and the islands'
  residuals (SparseLoCo's momentum) as two rounds of the token-weighted
  mean do: the optimizer's state (Nesterov's momentum, Adam's moments)
  moves once a window. Each window sums its k = 3 scaled means in
  another order than the round's weighted mean: float32 reassociation,
  ~1e-7 relative, which Adam's division by its second moment's root can
  bring to ~1e-6 on x."""
  (x_w, state_w), (x_r, state_r) = _two(_EXACT[case]())
  _close((x_w, state_w.outer_opt_state, state_w.residuals),
         (x_r, state_r.outer_opt_state, state_r.residuals), 2e-6)
  np.testing.assert_array_equal(state_w.included, state_r.included)
  assert int(state_w.round) == int(state_r.round) == 2


def test_a_window_quantizes_each_result_alone():
  """int8 with error feedback: each result is quantized alone, unscaled
  (as an island encodes its own), so its residual is the one a round
  leaves it (float32 reassociation, 1e-6); x differs from the round's by
  the requantization of the islands' sum that the round's all-reduce
  does and an arrival cannot (measured 0.4% of the two rounds' move with
  Adam; a residual of the scaled result, the bug this test guards, is
  several times off)."""
  outer = diloco.diloco(optax.adam(0.1), diloco.codec("int8"),
                        error_feedback=True)
  (x_w, state_w), (x_r, state_r) = _two(outer)
  _close(state_w.residuals, state_r.residuals, 1e-6)
  norm = lambda tree: np.sqrt(sum(np.sum(np.square(leaf))
                                  for leaf in jax.tree.leaves(tree)))
  moved = norm(jax.tree.map(jnp.subtract, x_r, _params()))
  assert norm(jax.tree.map(jnp.subtract, x_w, x_r)) < 0.02 * moved


def test_a_result_that_is_not_finite_changes_nothing():
  """A non-finite result leaves x, the state (residuals and low rank's
  bases included) and the window as the last result left them."""
  outer = diloco.diloco(diloco.nesterov(0.7, 0.9),
                        diloco.codec("lowrank", rank=2), error_feedback=True)
  x = _params()
  state = outer.init(x, _K)
  islands = _trained(x, 1)
  window = outer.open_window(x, state)
  x1, state1, window1 = outer.add_arrival(window, outer.arrival_mean(
      x, state, 0, _one(islands, 0), x, scale=0.5))
  bad = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), _one(islands, 1))
  synced = outer.arrival_mean(x1, state1, 1, bad, x, scale=0.5)
  assert not bool(synced.anyone)
  x2, state2, window2 = outer.add_arrival(window1, synced)
  _close((x2, state2, window2), (x1, state1, window1), 0)


@pytest.mark.parametrize("outer,k,message", [
    (diloco.diloco(overlap=diloco.one_step_delay()), _K,
     "open_window: .*no_overlap"),
    (diloco.diloco(), None, "open_window: the state is one island's"),
    (diloco.diloco(codec=diloco.codec("int8")), _K,
     "open_window: the state was made by another outer object"),
], ids=["overlap", "per-island state", "another object's state"])
def test_what_windows_cannot_take_is_one_line(outer, k, message):
  x = _params()
  state = (diloco.diloco() if "another" in message else outer).init(x, k)
  with pytest.raises(ValueError, match=message) as error:
    outer.open_window(x, state)
  assert "\n" not in str(error.value)


def test_a_result_counts_its_share_of_the_window_less_when_overtaken():
  """A result weighing 300 of a window's 1,200 moves x by a quarter of its
  pseudo-gradient while the results applied since its call started are
  at most the one each other member sends (3 of 4 members); two more
  than that, half a window, and it counts 1 / 1.5 as much."""
  assert outer_windows.arrival_scale(300.0, 1200.0, 0, 4) == 0.25
  assert outer_windows.arrival_scale(300.0, 1200.0, 3, 4) == 0.25
  assert outer_windows.arrival_scale(300.0, 1200.0, 5, 4) == pytest.approx(
      0.25 / 1.5)
  assert outer_windows.arrival_scale(300.0, 1200.0, 11, 4) == pytest.approx(
      0.25 / 3)
