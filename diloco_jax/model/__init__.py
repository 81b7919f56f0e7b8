"""The language model: a decoder-only transformer in Flax NNX
(transformer.py), its params as a pytree and its next-token loss.

Imports nothing of diloco_jax (may import no other layer); the algorithm sees it only as a loss
function over a params pytree.
"""
