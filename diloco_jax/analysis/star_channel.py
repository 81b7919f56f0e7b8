"""The elastic channel in the network model: a round's exchange through a
central coordinator (a star) against a ring all-reduce among the islands.

`python -m diloco_jax.elastic` runs each island as its own process. Each
round a coordinator, not an island, receives every island's payload (up:
U bytes, its params in float32 today, the codec's bytes once islands
encode), runs the outer step, and sends x to every island (down: D bytes).
Its link carries k payloads in and k out; each island's link carries one
each way. A ring all-reduce of the same payloads has each island send
(k-1)/k of each: its reduce-scatter moves up-encoded chunks, its
all-gather the down-encoded result (U = D = B/2 of bytes_per_sync, up to
chunk rounding).

Links are full duplex, as network_model.allreduce_time prices them (an
island of a ring sends its bytes while receiving as many). The star's two
directions still do not overlap: the broadcast carries the outer step's
result, which needs every payload whole, so a round gathers, then
broadcasts. Each phase is set by its slower link and pays one latency:

  gather    = L + 8 max(k U / W_c, U / W)
  broadcast = L + 8 max(k D / W_c, D / W)
  star      = 2 L + 8 (U + D) max(k / W_c, 1 / W)

(both phases switch bottleneck at W_c = k W, so the sum is one max). A
ring pays 2 (k - 1) L + 8 (k - 1) (U + D) / (k W). docs/network_model.md
gives the crossover and when the coordinator's link matters.
"""

import dataclasses
import math

from diloco_jax.analysis import network_model as nm
from diloco_jax.analysis.network_model import is_int, require


@dataclasses.dataclass(frozen=True)
class Star:
  """What crosses a coordinator's link in one round, per island.

  Attributes:
    up_bytes: U, one island's payload to the coordinator.
    down_bytes: D, what the coordinator sends each island (x).
    coordinator_bits_per_s: W_c, the coordinator's link; None: an
      island's (the Link it is priced over).
  """
  up_bytes: float
  down_bytes: float
  coordinator_bits_per_s: float | None = None

  def __post_init__(self):
    require(self.up_bytes >= 0, "up_bytes", self.up_bytes, "must be >= 0")
    require(self.down_bytes >= 0, "down_bytes", self.down_bytes,
            "must be >= 0")
    require(self.coordinator_bits_per_s is None
            or self.coordinator_bits_per_s > 0, "coordinator_bits_per_s",
            self.coordinator_bits_per_s, "must be > 0 (or None: an island's)")


def coordinator_bandwidth(star: Star, link: nm.Link) -> float:
  """W_c in bits/s: the star's own, else the islands' link's."""
  if star.coordinator_bits_per_s is None:
    return link.bandwidth_bits_per_s
  return star.coordinator_bits_per_s


def _require_islands(islands) -> None:
  require(is_int(islands) and islands >= 1, "islands", islands,
          "must be an integer >= 1")


def star_time(star: Star, islands: int, link: nm.Link) -> float:
  """Seconds of one round's gather and broadcast through the coordinator.

  Not 0 for one island: the coordinator is a process of its own.
  """
  _require_islands(islands)
  per_bit = max(islands / coordinator_bandwidth(star, link),
                1 / link.bandwidth_bits_per_s)
  return 2 * link.latency_s + 8.0 * (star.up_bytes + star.down_bytes) * per_bit


def ring_bytes(star: Star, islands: int) -> float:
  """Bytes one island sends in a ring all-reduce of the same payloads."""
  _require_islands(islands)
  return (islands - 1) / islands * (star.up_bytes + star.down_bytes)


def ring_time(star: Star, islands: int, link: nm.Link) -> float:
  """Seconds of that ring all-reduce (network_model.allreduce_time)."""
  return nm.allreduce_time(ring_bytes(star, islands), islands, link)


def crossover_bits_per_s(star: Star, islands: int, link: nm.Link) -> float:
  """The least coordinator bandwidth W_c at which the star is no slower
  than the ring; math.inf where none is.

  Past W_c = k W the islands' own links set the star's pace, at
  2 L + 8 (U + D) / W: each island sends its whole payload where a ring
  sends (k-1)/k of it, so without latency no W_c suffices. The ring's
  2 (k - 1) L can pay for that; then W_c = 8 k (U + D) / (ring - 2 L).
  """
  ring = ring_time(star, islands, link)
  total = star.up_bytes + star.down_bytes
  if ring < 2 * link.latency_s + 8.0 * total / link.bandwidth_bits_per_s:
    return math.inf
  if total == 0:
    return 0.0
  return 8.0 * islands * total / (ring - 2 * link.latency_s)


def star_timing(star: Star, workload: nm.Workload,
                link: nm.Link) -> nm.RoundTiming:
  """A blocking DiLoCo round of `workload` whose exchange is the star's:
  H steps, then the gather and broadcast, then the outer step (its apply
  time). The workload's sync_bytes (a ring's) are not used; `star` gives
  the bytes, `link` each island's link."""
  require(workload.mode == "diloco", "mode", workload.mode,
          "must be 'diloco': elastic islands run DiLoCo rounds")
  for name, default in (("overlap", "none"), ("fragments", 1),
                        ("stage_links", 1)):
    require(getattr(workload, name) == default, name,
            getattr(workload, name), f"must be {default!r}: elastic rounds "
            "sync the whole model at once")
  compute = workload.inner_steps * workload.step_time_s
  exchange = star_time(star, workload.islands, link)
  round_s = compute + exchange + workload.apply_time_s
  return nm.RoundTiming(compute, exchange, workload.apply_time_s, round_s,
                        compute / round_s, exchange, exchange, False)


def ring_timing(star: Star, workload: nm.Workload,
                link: nm.Link) -> nm.RoundTiming:
  """The same round with a ring all-reduce of the star's payloads
  (network_model.timing)."""
  return nm.timing(dataclasses.replace(
      workload, sync_bytes=ring_bytes(star, workload.islands)), link)


def compute_for_utilization(target: float, exchange_s: float,
                            apply_time_s: float = 0.0) -> float:
  """Compute per round (H steps) at which a blocking round whose exchange
  takes `exchange_s` reaches `target` utilization:
  H s = U / (1 - U) (exchange + apply)."""
  require(0 < target < 1, "target", target, "is not a utilization in (0, 1)")
  require(exchange_s >= 0, "exchange_s", exchange_s, "must be >= 0")
  require(apply_time_s >= 0, "apply_time_s", apply_time_s, "must be >= 0")
  return target / (1 - target) * (exchange_s + apply_time_s)
