"""Elastic islands: each island its own JAX program under Ray, synced
through a coordinator that is not an island, so a dead or late island
leaves the others training (python -m diloco_jax.elastic; docs/elastic.md).

  settings.py     config.elastic checked; what elastic runs refuse.
  island.py       one island's program: a round of inner steps from x.
  coordinator.py  x, the outer state, data positions; the outer step;
                  checkpoints.
  quorum.py       when a round closes, and who made it.
  round_steps.py  which inner steps each round covers (under Streaming
                  DiLoCo a round ends at each fragment's send).
  driver.py       the run: Ray, the islands, the rounds.
  ray_watch.py    the run's Ray processes ended with the coordinator.

Needs Ray: pip install -e .[elastic]. The top layer: may import every
layer below it (run/, analysis/, config/, algorithm/, parallel/ and
codecs/, model/, data/).
"""
