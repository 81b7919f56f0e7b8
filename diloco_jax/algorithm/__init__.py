"""The DiLoCo family as pure functions over pytrees, and the jitted steps
built from them. No I/O, no config, no mesh construction: builders take
optax optimizers, a mesh and typed settings.

  library.py        the public API: DiLoCo's outer step for any JAX
                    loop (docs/library.md), built from the pieces below:
                    library_diloco.py (outer optimizers, codecs by name,
                    the compressed mean, the outer update, the delay),
                    library_eager.py, library_streaming.py.
  state.py          TrainState: x, the islands, their optimizer states and
                    what the codec and overlap carry (the checkpoint format).
  inner_step.py     every island's optimizer step at once (ddp: with the
                    gradients averaged).
  island_sync.py    each island's pseudo-gradient through the codec into
                    the cross-island mean (the outer step's collective).
  outer_step.py     the outer step: pseudo-gradients through the codec
                    into the cross-island mean, the outer optimizer, the
                    islands reset; and its pieces for other placements.
  overlap.py        the overlap rules: one-step delay, its rebasing, eager
                    updates.
  fragments.py      Streaming DiLoCo's per-fragment send and merge.
  compression.py    codecs over pytrees and their bytes;
                    matrix_codecs.py the per-matrix ones (sign pruning,
                    top-k, low rank).
  optimizers.py     the inner (AdamW, Muon) and outer (Nesterov, ...)
                    optimizers, from their typed settings.
  participation.py  which islands take part in each round.
  guards.py         what counts as diverged (NaN/inf), said in one line.
  schedule.py       what runs after each inner step (outer step, flush,
                    fragment sends and merges, eval, checkpoint).
  evaluation.py     the eval loss of the params a run is judged by.

May import codecs/ and parallel/.
"""
