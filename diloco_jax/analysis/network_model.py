"""An analytic model of the slow link: time per round and compute utilization.

What a run would cost on a network we do not have: k islands joined by links
of a given bandwidth (bits/s, per island) and latency (s, per message), each
inner step taking `step_time_s` of compute. It covers

  ddp              a ring all-reduce of the gradients every step, blocking
                   (or hidden behind a fraction of the step: the backward
                   pass; `ddp_hidden_fraction`, default 0 = no overlap);
  diloco           H inner steps, then a blocking ring all-reduce of the
                   (compressed) pseudo-gradient;
  one_step_delay   (DiLoCoX) round r's all-reduce runs during round r + 1's
                   compute and is applied a round late (its rebasing
                   variant has the same timing);
  streaming        P fragments of ~1/P of the params each, fragment p synced
                   once per H steps at offset p H / P, its result needed
                   `fragment_delay` (tau) steps after it is sent.

An island may be a pipeline of S stages (DiLoCoX): each stage reduces its
own share of the params in a collective of its own. Over one link shared
by the island's stages their bytes add up (the model's sync_bytes is the
sum); where each stage's devices have a link of their own (`stage_links`
= S), the collectives run side by side, each with a stage's share.
Stages synced on staggered schedules over a shared link are streaming
with P = S fragments.

Bytes are the project's own counts (compression.mean_bytes: a ring
all-reduce sends 2(k-1)/k of the payload per island, the dense codecs run the
same two phases with encoded chunks). A collective over k peers costs
2(k-1) messages, so

  comm = 2 (k - 1) latency + 8 bytes / bandwidth.

Utilization is the share of wall-clock time spent in inner steps. A round is
H inner steps in every mode (DDP's too, as the runs evaluate it), so round
times compare directly. docs/network_model.md gives the equations, the
assumptions and what the model leaves out.
"""

import dataclasses
import math

import numpy as np

from diloco_jax.analysis import link_queue

MODES = ("ddp", "diloco", "single")
OVERLAPS = ("none", "one_step_delay")


@dataclasses.dataclass(frozen=True)
class Link:
  """One island's link to the others.

  Attributes:
    bandwidth_bits_per_s: what one island can send, in bits per second.
    latency_s: one-way latency of one message, in seconds.
  """
  bandwidth_bits_per_s: float
  latency_s: float = 0.0

  def __post_init__(self):
    require(self.bandwidth_bits_per_s > 0, "bandwidth_bits_per_s",
            self.bandwidth_bits_per_s, "must be > 0")
    require(self.latency_s >= 0, "latency_s", self.latency_s,
            "must be >= 0")


