"""DiLoCo's outer step as pieces any JAX training loop can call.

Pure functions over pytrees, with no config and no run layer: a loop that
trains k copies of a model (its islands) for H inner steps calls
`outer_update` to average their pseudo-gradients (through a codec) and
step the global params with an optax outer optimizer, then starts every
island from the result. Each call works in two forms:

  stacked     island trees carry a leading axis of k islands (one process
              holds them all, as with jax.vmap); `axis_name=None`.
  per island  inside shard_map (or pmap), each call sees one island's
              trees; `axis_name` names the islands' axis.

The pieces, by module:

  library_diloco.py     outer optimizers, codecs by name, the islands'
                        compressed mean, the outer update and its one-step
                        delay.
  library_eager.py      eager updates: each island steps its own point at
                        once on the mean still in flight.
  library_streaming.py  Streaming DiLoCo: fragments on staggered schedules,
                        their sends and merges.
  library_specs.py      a stacked state inside shard_map: its specs, and
                        one island's state from a device's block and back.

The built-in runs use these same pieces (island_sync.sync_island is the
collective of both; config/run_config.py builds a run's codec with
`codec`), so a hand-written loop computes what `python -m diloco_jax.main`
computes. docs/library.md shows a loop.
"""

from diloco_jax.algorithm.library_diloco import (
    DiLoCoState, IslandMean, adam, bytes_sent, codec, fedavg, flush, init,
    island_copies, nesterov, outer_update, pseudo_gradient_mean,
    pseudo_gradients, sgd, sparseloco)
from diloco_jax.algorithm.library_eager import (
    EagerState, eager_init, eager_settle, eager_update)
from diloco_jax.algorithm.outer import DiLoCo, OuterState, Update, diloco
from diloco_jax.algorithm.outer_windows import Window, arrival_scale
from diloco_jax.algorithm.outer_overlaps import (
    eager, no_overlap, one_step_delay, streaming)
from diloco_jax.algorithm.library_specs import (
    island_block, island_specs, this_island)
from diloco_jax.algorithm.library_streaming import (
    StreamingState, fragment_assignment, fragment_merge, fragment_send,
    streaming_init, streaming_schedule)

__all__ = [
    "DiLoCo", "OuterState", "Update", "Window", "arrival_scale", "diloco",
    "eager", "no_overlap", "one_step_delay", "streaming",
    "DiLoCoState", "EagerState", "IslandMean", "StreamingState", "adam",
    "bytes_sent", "codec", "eager_init", "eager_settle", "eager_update",
    "fedavg", "flush", "fragment_assignment", "fragment_merge",
    "fragment_send", "init", "island_block", "island_copies",
    "island_specs", "nesterov", "outer_update",
    "pseudo_gradient_mean", "pseudo_gradients", "sgd", "sparseloco",
    "streaming_init", "streaming_schedule", "this_island",
]
