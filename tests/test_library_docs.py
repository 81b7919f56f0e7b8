"""docs/library.md's code runs as the page shows it and trains.

The page leaves three names to the reader's own code: `init_params(...)`,
`loss_fn(params, batch)` and `next_batch()` ([k, ...] batches). Given them
for a small least-squares problem, every Python block of the page runs in
order, verbatim, in one namespace (as a reader pasting them into a
notebook would), and each loop that trains leaves an x whose loss fell.
"""
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "library.md"
ISLAND_BATCH, FEATURES, OUTPUTS = 16, 8, 4


def _blocks() -> list[str]:
  return re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def _reader_code(rng):
  """The reader's model, loss and data: y = X W* + b* with noise; every
  island draws its own examples."""
  true_w = rng.normal(size=(FEATURES, OUTPUTS)).astype(np.float32)
  true_b = rng.normal(size=(OUTPUTS,)).astype(np.float32)

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


def test_the_pages_loops_run_and_train():
  blocks = _blocks()
  assert len(blocks) == 5, "a block was added or removed: name it here"
  init_params, loss_fn, examples = _reader_code(np.random.default_rng(0))
  namespace = {"init_params": init_params, "loss_fn": loss_fn}
  namespace["next_batch"] = lambda: examples(namespace["k"], ISLAND_BATCH)
  held_out = examples(256)
  start = float(loss_fn(init_params(), held_out))

  trains = {1: "stacked", 3: "eager", 4: "streaming"}
  for index, block in enumerate(blocks):
    if index == 2:
      # The per-island block's outer step on islands that moved apart
      # from x must give the stacked form's x (both run sync_island;
      # rtol allows a few ulps of reassociation between two programs).
      diloco, x = namespace["diloco"], namespace["x"]
      namespace["islands"] = jax.tree.map(
          lambda a: a + 0.01 * jax.random.normal(jax.random.key(1), a.shape),
          namespace["islands"])
      expected, _, _ = diloco.outer_update(
          x, namespace["islands"],
          diloco.init(x, namespace["outer_tx"], namespace["k"],
                      compression=namespace["compression"]),
          namespace["outer_tx"], compression=namespace["compression"])
    exec(compile(block, f"{PAGE}:block{index}", "exec"), namespace)
    if index == 2:
      jax.tree.map(lambda a, b: np.testing.assert_allclose(
          a, b, rtol=1e-6, atol=1e-7), namespace["x"], expected)
      assert not np.allclose(namespace["x"]["w"], x["w"])  # it moved
    if index in trains:
      end = float(loss_fn(namespace["x"], held_out))
      # 1,000 AdamW steps at lr 3e-4 per island: the loss falls by more
      # than half from the zero model's (measured: to 0.08 of it stacked,
      # 0.07 eager, 0.43 streaming, whose merges keep half of each
      # island's own params).
      assert end < 0.5 * start, (trains[index], start, end)