@dataclasses.dataclass(frozen=True)
class Workload:
  """What the islands compute and send (built by ddp_workload,
  diloco_workload or from_config).

  Attributes:
    mode: one of MODES.
    islands: k, the islands (DDP workers) that all-reduce.
    step_time_s: compute time of one inner step (forward, backward, update).
    sync_bytes: bytes one island sends per sync of the whole model: per
      step for ddp, per round for diloco (bytes_per_sync).
    inner_steps: H; for ddp, the steps counted as one round.
    overlap: one of OVERLAPS (diloco only).
    fragments: P, streaming fragments (diloco only; 1 = plain DiLoCo).
    fragment_delay: tau, the inner steps a fragment's result may arrive
      after it is sent (diloco only; one_step_delay is tau = H).
    ddp_hidden_fraction: the fraction of a step DDP's all-reduce can run
      behind (the backward pass is about 2/3 of a step); 0: no overlap.
    apply_time_s: local compute of applying one round's outer update
      (split evenly over the fragments); counted as time not in inner steps.
    stage_links: links an island's per-stage collectives run over side by
      side: 1 when its pipeline stages share one link; S when each of its
      S stages has a link of its own (each collective then carries
      sync_bytes / S).
  """
  mode: str
  islands: int
  step_time_s: float
  sync_bytes: float
  inner_steps: int = 1
  overlap: str = "none"
  fragments: int = 1
  fragment_delay: int = 0
  ddp_hidden_fraction: float = 0.0
  apply_time_s: float = 0.0
  stage_links: int = 1

  def __post_init__(self):
    require(self.mode in MODES, "mode", self.mode, f"is not one of {MODES}")
    require(is_int(self.islands) and self.islands >= 1, "islands",
            self.islands, "must be an integer >= 1")
    require(self.step_time_s > 0, "step_time_s", self.step_time_s,
            "must be > 0")
    require(self.sync_bytes >= 0, "sync_bytes", self.sync_bytes,
            "must be >= 0")
    require(is_int(self.inner_steps) and self.inner_steps >= 1,
            "inner_steps", self.inner_steps, "must be an integer >= 1")
    require(self.overlap in OVERLAPS, "overlap", self.overlap,
            f"is not one of {OVERLAPS}")
    require(is_int(self.fragments)
            and 1 <= self.fragments <= self.inner_steps, "fragments",
            self.fragments,
            f"must be an integer in [1, inner_steps={self.inner_steps}]")
    require(is_int(self.fragment_delay)
            and 0 <= self.fragment_delay <= self.inner_steps,
            "fragment_delay", self.fragment_delay,
            f"must be an integer in [0, inner_steps={self.inner_steps}]")
    require(0 <= self.ddp_hidden_fraction < 1, "ddp_hidden_fraction",
            self.ddp_hidden_fraction, "must be in [0, 1)")
    require(self.apply_time_s >= 0, "apply_time_s", self.apply_time_s,
            "must be >= 0")
    require(is_int(self.stage_links) and self.stage_links >= 1,
            "stage_links", self.stage_links, "must be an integer >= 1")
    # Staggered fragments spread the bytes over one link's time; stages
    # with links of their own have nothing to spread.
    require(self.fragments == 1 or self.stage_links == 1, "stage_links",
            self.stage_links, "must be 1 with fragments > 1 (stages synced "
            "on staggered schedules share one link: fragments = stages)")
    if self.mode != "diloco":
      for name, default in (("overlap", "none"), ("fragments", 1),
                            ("fragment_delay", 0)):
        require(getattr(self, name) == default, name, getattr(self, name),
                f"is DiLoCo's; mode={self.mode!r} has no outer steps")
    if self.mode != "ddp":
      require(self.ddp_hidden_fraction == 0, "ddp_hidden_fraction",
              self.ddp_hidden_fraction,
              f"is DDP's; mode={self.mode!r} does not all-reduce per step")
    # One-step delay already defers each result by a whole round.
    require(self.overlap == "none" or self.fragment_delay == 0,
            "fragment_delay", self.fragment_delay,
            "must be 0 with overlap='one_step_delay' (that is tau = H)")

  @property
  def collective_bytes(self) -> float:
    """Bytes one collective carries on one link: a fragment's, and of
    it a stage's where the stages have links of their own."""
    return self.sync_bytes / (self.fragments * self.stage_links)

  @property
  def delay_steps(self) -> int:
    """Inner steps a sync's result may arrive after it is sent (tau)."""
    if self.overlap == "one_step_delay":
      return self.inner_steps
    return self.fragment_delay


@dataclasses.dataclass(frozen=True)
class RoundTiming:
  """One steady-state round (H inner steps) of a workload over a link.

  Attributes:
    compute_s: H x step time.
    stall_s: time islands wait for the link in a round.
    apply_s: time applying outer updates in a round.
    round_s: compute_s + stall_s + apply_s.
    utilization: compute_s / round_s.
    collective_s: time one collective holds the link (a fragment's, for
      streaming; a step's, for ddp).
    link_busy_s: time the link is busy in a round.
    contended: whether collectives queued behind each other on the link
      (streaming with tau beyond a fragment's window on a slow link).
  """
  compute_s: float
  stall_s: float
  apply_s: float
  round_s: float
  utilization: float
  collective_s: float
  link_busy_s: float
  contended: bool


