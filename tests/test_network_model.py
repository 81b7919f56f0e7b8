"""The analytic network model: its identities, its bytes, its refusals."""

import collections
import dataclasses
import json
import math
import random

import jax
import jax.numpy as jnp
import pytest

from diloco_jax.config import run_config

from diloco_jax.algorithm import compression
from diloco_jax.analysis import link_bytes
from diloco_jax.analysis import link_queue
from diloco_jax.analysis import network_model as nm
from diloco_jax.analysis import workloads
from diloco_jax.codecs import dense as codecs
from diloco_jax.config import schema as config_schema
from diloco_jax.model import transformer as model_lib
from diloco_jax.parallel import communication

N = 1_000_000_000  # params; a multiple of every island count used here
GBIT = 1e9


def _tree():
  """A small params tree; every leaf's size is a multiple of 2 and 4."""
  shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  return {"embed": shape(64, 32), "blocks": [shape(32, 96), shape(96, 32)],
          "norm": shape(32,), "bias": shape(8,)}


def _tree_size(tree) -> int:
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def test_diloco_with_one_inner_step_sends_what_ddp_sends():
  for k in (2, 4, 8):
    ddp = workloads.ddp_workload(N, k, 0.5)
    diloco = workloads.diloco_workload(N, k, 0.5, inner_steps=1)
    # The ring: 2(k-1) chunks of N/k float32 values, plus the islands'
    # weights (one float32 all-reduced the same way).
    ring = 2 * (k - 1) * (N // k) * 4 + 2 * (k - 1) * 4
    assert nm.bytes_per_step(ddp) == nm.bytes_per_step(diloco) == ring
    link = nm.Link(10 * GBIT, 0.03)
    assert nm.timing(ddp, link) == nm.timing(diloco, link)
  # Over H steps DiLoCo sends 1/H of DDP's bytes per step.
  assert nm.bytes_per_step(workloads.diloco_workload(N, 4, 0.5, 100)) == (
      nm.bytes_per_step(workloads.ddp_workload(N, 4, 0.5)) / 100)


@pytest.mark.parametrize("workload", [
    workloads.ddp_workload(N, 4, 0.2),
    workloads.diloco_workload(N, 4, 0.2, 50, codec="int8"),
    workloads.diloco_workload(N, 4, 0.2, 50, fragments=5, fragment_delay=3),
], ids=["ddp", "diloco", "streaming"])
def test_utilization_tends_to_one_as_bandwidth_grows(workload):
  bandwidths = [10.0 ** e for e in range(6, 20)]
  values = [nm.utilization(workload, nm.Link(b)) for b in bandwidths]
  assert values == sorted(values)
  assert values[0] < 0.5 and values[-1] > 1 - 1e-6
  # With latency the limit is the compute share left by 2(k-1) messages
  # per collective.
  latency, k = 0.01, workload.islands
  collectives = workload.fragments if workload.mode == "diloco" else (
      workload.inner_steps)
  compute = workload.inner_steps * workload.step_time_s
  stall = collectives * max(0.0, 2 * (k - 1) * latency
                            - workload.delay_steps * workload.step_time_s)
  assert nm.utilization(workload, nm.Link(1e30, latency)) == pytest.approx(
      compute / (compute + stall), rel=1e-9)


def test_utilization_tends_to_one_as_inner_steps_grow():
  link = nm.Link(1 * GBIT, 0.05)
  values = [nm.utilization(workloads.diloco_workload(N, 8, 0.3, h), link)
            for h in (1, 10, 100, 1000, 10_000, 1_000_000)]
  assert values == sorted(values)
  assert values[0] < 0.01 and values[-1] > 0.999


def test_one_step_delay_hides_the_sync_exactly_until_it_outlasts_a_round():
  h, step, k = 100, 0.2, 4
  workload = workloads.diloco_workload(N, k, step, h, overlap="one_step_delay")
  crossed = set()
  for bandwidth in [10.0 ** (e / 4) for e in range(32, 48)]:
    link = nm.Link(bandwidth, 0.02)
    comm = nm.allreduce_time(workload.sync_bytes, k, link)
    value = nm.utilization(workload, link)
    if comm <= h * step:
      assert value == 1.0
    else:
      assert value == pytest.approx(h * step / comm, rel=1e-12)
    assert nm.round_time(workload, link) == pytest.approx(
        max(h * step, comm), rel=1e-12)
    crossed.add(comm <= h * step)
  assert crossed == {True, False}
  # It is streaming's single fragment with tau = H.
  same = workloads.diloco_workload(N, k, step, h, fragment_delay=h)
  link = nm.Link(0.3 * GBIT)
  assert nm.timing(same, link) == nm.timing(workload, link)


def test_streaming_with_one_fragment_and_no_delay_is_diloco():
  for codec in ("fp32", "int4"):
    diloco = workloads.diloco_workload(N, 4, 0.1, 100, codec=codec)
    streaming = workloads.diloco_workload(N, 4, 0.1, 100, codec=codec, fragments=1,
                                          fragment_delay=0)
    for link in (nm.Link(0.1 * GBIT), nm.Link(25 * GBIT, 0.08)):
      assert nm.timing(streaming, link) == nm.timing(diloco, link)
  # With more blocking fragments the same bytes cross, so without latency a
  # round costs the same; each fragment pays its own 2(k-1) latencies.
  diloco = workloads.diloco_workload(N, 4, 0.1, 100)
  streaming = workloads.diloco_workload(N, 4, 0.1, 100, fragments=10)
  assert nm.round_time(streaming, nm.Link(GBIT)) == pytest.approx(
      nm.round_time(diloco, nm.Link(GBIT)), rel=1e-12)
  assert nm.round_time(streaming, nm.Link(GBIT, 0.01)) == pytest.approx(
      nm.round_time(diloco, nm.Link(GBIT, 0.01)) + 9 * 6 * 0.01, rel=1e-12)


@pytest.mark.parametrize("fragments", [2, 4, 7, 10, 100])
def test_streaming_peak_bytes_are_a_fragment_of_diloco_s(fragments):
  diloco = workloads.diloco_workload(N, 4, 0.1, 100, codec="bf16")
  streaming = workloads.diloco_workload(N, 4, 0.1, 100, codec="bf16",
                                        fragments=fragments, fragment_delay=1)
  assert nm.peak_bytes(streaming) == pytest.approx(
      nm.peak_bytes(diloco) / fragments, rel=1e-12)
  assert nm.bytes_per_step(streaming) == nm.bytes_per_step(diloco)
  # The link carries the same bytes per round, in P collectives.
  link = nm.Link(GBIT)
  assert nm.timing(streaming, link).link_busy_s == pytest.approx(
      nm.timing(diloco, link).link_busy_s, rel=1e-12)


def test_overlapping_a_fragment_hides_tau_steps_of_its_sync():
  h, p, tau, step = 100, 10, 2, 0.1
  workload = workloads.diloco_workload(N, 2, step, h, fragments=p,
                                       fragment_delay=tau)
  for bandwidth in (1 * GBIT, 10 * GBIT, 100 * GBIT):
    link = nm.Link(bandwidth, 0.001)
    c = nm.allreduce_time(workload.sync_bytes / p, 2, link)
    assert nm.round_time(workload, link) == pytest.approx(
        h * step + p * max(0.0, c - tau * step), rel=1e-12)


def _simulated_round_s(h, p, tau, step, c, apply, rounds=2000):
  """The reference: fragments' sends, the FIFO link and the island's waits
  played event by event for many rounds; the mean of the last quarter."""
  sends = [((j + 1) * h) // p for j in range(p)]
  clock, at_step, link_free = 0.0, 0, 0.0
  due = collections.deque()
  round_ends = []
  for r in range(rounds):
    for offset in sends + [None]:
      last = r * h + (offset if offset is not None else h)
      while due and due[0][0] <= last:
        due_step, arrives = due.popleft()
        clock = max(clock + (due_step - at_step) * step, arrives) + apply
        at_step = due_step
      if offset is None:
        break
      clock += (last - at_step) * step
      at_step = last
      link_free = max(clock, link_free) + c
      due.append((last + tau, link_free))
    round_ends.append(clock)
  measured = rounds // 4
  return (round_ends[-1] - round_ends[-1 - measured]) / measured


def test_link_queue_steady_state_is_exact():
  # The model solves the queued steady state in closed form where
  # fragments' collectives never meet on the link (tau within a fragment's
  # window, or a sync shorter than the window) and in max-plus algebra
  # otherwise; both must match a long event-by-event simulation.
  rng = random.Random(0)
  checked = collections.Counter()
  for _ in range(60):
    h = rng.choice([1, 4, 10, 12, 30])
    p, tau = rng.randint(1, h), rng.randint(0, h)
    step, apply = rng.uniform(0.01, 2.0), rng.choice([0.0, 0.5])
    c = rng.uniform(0.0, 3 * h * step / p)
    exact = link_queue.queued_round_s(h, p, tau, step, c, apply / p)
    assert exact == pytest.approx(
        _simulated_round_s(h, p, tau, step, c, apply / p), rel=1e-6)
    fits = tau <= h // p or c <= (h // p) * step
    if fits:
      assert exact == pytest.approx(
          h * step + p * max(0.0, c - tau * step) + apply, rel=1e-9)
    assert exact >= max(h * step + apply, p * c) * (1 - 1e-9)
    checked[fits] += 1
  assert checked[True] > 10 and checked[False] > 10
  # Two fragments each due a round later, on a link twice too slow: the
  # link never rests and sets the pace.
  assert link_queue.queued_round_s(10, 2, 10, 1.0, 15.0, 0.0) == pytest.approx(30)


def test_contended_link_sets_the_pace_when_fragments_divide_h():
  # With P | H and no apply time, collectives that queue keep the link busy
  # for good: the round is the link's busy time, P c_f.
  rng = random.Random(1)
  contended = 0
  for _ in range(300):
    h = rng.choice([4, 10, 12, 30, 100])
    p = rng.choice([d for d in range(1, h + 1) if h % d == 0])
    tau, step = rng.randint(0, h), rng.uniform(0.01, 2.0)
    c = rng.uniform(0.0, 3 * h * step / p)
    if tau <= h // p or c <= (h // p) * step:
      continue
    contended += 1
    assert link_queue.queued_round_s(h, p, tau, step, c, 0.0) == pytest.approx(
        p * c, rel=1e-12)
  assert contended > 50


def test_contended_streaming_is_paced_by_the_link():
  # tau beyond a fragment's window and syncs longer than it: the collectives
  # queue; the round can be no shorter than the link's busy time.
  workload = workloads.diloco_workload(N, 2, 0.1, 100, fragments=10,
                                       fragment_delay=50)
  link = nm.Link(2.5 * GBIT)
  t = nm.timing(workload, link)
  assert t.contended
  assert t.collective_s > 10 * 0.1
  assert t.round_s == pytest.approx(max(10.0, t.link_busy_s), rel=1e-9)


@pytest.mark.parametrize("workload", [
    workloads.ddp_workload(N, 4, 0.2),
    workloads.ddp_workload(N, 4, 0.2, hidden_fraction=2 / 3),
    workloads.diloco_workload(N, 4, 0.2, 100, codec="int8"),
    workloads.diloco_workload(N, 4, 0.2, 100, overlap="one_step_delay"),
    workloads.diloco_workload(N, 4, 0.2, 100, fragments=4, fragment_delay=5),
    workloads.diloco_workload(N, 4, 0.2, 100, fragments=10, fragment_delay=50),
], ids=["ddp", "ddp_hidden", "diloco", "one_step_delay", "streaming",
        "contended"])
@pytest.mark.parametrize("target", [0.5, 0.9, 0.95, 0.99])
def test_bandwidth_for_utilization_inverts_utilization(workload, target):
  latency = 1e-4  # blocking DDP pays 6 of these a step: 0.99 stays in reach
  bandwidth = nm.bandwidth_for_utilization(target, workload, latency)
  at = lambda b: nm.utilization(workload, nm.Link(b, latency))
  assert at(bandwidth) >= target
  assert at(bandwidth * (1 - 1e-6)) < target
  assert at(bandwidth) == pytest.approx(target, rel=1e-6)


def test_bandwidth_for_utilization_closed_form_for_diloco():
  # Blocking DiLoCo: H s / (H s + 2(k-1) L + 8 B / W) = u, solved for W.
  h, step, k, latency, target = 100, 0.1, 4, 0.02, 0.95
  workload = workloads.diloco_workload(N, k, step, h)
  slack = h * step * (1 / target - 1) - 2 * (k - 1) * latency
  assert nm.bandwidth_for_utilization(target, workload, latency) == (
      pytest.approx(8 * workload.sync_bytes / slack, rel=1e-8))


def test_codec_ratios_scale_communication_time():
  link = nm.Link(GBIT)  # no latency: time is bytes / bandwidth
  fp32 = workloads.diloco_workload(N, 4, 0.1, 100)
  comm = lambda w: nm.allreduce_time(w.sync_bytes, 4, link)
  for name in codecs.DENSE_CODECS:
    w = workloads.diloco_workload(N, 4, 0.1, 100, codec=name)
    assert comm(fp32) / comm(w) == pytest.approx(
        fp32.sync_bytes / w.sync_bytes, rel=1e-12)
    # At this size the ratio is the codec's bytes per value (payload and
    # block scales) against float32's 4.
    n = 1 << 20
    per_value = codecs.make_codec(name).payload_bytes(n) / n
    assert comm(fp32) / comm(w) == pytest.approx(4 / per_value, rel=1e-6)
  for ratio in (3.0, 10.0, 250.0):
    w = workloads.diloco_workload(N, 4, 0.1, 100, codec="topk",
                                  compression_ratio=ratio)
    assert comm(w) == pytest.approx(comm(fp32) / ratio, rel=1e-12)
    # Blocking DiLoCo's stall is the comm time: it scales the same way.
    assert nm.timing(w, link).stall_s == pytest.approx(
        nm.timing(fp32, link).stall_s / ratio, rel=1e-12)


@pytest.mark.parametrize("name", codecs.DENSE_CODECS)
@pytest.mark.parametrize("islands", [1, 2, 4])
def test_bytes_per_sync_is_compression_mean_bytes(name, islands):
  tree = _tree()
  codec = compression.Compression(name, codecs.make_codec(name))
  expected = compression.mean_bytes(tree, islands, codec)
  assert workloads.bytes_per_sync(tree, islands, name) == expected
  # A bare count is the tree flattened: the same bytes when each leaf splits
  # evenly over the islands (fp32 rounds each leaf's chunk up).
  assert workloads.bytes_per_sync(_tree_size(tree), islands, name) == expected
  # FSDP stripes count as the runs count them.
  assert workloads.bytes_per_sync(tree, islands, name, stripes=2) == (
      compression.mean_bytes(tree, islands, codec, stripes=2))


def test_structured_codecs_are_exact_on_a_tree():
  tree = _tree()
  codec = compression.Compression("topk", codecs.make_codec("int8"),
                                  topk_fraction=0.05)
  assert workloads.bytes_per_sync(tree, 4, codec) == compression.mean_bytes(
      tree, 4, codec)


def test_bad_inputs_name_their_field():
  workload = workloads.diloco_workload(N, 4, 0.1, 100)
  cases = [
      ("bandwidth_bits_per_s", lambda: nm.Link(-1.0)),
      ("bandwidth_bits_per_s", lambda: nm.Link(0.0)),
      ("latency_s", lambda: nm.Link(GBIT, -0.1)),
      ("target", lambda: nm.bandwidth_for_utilization(1.0, workload)),
      ("target", lambda: nm.bandwidth_for_utilization(0.0, workload)),
      ("target", lambda: nm.bandwidth_for_utilization(1.5, workload)),
      # 2 x 3 messages of 1 s each already cost more than 5% of 10 s.
      ("target", lambda: nm.bandwidth_for_utilization(0.95, workload, 1.0)),
      ("fragments", lambda: workloads.diloco_workload(N, 4, 0.1, 10, fragments=11)),
      ("fragments", lambda: workloads.diloco_workload(N, 4, 0.1, 10, fragments=0)),
      ("fragment_delay",
       lambda: workloads.diloco_workload(N, 4, 0.1, 10, fragment_delay=11)),
      ("fragment_delay",
       lambda: workloads.diloco_workload(N, 4, 0.1, 10, fragment_delay=1,
                                         overlap="one_step_delay")),
      ("overlap", lambda: workloads.diloco_workload(N, 4, 0.1, 10, overlap="eager")),
      ("step_time_s", lambda: workloads.diloco_workload(N, 4, -0.1, 10)),
      ("inner_steps", lambda: workloads.diloco_workload(N, 4, 0.1, 0)),
      ("islands", lambda: workloads.diloco_workload(N, 0, 0.1, 10)),
      ("num_params", lambda: workloads.bytes_per_sync(-5, 4)),
      ("codec", lambda: workloads.bytes_per_sync(N, 4, "fp8")),
      ("compression_ratio", lambda: workloads.bytes_per_sync(N, 4, "topk")),
      ("compression_ratio", lambda: workloads.bytes_per_sync(N, 4, None)),
      ("compression_ratio",
       lambda: workloads.bytes_per_sync(N, 4, "int8", compression_ratio=4.0)),
      ("compression_ratio",
       lambda: workloads.bytes_per_sync(N, 4, "lowrank", compression_ratio=-2.0)),
      ("ddp_hidden_fraction",
       lambda: workloads.ddp_workload(N, 4, 0.1, hidden_fraction=1.0)),
      ("fragments", lambda: nm.Workload("ddp", 4, 0.1, 1e9, inner_steps=4,
                                        fragments=2)),
  ]
  for field, make in cases:
    with pytest.raises(ValueError, match=rf"^{field}="):
      make()


def test_ddp_all_reduce_can_hide_behind_the_backward_pass():
  step, k = 0.3, 4
  for hidden in (0.0, 0.5, 2 / 3):
    workload = workloads.ddp_workload(N, k, step, inner_steps=10,
                                      hidden_fraction=hidden)
    for bandwidth in (10 * GBIT, 100 * GBIT, 1000 * GBIT):
      link = nm.Link(bandwidth)
      c = nm.allreduce_time(workload.sync_bytes, k, link)
      assert nm.round_time(workload, link) == pytest.approx(
          10 * (step + max(0.0, c - hidden * step)), rel=1e-12)


def test_from_config_reads_a_run_s_config():
  config = config_schema.base_config()
  tree = _tree()
  config.diloco.codec = "int8"
  config.diloco.inner_steps = 20
  for field in ("overlap", "fragments", "fragment_delay"):
    if field in config.diloco:  # a config from before the fields
      del config.diloco[field]
  workload, link = workloads.from_config(config, 0.25, 2 * GBIT, 0.01, params=tree)
  assert link == nm.Link(2 * GBIT, 0.01)
  assert workload == nm.Workload(
      "diloco", 4, 0.25,
      compression.mean_bytes(tree, 4,
                             run_config.compression(config.diloco)),
      inner_steps=20, overlap=config.diloco.get("overlap", "none"))
  # The streaming fields, once the schema has them. The collectives
  # overlap the inner steps only on devices of their own.
  config.diloco.overlap = "none"
  config.diloco.fragments = 4
  config.diloco.fragment_delay = 2
  for placement, delay in (("device", 0), ("host", 2)):
    config.diloco.outer_placement = placement
    workload, _ = workloads.from_config(config, 0.25, 2 * GBIT, params=tree)
    assert (workload.fragments, workload.delay_steps) == (4, delay)
  config.diloco.fragments, config.diloco.fragment_delay = 1, 0
  # The delays and eager updates send and wait with one timing.
  for overlap in ("one_step_delay", "one_step_delay_rebase", "eager"):
    config.diloco.overlap = overlap
    for placement, delay in (("device", 0), ("host", 20)):
      config.diloco.outer_placement = placement
      assert workloads.from_config(config, 0.25, 2 * GBIT,
                                   params=tree)[0].delay_steps == delay
  # DDP counts float32 gradients, as link_bytes.LinkBytes does.
  config.mode, config.diloco.overlap = "ddp", "none"
  workload, _ = workloads.from_config(config, 0.25, 2 * GBIT, params=tree)
  assert workload.sync_bytes == compression.mean_bytes(
      tree, 4, compression.as_compression(None))
  config.mode = "single"
  assert nm.utilization(*workloads.from_config(config, 0.25, 2 * GBIT,
                                               params=tree)) == 1.0


def test_from_config_builds_the_model_s_shapes():
  from diloco_jax.model import transformer as model_lib
  config = config_schema.base_config()
  config.diloco.codec = "adaptive_lowrank"  # exact on the model's matrices
  workload, _ = workloads.from_config(config, 0.25, GBIT)
  assert workload.sync_bytes == compression.mean_bytes(
      model_lib.param_shapes(config.model), config.diloco.islands,
      run_config.compression(config.diloco))


def test_run_estimate_is_json_for_a_summary():
  config = config_schema.base_config()
  config.total_steps, config.pretrain_steps = 240, 40
  config.diloco.inner_steps = 10
  estimate = workloads.run_estimate(config, 0.25, 0.1 * GBIT, 0.05,
                                    params=_tree())
  json.dumps(estimate)
  workload, link = workloads.from_config(config, 0.25, 0.1 * GBIT, 0.05,
                                         params=_tree())
  assert estimate["network_utilization"] == nm.utilization(workload, link)
  assert estimate["network_wall_s"] == pytest.approx(
      40 * 0.25 + 20 * nm.round_time(workload, link))
  assert set(estimate["network_bandwidth_for_utilization"]) == {"0.9",
                                                                "0.95"}
  # A run's measured bytes per sync (e.g. adaptive ranks) replace the count.
  measured = workloads.run_estimate(config, 0.25, 0.1 * GBIT, 0.05,
                                    sync_bytes=123_456.0)
  assert measured["network_sync_bytes"] == 123_456.0


@pytest.mark.parametrize("bandwidth", [0.1 * GBIT, 10 * GBIT])
def test_the_syncs_after_the_last_step_are_waited_for_in_full(bandwidth):
  link = nm.Link(bandwidth, 0.0)
  step, h = 0.5, 10
  plain = workloads.diloco_workload(N, 4, step, h)
  delay = workloads.diloco_workload(N, 4, step, h, overlap="one_step_delay")
  streaming = workloads.diloco_workload(N, 4, step, h, fragments=2,
                                        fragment_delay=2)
  c = nm.allreduce_time(plain.sync_bytes, 4, link)
  assert nm.end_of_run_s(plain, link) == 0.0
  assert nm.end_of_run_s(workloads.ddp_workload(N, 4, step), link) == 0.0
  # A steady round waited max(0, c - H step) for the mean; the last one is
  # waited for whole.
  assert nm.end_of_run_s(delay, link) == pytest.approx(min(c, h * step))
  assert nm.end_of_run_s(streaming, link) == pytest.approx(
      2 * min(nm.allreduce_time(plain.sync_bytes / 2, 4, link), 2 * step))

  config = config_schema.base_config()
  config.total_steps, config.diloco.inner_steps = 200, h
  config.diloco.overlap = "one_step_delay"
  config.diloco.outer_placement = "host"
  estimate = workloads.run_estimate(config, step, bandwidth, params=_tree())
  workload, _ = workloads.from_config(config, step, bandwidth, params=_tree())
  assert estimate["network_wall_s"] == pytest.approx(
      20 * nm.round_time(workload, link) + nm.end_of_run_s(workload, link))


def test_eager_warmup_rounds_wait_as_rounds_without_overlap():
  """Eager updates' warm-up rounds (2 unless set) take a round without
  overlap; the rest a steady overlapped round; the end its last wait."""
  link = nm.Link(0.01 * GBIT, 0.0)
  config = config_schema.base_config()
  config.total_steps, config.diloco.inner_steps = 200, 10
  config.diloco.overlap = "eager"
  config.diloco.outer_placement = "host"
  workload, _ = workloads.from_config(config, 0.5, link.bandwidth_bits_per_s,
                                      params=_tree())
  waiting = nm.round_time(dataclasses.replace(workload, overlap="none"),
                          link)
  steady = nm.round_time(workload, link)
  assert waiting > steady
  for warmup, expected in ((None, 2), (0, 0), (5, 5)):
    config.diloco.overlap_warmup_rounds = warmup
    estimate = workloads.run_estimate(config, 0.5,
                                      link.bandwidth_bits_per_s,
                                      params=_tree())
    rounds_s = (expected * waiting + (20 - expected) * steady
                + nm.end_of_run_s(workload, link))
    assert estimate["network_wall_s"] == pytest.approx(rounds_s)
    assert estimate["network_run_utilization"] == pytest.approx(
        200 * 0.5 / rounds_s)
    assert estimate["network_utilization"] == nm.utilization(workload, link)


def test_pipelined_islands_send_each_stage_s_share():
  """S stages each reduce their share: over one shared link the bytes add
  up to the whole model's; with a link per stage each carries 1/S, as a
  codec S times stronger would."""
  workload = lambda **kw: workloads.diloco_workload(
      N, 8, 1.0, 100, codec="fp32", **kw)
  whole, shared = workload(), workload(stages=8)
  own = workload(stages=8, stage_links=8)
  # Each stage also psums the islands' weights.
  assert shared.sync_bytes == whole.sync_bytes + 7 * (
      communication.weight_share_bytes(8))
  link = nm.Link(GBIT, 0.0)
  assert nm.round_time(shared, link) == pytest.approx(
      nm.round_time(whole, link))
  stall = lambda w: nm.timing(w, link).stall_s
  assert stall(own) == pytest.approx(stall(whole) / 8, rel=1e-6)
  assert nm.peak_bytes(own) == pytest.approx(whole.sync_bytes / 8, rel=1e-6)
  # Stages synced on staggered schedules over the shared link: streaming.
  staggered = workload(stages=8, fragments=8)
  assert nm.peak_bytes(staggered) == nm.peak_bytes(own)
  with pytest.raises(ValueError, match="stage_links=8 must be 1 with"):
    workload(stages=8, fragments=8, stage_links=8)


def test_from_config_counts_a_pipelined_run_s_bytes():
  """What the run counts: each stage's collective through the codec."""
  config = config_schema.base_config()
  config.model.num_layers = 4
  config.mesh.stage = 2
  config.diloco.codec = "int8"
  shapes = model_lib.param_shapes(config.model)
  counted = link_bytes.LinkBytes(
      config, shapes, config.diloco.islands,
      run_config.compression(config.diloco),
      run_config.stage_layout(config)).sync(None)
  workload, _ = workloads.from_config(config, 0.25, GBIT, params=shapes)
  assert (workload.sync_bytes, workload.stage_links) == (counted, 1)
  config.network.link_per_stage = True
  assert workloads.from_config(config, 0.25, GBIT)[0].stage_links == 2
