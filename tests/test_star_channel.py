"""The elastic channel in the network model: a coordinator's star against a
ring all-reduce, checked by its closed forms.

Tolerances: the functions and the expected values compute the same sums
and ratios in different orders, so they agree to a few ulps (rel 1e-12).
"""

import math

import pytest

from diloco_jax.analysis import network_model as nm
from diloco_jax.analysis import star_channel as sc
from diloco_jax.analysis import workloads

N = 1_000_000_000  # params; a multiple of every island count used here
GBIT = 1e9
FP32 = sc.Star(up_bytes=4 * N, down_bytes=4 * N)


def test_one_island_still_crosses_to_the_coordinator_and_back():
  link = nm.Link(GBIT, 0.02)
  star = sc.Star(3e8, 4e8, coordinator_bits_per_s=0.5 * GBIT)
  assert sc.ring_time(star, 1, link) == 0.0
  # The slower of the two links, once each way, one latency each.
  assert sc.star_time(star, 1, link) == pytest.approx(
      2 * 0.02 + 8 * 7e8 / (0.5 * GBIT), rel=1e-12)
  assert sc.crossover_bits_per_s(star, 1, link) == math.inf


@pytest.mark.parametrize("k", [2, 3, 4, 8, 16])
def test_a_coordinator_as_fast_as_an_island_costs_k_squared_over_k_minus_1(k):
  link = nm.Link(GBIT)
  # Star: k (U + D) over one link; ring: (k-1)/k (U + D) per island.
  assert sc.star_time(FP32, k, link) == pytest.approx(
      k * k / (k - 1) * sc.ring_time(FP32, k, link), rel=1e-12)
  if k == 2:
    assert sc.star_time(FP32, 2, link) == pytest.approx(
        4 * sc.ring_time(FP32, 2, link), rel=1e-12)


def test_the_star_grows_linearly_in_k_while_the_ring_stays_near_two_payloads():
  link, latency = nm.Link(GBIT, 0.01), 0.01
  payload_s = 8 * FP32.up_bytes / GBIT
  one = sc.star_time(FP32, 1, link) - 2 * latency
  for k in (2, 4, 8, 16, 64):
    assert sc.star_time(FP32, k, link) - 2 * latency == pytest.approx(
        k * one, rel=1e-12)
    ring_bandwidth_s = sc.ring_time(FP32, k, link) - 2 * (k - 1) * latency
    assert ring_bandwidth_s == pytest.approx(
        2 * (k - 1) / k * payload_s, rel=1e-12)
    assert payload_s <= ring_bandwidth_s < 2 * payload_s


def test_past_k_times_an_islands_bandwidth_the_islands_links_set_the_pace():
  link, k = nm.Link(GBIT, 0.03), 8
  island_bound = 2 * 0.03 + 8 * 8 * N / GBIT
  for factor in (8, 9, 100, 1e6):
    star = sc.Star(4 * N, 4 * N, coordinator_bits_per_s=factor * GBIT)
    assert sc.star_time(star, k, link) == pytest.approx(island_bound,
                                                        rel=1e-12)
  slower = sc.Star(4 * N, 4 * N, coordinator_bits_per_s=7.9 * GBIT)
  assert sc.star_time(slower, k, link) > island_bound


def test_ring_bytes_are_bytes_per_sync_without_the_weights():
  for k in (2, 4, 8):
    # bytes_per_sync also all-reduces the islands' weights: one float32
    # in 2(k-1) messages of the ring.
    assert sc.ring_bytes(FP32, k) + 2 * (k - 1) * 4 == (
        workloads.bytes_per_sync(N, k, "fp32"))


@pytest.mark.parametrize("k,up,down,latency", [
    (4, 4e6, 4e6, 0.01), (16, 1e6, 4e6, 0.05), (16, 6e8, 6e8, 0.2),
    (3, 1e3, 0.0, 0.001), (64, 1e8, 4e8, 0.1)])