def is_int(x) -> bool:
  """Whether `x` is an integer (a Python or numpy int, not a bool)."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def require(ok: bool, field: str, value, problem: str) -> None:
  """Raises one ValueError naming the field, its value and the problem."""
  if not ok:
    raise ValueError(f"{field}={value!r} {problem}")


def allreduce_time(num_bytes: float, islands: int, link: Link) -> float:
  """Seconds one ring all-reduce holds an island's link.

  2(k-1) messages in sequence, each paying the latency; `num_bytes` (what
  one island sends, e.g. bytes_per_sync) at the link's bandwidth.
  """
  if islands <= 1:
    return 0.0
  return (2 * (islands - 1) * link.latency_s
          + 8.0 * num_bytes / link.bandwidth_bits_per_s)


def bytes_per_step(workload: Workload) -> float:
  """Bytes one island sends per inner step, averaged over a round."""
  if workload.mode == "ddp":
    return workload.sync_bytes
  if workload.mode == "single":
    return 0.0
  return workload.sync_bytes / workload.inner_steps


def peak_bytes(workload: Workload) -> float:
  """Bytes of the largest single collective: what must cross in one burst.

  Streaming sends a round's bytes in P collectives of 1/P each, so its peak
  (and the bandwidth it takes to move one burst in a given window) is 1/P of
  DiLoCo's; stages with links of their own carry 1/S each.
  """
  if workload.mode == "single":
    return 0.0
  return workload.collective_bytes


def timing(workload: Workload, link: Link) -> RoundTiming:
  """The steady-state round of `workload` over `link`.

  ddp: each step's all-reduce c runs behind the last f x step of the step's
  compute, so a step takes step + max(0, c - f step).
  diloco: each fragment's collective c_f (P = 1: the whole model) is sent
  after the step that completes its H steps and is needed tau steps later
  (tau = H under one_step_delay); the island waits max(0, c_f - tau step)
  for it. When the collectives fit their windows (tau <= H / P, or c_f <=
  H / P steps) they never meet on the link and a round takes
  H step + P max(0, c_f - tau step). Otherwise they queue on the link (FIFO)
  and the steady state is solved exactly (_queued_round_s).
  """
  k, s, h = workload.islands, workload.step_time_s, workload.inner_steps
  compute = h * s
  if workload.mode == "single" or k == 1:
    apply = workload.apply_time_s if workload.mode == "diloco" else 0.0
    return RoundTiming(compute, 0.0, apply, compute + apply,
                       compute / (compute + apply), 0.0, 0.0, False)
  if workload.mode == "ddp":
    c = allreduce_time(workload.collective_bytes, k, link)
    stall = h * max(0.0, c - workload.ddp_hidden_fraction * s)
    return _timing(compute, stall, 0.0, c, h * c, False)
  p, tau = workload.fragments, workload.delay_steps
  c = allreduce_time(workload.collective_bytes, k, link)
  window = h // p  # the shortest gap between two fragments' sends
  apply = workload.apply_time_s
  if tau <= window or c <= window * s:
    stall = p * max(0.0, c - tau * s)
    return _timing(compute, stall, apply, c, p * c, False)
  round_s = link_queue.queued_round_s(h, p, tau, s, c, apply / p)
  return _timing(compute, round_s - compute - apply, apply, c, p * c, True)


def _timing(compute, stall, apply, collective, busy, contended):
  round_s = compute + stall + apply
  return RoundTiming(compute, stall, apply, round_s, compute / round_s,
                     collective, busy, contended)


def end_of_run_s(workload: Workload, link: Link) -> float:
  """What a run spends after its last inner step beyond a steady round.

  The syncs sent after the last step have no later steps to hide behind:
  each of the P fragments' collectives (the whole model's under one-step
  delay) is waited for in full and applied, where a steady round waits
  max(0, c_f - tau step). So the run ends P min(c_f, tau step) later than
  its rounds x round_s; 0 without delay (tau = 0) or for ddp.
  """
  tau = workload.delay_steps
  if workload.mode != "diloco" or workload.islands <= 1 or tau == 0:
    return 0.0
  p = workload.fragments
  c = allreduce_time(workload.collective_bytes, workload.islands, link)
  return p * min(c, tau * workload.step_time_s)


def round_time(workload: Workload, link: Link) -> float:
  """Seconds of one steady-state round (H inner steps); see `timing`."""
  return timing(workload, link).round_s


def utilization(workload: Workload, link: Link) -> float:
  """Share of wall-clock time spent in inner steps, in (0, 1]."""
  return timing(workload, link).utilization


def bandwidth_for_utilization(target: float, workload: Workload,
                              latency_s: float = 0.0) -> float:
  """The least bandwidth (bits/s per island) at which `workload` reaches
  `target` utilization over links of latency `latency_s`.

  Utilization never falls as bandwidth grows, so this bisects on a log
  scale (to 1e-9 relative). 0.0 when nothing is sent.

  Raises:
    ValueError: a target outside (0, 1), or one that latency and the
      one-off costs forbid at any bandwidth.
  """
  require(0 < target < 1, "target", target,
          "is not a utilization in (0, 1)")
  at = lambda bandwidth: utilization(workload, Link(bandwidth, latency_s))
  lo, hi = 1.0, 1e21  # bits/s: a modem's worth to far past any link
  require(at(hi) >= target, "target", target,
          f"is out of reach at latency_s={latency_s}: even an infinitely "
          f"fast link gives {at(hi):.4f}")
  if workload.sync_bytes == 0:  # only latency: no bandwidth helps or hurts
    return 0.0
  if at(lo) >= target:
    return lo
  while hi / lo > 1 + 1e-9:
    mid = math.sqrt(lo * hi)
    lo, hi = (lo, mid) if at(mid) >= target else (mid, hi)
  return hi


