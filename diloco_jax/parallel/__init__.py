"""Where arrays live and how they cross devices; knows nothing of runs.

  mesh.py           the ('island', 'data', 'stage') mesh and island folding
                    (k logical islands on fewer device slots).
  placement.py      per-island functions on the mesh (island_map: shard_map
                    over 'island', vmap over the folded islands) and the
                    sharding rules inside an island (FSDP over 'data').
  communication.py  the one communication boundary: every cross-island
                    collective (dense, compressed, sparse phases) and the
                    bytes one island sends for it.
  stages.py         pipeline stages inside an island: the logical <->
                    staged layout of params-shaped trees, code run once
                    per stage (per_stage), the ppermute hand-off.
  pipeline.py       microbatches through the stages: the GPipe and
                    circular schedules and the pipelined loss.
  outer_devices.py  devices of their own for the outer step, and copying
                    arrays onto them without a collective.
  multihost.py      starting jax.distributed, and host values exchanged
                    between processes.
  peer_watch.py     processes watching each other: one line naming a
                    process that died; how a process ends.

May import codecs/ only.
"""
