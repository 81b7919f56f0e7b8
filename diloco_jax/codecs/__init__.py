"""Codecs of flat vectors: the bottom layer, pure jnp, shape-static.

  dense.py    fp32, bf16, fp16 (scaled), int8, int4 and fp4 blockwise codecs
              of a float32 vector: encode to a payload and decode back.
  sparse.py   values and positions of the largest magnitudes (top-k).
  lowrank.py  power-iteration helpers and the rank ladder of the low-rank
              codecs.

May import no other layer. What crosses the island link, and how it
is reduced, is built from these in parallel/communication.py (dense) and
algorithm/compression.py (pytrees).
"""