def test_the_crossover_bandwidth_makes_star_and_ring_equal(k, up, down,
                                                           latency):
  link = nm.Link(GBIT, latency)
  w_c = sc.crossover_bits_per_s(sc.Star(up, down), k, link)
  assert 0 < w_c <= k * GBIT
  at = lambda bandwidth: sc.star_time(sc.Star(up, down, bandwidth), k, link)
  ring = sc.ring_time(sc.Star(up, down), k, link)
  assert at(w_c) == pytest.approx(ring, rel=1e-12)
  assert at(0.99 * w_c) > ring
  assert at(1.01 * w_c) <= ring


def test_without_latency_no_coordinator_matches_the_ring():
  link = nm.Link(GBIT)
  for k in (2, 4, 16):
    assert sc.crossover_bits_per_s(FP32, k, link) == math.inf
    fastest = sc.Star(4 * N, 4 * N, coordinator_bits_per_s=1e30)
    # Each island sends its whole payload: k / (k - 1) of the ring's.
    assert sc.star_time(fastest, k, link) == pytest.approx(
        k / (k - 1) * sc.ring_time(FP32, k, link), rel=1e-12)
  # Nothing to send: only latency, two messages against 2(k-1).
  assert sc.crossover_bits_per_s(sc.Star(0, 0), 4, nm.Link(GBIT, 0.1)) == 0


def test_a_round_through_the_star_is_h_steps_then_the_exchange():
  link = nm.Link(GBIT, 0.02)
  workload = workloads.diloco_workload(N, 8, 0.5, 100, apply_time_s=1.5)
  star, ring = sc.star_timing(FP32, workload, link), sc.ring_timing(
      FP32, workload, link)
  exchange = sc.star_time(FP32, 8, link)
  assert star.round_s == pytest.approx(50 + exchange + 1.5, rel=1e-12)
  assert star.utilization == pytest.approx(50 / star.round_s, rel=1e-12)
  assert ring.stall_s == pytest.approx(sc.ring_time(FP32, 8, link),
                                       rel=1e-12)
  assert star.utilization < ring.utilization
  # The compute a target utilization needs, round-tripped through timing.
  for target in (0.5, 0.9, 0.99):
    compute = sc.compute_for_utilization(target, exchange, 1.5)
    steps = dict(inner_steps=100, step_time_s=compute / 100)
    timed = sc.star_timing(FP32, nm.Workload(
        "diloco", 8, sync_bytes=0, apply_time_s=1.5, **steps), link)
    assert timed.utilization == pytest.approx(target, rel=1e-12)


@pytest.mark.parametrize("make,field", [
    (lambda: sc.Star(-1, 0), "up_bytes"),
    (lambda: sc.Star(0, -2.0), "down_bytes"),
    (lambda: sc.Star(1, 1, coordinator_bits_per_s=0), "coordinator_bits"),
    (lambda: sc.star_time(FP32, 0, nm.Link(GBIT)), "islands"),
    (lambda: sc.ring_time(FP32, 2.5, nm.Link(GBIT)), "islands"),
    (lambda: sc.star_timing(FP32, workloads.ddp_workload(N, 4, 0.1),
                            nm.Link(GBIT)), "mode"),
    (lambda: sc.star_timing(FP32, workloads.diloco_workload(
        N, 4, 0.1, 10, overlap="one_step_delay"), nm.Link(GBIT)), "overlap"),
    (lambda: sc.star_timing(FP32, workloads.diloco_workload(
        N, 4, 0.1, 10, fragments=2), nm.Link(GBIT)), "fragments"),
    (lambda: sc.compute_for_utilization(1.0, 3.0), "target"),
    (lambda: sc.compute_for_utilization(0.9, -1.0), "exchange_s"),
], ids=["up", "down", "coordinator", "no_islands", "fractional_islands",
        "ddp", "overlap", "fragments", "target", "exchange"])
def test_bad_input_is_one_line_naming_the_field(make, field):
  with pytest.raises(ValueError, match=rf"^{field}") as error:
    make()
  assert "\n" not in str(error.value)
