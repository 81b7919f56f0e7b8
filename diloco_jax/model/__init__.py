"""The language model: a decoder-only transformer in Flax NNX
(transformer.py), its params as a pytree and its next-token loss; the
token look-up whose gradient does not depend on repeats (embedding.py).

May import no other layer; the algorithm sees the model only as a loss
function over a params pytree.
"""
