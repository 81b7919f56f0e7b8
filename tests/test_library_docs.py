"""docs/library.md's code runs as the page shows it and trains.

The page leaves four names to the reader's own code: `init_params(...)`,
`loss_fn(params, batch)`, `next_batch()` ([k, ...] batches) and
`evaluate(params)`. Given them for a small least-squares problem, every
Python block of the page runs in order, verbatim, in one namespace (as a
reader pasting them into a notebook would): each loop that trains leaves
an x whose loss fell, the eager loop's evaluations of `outer.model` fall
with it, and the per-island block gives the stacked form's round.
"""
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "library.md"
ISLAND_BATCH, FEATURES, OUTPUTS = 16, 8, 4


def _blocks() -> list[str]:
  return re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def _reader_code(rng):
  """The reader's model, loss and data: y = X W* + b* with noise; every
  island draws its own examples. W* and b* are small enough (0.2 of a
  standard normal) that the page's 1,000 inner steps at lr 3e-4 can reach
  them from zero, so each loop's end says how well it trained."""
  true_w = 0.2 * rng.normal(size=(FEATURES, OUTPUTS)).astype(np.float32)
  true_b = 0.2 * rng.normal(size=(OUTPUTS,)).astype(np.float32)

  def init_params(*_):
    return {"w": jnp.zeros((FEATURES, OUTPUTS)), "b": jnp.zeros(OUTPUTS)}

  def loss_fn(params, batch):
    features, targets = batch
    return jnp.mean((features @ params["w"] + params["b"] - targets) ** 2)

  def examples(*lead):
    features = rng.normal(size=(*lead, FEATURES)).astype(np.float32)
    noise = 0.01 * rng.normal(size=(*lead, OUTPUTS)).astype(np.float32)
    return features, features @ true_w + true_b + noise

  return init_params, loss_fn, examples


# Block index -> the loop that trains in it.
TRAINS = {1: "stacked", 2: "eager", 4: "streaming", 5: "asynchronous"}
PER_ISLAND = 3
# Both forms run the same float32 arithmetic (sync_island under vmap and
# under shard_map), fused differently by XLA: a few ulps apart. int8 can
# turn one ulp before quantization into a whole step where a value sits
# on a rounding boundary (the page says so); none does in this round.
CLOSE = dict(rtol=1e-6, atol=1e-7)


def _assert_close(actual, expected):
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **CLOSE),
               actual, expected)


@pytest.mark.slow
def test_the_pages_loops_run_and_train():
  blocks = _blocks()
  assert len(blocks) == 6, "a block was added or removed: name it here"
  init_params, loss_fn, examples = _reader_code(np.random.default_rng(0))
  held_out = examples(256)
  evaluations = []
  namespace = {"init_params": init_params, "loss_fn": loss_fn,
               "evaluate": lambda params: evaluations.append(
                   float(loss_fn(params, held_out)))}
  namespace["next_batch"] = lambda: examples(namespace["k"], ISLAND_BATCH)
  start = float(loss_fn(init_params(), held_out))

  for index, block in enumerate(blocks):
    if index == PER_ISLAND:
      # Islands that moved apart from x, so the round has a mean to take.
      x = namespace["x"]
      namespace["islands"] = islands = jax.tree.map(
          lambda a: a + 0.01 * jax.random.normal(jax.random.key(1), a.shape),
          namespace["islands"])
    exec(compile(block, f"{PAGE}:block{index}", "exec"), namespace)  # pylint: disable=exec-used
    if index == PER_ISLAND:
      # The block's object, stacked, on the same round.
      outer, k = namespace["outer"], namespace["k"]
      expected = outer.update(x, islands, outer.init(x, k))
      _assert_close(namespace["x"], expected.params)
      _assert_close(namespace["islands"], expected.islands)
      _assert_close(namespace["state"].residuals, expected.state.residuals)
      np.testing.assert_array_equal(namespace["state"].included, [True] * k)
      assert not np.allclose(namespace["x"]["w"], x["w"])  # it moved
      # int8 left something unsent, kept per island.
      assert float(jnp.abs(namespace["state"].residuals["w"]).max()) > 0
    if index in TRAINS:
      end = float(loss_fn(namespace["x"], held_out))
      # 1,000 AdamW steps at lr 3e-4 per island (the asynchronous loop:
      # 80 calls of 50 steps), each overlap at its defaults: the loss
      # falls below a tenth of the zero model's (measured: 0.018 of it
      # stacked, 0.018 eager, 0.015 streaming, 0.016 asynchronous).
      assert end < 0.1 * start, (TRAINS[index], start, end)
    if TRAINS.get(index) == "eager":
      # Evaluated every 5 rounds on the islands' average point, the model
      # under eager updates: it falls at every evaluation (measured: 0.47,
      # 0.16, 0.055, 0.020 of the start).
      assert len(evaluations) == namespace["rounds"] // 5, evaluations
      assert all(b < a for a, b in zip([start] + evaluations, evaluations)
                 ), (start, evaluations)
      assert evaluations[-1] < 0.1 * start, (start, evaluations)
