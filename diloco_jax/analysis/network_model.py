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

import collections
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax.codecs import dense as codecs
from diloco_jax.algorithm import compression as compression_lib

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
    _require(self.bandwidth_bits_per_s > 0, "bandwidth_bits_per_s",
             self.bandwidth_bits_per_s, "must be > 0")
    _require(self.latency_s >= 0, "latency_s", self.latency_s,
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

  def __post_init__(self):
    _require(self.mode in MODES, "mode", self.mode, f"is not one of {MODES}")
    _require(_is_int(self.islands) and self.islands >= 1, "islands",
             self.islands, "must be an integer >= 1")
    _require(self.step_time_s > 0, "step_time_s", self.step_time_s,
             "must be > 0")
    _require(self.sync_bytes >= 0, "sync_bytes", self.sync_bytes,
             "must be >= 0")
    _require(_is_int(self.inner_steps) and self.inner_steps >= 1,
             "inner_steps", self.inner_steps, "must be an integer >= 1")
    _require(self.overlap in OVERLAPS, "overlap", self.overlap,
             f"is not one of {OVERLAPS}")
    _require(_is_int(self.fragments)
             and 1 <= self.fragments <= self.inner_steps, "fragments",
             self.fragments,
             f"must be an integer in [1, inner_steps={self.inner_steps}]")
    _require(_is_int(self.fragment_delay)
             and 0 <= self.fragment_delay <= self.inner_steps,
             "fragment_delay", self.fragment_delay,
             f"must be an integer in [0, inner_steps={self.inner_steps}]")
    _require(0 <= self.ddp_hidden_fraction < 1, "ddp_hidden_fraction",
             self.ddp_hidden_fraction, "must be in [0, 1)")
    _require(self.apply_time_s >= 0, "apply_time_s", self.apply_time_s,
             "must be >= 0")
    if self.mode != "diloco":
      for name, default in (("overlap", "none"), ("fragments", 1),
                            ("fragment_delay", 0)):
        _require(getattr(self, name) == default, name, getattr(self, name),
                 f"is DiLoCo's; mode={self.mode!r} has no outer steps")
    if self.mode != "ddp":
      _require(self.ddp_hidden_fraction == 0, "ddp_hidden_fraction",
               self.ddp_hidden_fraction,
               f"is DDP's; mode={self.mode!r} does not all-reduce per step")
    # One-step delay already defers each result by a whole round.
    _require(self.overlap == "none" or self.fragment_delay == 0,
             "fragment_delay", self.fragment_delay,
             "must be 0 with overlap='one_step_delay' (that is tau = H)")

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


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _require(ok: bool, field: str, value, problem: str) -> None:
  """Raises one ValueError naming the field, its value and the problem."""
  if not ok:
    raise ValueError(f"{field}={value!r} {problem}")


def _params_tree(params):
  """A params tree of abstract leaves: `params` itself, or one flat leaf of
  that many float32 values for a count."""
  if _is_int(params):
    _require(params >= 0, "num_params", params, "must be >= 0")
    return {"params": jax.ShapeDtypeStruct((params,), jnp.float32)}
  return params


def bytes_per_sync(params, islands: int, codec="fp32", *,
                   compression_ratio: float | None = None,
                   block_size: int = 256, stripes: int = 1) -> float:
  """Bytes one island sends to all-reduce the whole model once.

  Dense codecs count exactly what the training run counts
  (compression.mean_bytes): a float32 ring all-reduce sends 2(k-1)/k of the
  payload per island; the other dense codecs run the same two phases with
  encoded chunks (values plus one float32 scale per block).

  Args:
    params: the parameter count, or a params tree (arrays or
      jax.ShapeDtypeStruct leaves), whose per-leaf rounding is then exact.
    islands: k.
    codec: a dense codec name, a structured codec name or a
      compression.Compression; None for a codec this project does not have,
      given by `compression_ratio` alone.
    compression_ratio: float32 bytes / bytes sent. Required for structured
      codecs (sign_prune, topk, lowrank, adaptive_lowrank) given a count,
      since their bytes depend on each matrix's shape, and for codec None;
      refused for dense codecs, whose bytes are exact.
    block_size: values per scale of the blockwise dense codecs.
    stripes: FSDP devices per island (each sends its shards' part).

  Returns:
    Bytes (0 for one island).
  """
  _require(_is_int(islands) and islands >= 1, "islands", islands,
           "must be an integer >= 1")
  tree = _params_tree(params)
  if isinstance(codec, compression_lib.Compression):
    compression = codec
  elif codec is None:
    compression = None
  else:
    _require(codec in compression_lib.CODECS, "codec", codec,
             f"is not one of {compression_lib.CODECS} (or None with a "
             "compression_ratio)")
    compression = (compression_lib.Compression(
        codec, codecs.make_codec(codec, block_size))
                   if codec in codecs.DENSE_CODECS else None)
  name = compression.name if compression else codec
  if compression_ratio is not None:
    _require(compression_ratio > 0, "compression_ratio", compression_ratio,
             "must be > 0")
    _require(name not in codecs.DENSE_CODECS, "compression_ratio",
             compression_ratio,
             f"is for structured codecs; codec={name!r}'s bytes are exact")
    return bytes_per_sync(tree, islands, "fp32",
                          stripes=stripes) / compression_ratio
  _require(compression is not None, "compression_ratio", None,
           f"is needed for codec={name!r}: it gives that codec's bytes")
  # A structured Compression over a real params tree is exact (at the top of
  # an adaptive codec's rank ladder); over a count it has no matrices.
  _require(compression.is_dense or not _is_int(params), "compression_ratio",
           None, f"is needed for codec={name!r} given a parameter count: its"
           " bytes depend on each matrix's shape")
  return float(compression_lib.mean_bytes(tree, islands, compression,
                                          stripes=stripes))


def allreduce_time(num_bytes: float, islands: int, link: Link) -> float:
  """Seconds one ring all-reduce holds an island's link.

  2(k-1) messages in sequence, each paying the latency; `num_bytes` (what
  one island sends, e.g. bytes_per_sync) at the link's bandwidth.
  """
  if islands <= 1:
    return 0.0
  return (2 * (islands - 1) * link.latency_s
          + 8.0 * num_bytes / link.bandwidth_bits_per_s)


def ddp_workload(params, islands: int, step_time_s: float, *,
                 inner_steps: int = 1, codec="fp32",
                 hidden_fraction: float = 0.0) -> Workload:
  """DDP: every step all-reduces the gradients (float32 by default, as the
  runs count it), blocking unless `hidden_fraction` of a step hides it.

  `inner_steps` only sets how many steps count as a round.
  """
  return Workload("ddp", islands, step_time_s,
                  bytes_per_sync(params, islands, codec),
                  inner_steps=inner_steps,
                  ddp_hidden_fraction=hidden_fraction)


def diloco_workload(params, islands: int, step_time_s: float,
                    inner_steps: int, *, codec="fp32",
                    compression_ratio: float | None = None,
                    overlap: str = "none", fragments: int = 1,
                    fragment_delay: int = 0, apply_time_s: float = 0.0,
                    block_size: int = 256, stripes: int = 1) -> Workload:
  """DiLoCo, with one-step-delay overlap or Streaming DiLoCo's fragments.

  Args: as Workload's fields and bytes_per_sync's.
  """
  return Workload(
      "diloco", islands, step_time_s,
      bytes_per_sync(params, islands, codec,
                     compression_ratio=compression_ratio,
                     block_size=block_size, stripes=stripes),
      inner_steps=inner_steps, overlap=overlap, fragments=fragments,
      fragment_delay=fragment_delay, apply_time_s=apply_time_s)


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
  DiLoCo's.
  """
  if workload.mode == "single":
    return 0.0
  return workload.sync_bytes / workload.fragments


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
    c = allreduce_time(workload.sync_bytes, k, link)
    stall = h * max(0.0, c - workload.ddp_hidden_fraction * s)
    return _timing(compute, stall, 0.0, c, h * c, False)
  p, tau = workload.fragments, workload.delay_steps
  c = allreduce_time(workload.sync_bytes / p, k, link)
  window = h // p  # the shortest gap between two fragments' sends
  apply = workload.apply_time_s
  if tau <= window or c <= window * s:
    stall = p * max(0.0, c - tau * s)
    return _timing(compute, stall, apply, c, p * c, False)
  round_s = _queued_round_s(h, p, tau, s, c, apply / p)
  return _timing(compute, round_s - compute - apply, apply, c, p * c, True)


def _timing(compute, stall, apply, collective, busy, contended):
  round_s = compute + stall + apply
  return RoundTiming(compute, stall, apply, round_s, compute / round_s,
                     collective, busy, contended)


def _queued_round_s(h: int, p: int, tau: int, s: float, c: float,
                    apply: float) -> float:
  """Steady-state round time of streaming fragments queued on one link.

  Fragment j of a round is sent when the island finishes step
  floor((j + 1) h / p) of it, starts on the link when the link is free
  (first come, first served), holds it for c, and must be back (then
  applied in `apply` seconds) before the island runs past step send + tau.
  Results due at a step are waited for and applied before that step's send,
  as `timing`'s closed form assumes.

  Every time here is a max of sums, so one round maps the state at a round's
  end (the island's clock, when the link frees, the arrival of each result
  still due) to the next by a max-plus linear map x' = A (x) x. A round is
  run once on symbolic times (rows of max-plus coefficients over the state);
  the steady-state round time is A's largest cycle mean (Karp). A plain
  simulation would need a number of rounds that grows without bound as the
  link nears saturation, to settle.
  """
  sends = [((j + 1) * h) // p for j in range(p)]
  carried = [n + tau - h for n in sends if n + tau > h]  # due next round
  size = 2 + len(carried)
  unit = lambda i: np.where(np.arange(size) == i, 0.0, -np.inf)
  clock, link_free = unit(0), unit(1)
  due = collections.deque(  # (step it is due at, when it arrives), in order
      (step, unit(2 + i)) for i, step in enumerate(carried))
  step = 0

  def wait_through(last_step: int) -> None:
    """Runs to each result due by `last_step`, waits for it, applies it."""
    nonlocal clock, step
    while due and due[0][0] <= last_step:
      due_step, arrives = due.popleft()
      clock = np.maximum(clock + (due_step - step) * s, arrives) + apply
      step = due_step

  for send_step in sends:
    wait_through(send_step)
    clock = clock + (send_step - step) * s
    step = send_step
    link_free = np.maximum(clock, link_free) + c
    due.append((send_step + tau, link_free))
    wait_through(send_step)  # tau = 0: wait for it now
  # The same fragments are in flight at every round's end.
  assert [d - h for d, _ in due] == carried, (due, carried)
  return _max_cycle_mean(np.stack([clock, link_free]
                                  + [arrives for _, arrives in due]))


def _max_cycle_mean(a: np.ndarray) -> float:
  """The largest cycle mean of the max-plus matrix a (a[v, u]: the weight
  of u -> v; -inf for none): the growth per application of x -> a (x) x.

  Karp's theorem, with walks allowed to start anywhere: with W_k(v) the
  heaviest k-edge walk ending at v, the mean is
  max_v min_k (W_n(v) - W_k(v)) / (n - k).
  """
  n = len(a)
  walks = np.zeros((n + 1, n))
  for k in range(1, n + 1):
    walks[k] = np.max(a + walks[k - 1][None, :], axis=1)
  best = -np.inf
  for v in range(n):
    if walks[n, v] == -np.inf:
      continue
    best = max(best, min((walks[n, v] - walks[k, v]) / (n - k)
                         for k in range(n) if walks[k, v] > -np.inf))
  return float(best)


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
  c = allreduce_time(workload.sync_bytes / p, workload.islands, link)
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
  _require(0 < target < 1, "target", target,
           "is not a utilization in (0, 1)")
  at = lambda bandwidth: utilization(workload, Link(bandwidth, latency_s))
  lo, hi = 1.0, 1e21  # bits/s: a modem's worth to far past any link
  _require(at(hi) >= target, "target", target,
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


def from_config(config, step_time_s: float, bandwidth_bits_per_s: float,
                latency_s: float = 0.0, *, params=None,
                sync_bytes: float | None = None,
                compression_ratio: float | None = None,
                ddp_hidden_fraction: float = 0.0,
                apply_time_s: float = 0.0) -> tuple[Workload, Link]:
  """The workload and link of a run's config (config_schema.base_config).

  Reads config.mode, config.diloco.{islands, inner_steps, codec} and the
  codec's settings, and config.diloco.{overlap, fragments, fragment_delay,
  outer_placement} with defaults ('none', 1, 0, 'device') where the config
  has no such field. With FSDP every device of an island sends its shards'
  part, as the runs count.

  The overlap is modeled only with outer_placement='host': a collective on
  the compute devices runs in their stream, between inner steps, so it
  hides behind none of them (measured on shaped links: Streaming DiLoCo on
  the compute devices takes plain DiLoCo's round time).

  Args:
    config: the run's ml_collections config.
    step_time_s: one inner step's compute time (e.g. train_s / steps).
    bandwidth_bits_per_s: each island's link, bits per second.
    latency_s: one-way latency of one message.
    params: the params tree (e.g. the run's abstract global params) or a
      parameter count; None builds the model's shapes from config.model.
      Structured codecs need a tree (or a compression_ratio).
    sync_bytes: bytes one island sends per sync (per step for ddp), as a
      run measured them (comm_bytes / syncs: an adaptive codec's ranks as
      they were); None counts them from params and the codec.
    compression_ratio: see bytes_per_sync.
    ddp_hidden_fraction: see Workload (ddp only).
    apply_time_s: see Workload (diloco only).

  Returns:
    (workload, link).
  """
  d = config.diloco
  link = Link(bandwidth_bits_per_s, latency_s)
  if config.mode == "single":
    return Workload("single", 1, step_time_s, 0.0,
                    inner_steps=d.inner_steps), link
  if sync_bytes is None:
    if params is None:
      from diloco_jax.model import transformer as model_lib  # pylint: disable=g-import-not-at-top
      params = model_lib.param_shapes(config.model)
    stripes = config.mesh.data if config.mesh.fsdp else 1
    # DDP all-reduces float32 gradients, as accounting.LinkBytes counts them.
    codec = (compression_lib.from_config(d) if config.mode == "diloco"
             else "fp32")
    sync_bytes = bytes_per_sync(params, d.islands, codec,
                                compression_ratio=compression_ratio,
                                stripes=stripes)
  if config.mode == "ddp":
    return Workload("ddp", d.islands, step_time_s, sync_bytes,
                    inner_steps=d.inner_steps,
                    ddp_hidden_fraction=ddp_hidden_fraction), link
  overlaps = d.get("outer_placement", "device") == "host"
  # The rebasing delay sends and waits as the plain delay does.
  delayed = d.get("overlap", "none") != "none"
  return Workload(
      "diloco", d.islands, step_time_s, sync_bytes,
      inner_steps=d.inner_steps,
      overlap="one_step_delay" if overlaps and delayed else "none",
      fragments=d.get("fragments", 1),
      fragment_delay=d.get("fragment_delay", 0) if overlaps else 0,
      apply_time_s=apply_time_s), link


def run_estimate(config, step_time_s: float, bandwidth_bits_per_s: float,
                 latency_s: float = 0.0, *, params=None,
                 sync_bytes: float | None = None,
                 compression_ratio: float | None = None,
                 targets: tuple[float, ...] = (0.9, 0.95)) -> dict:
  """What a run's config would cost over the given link, for summary.json.

  The run's config.total_steps (pretraining steps run as one worker, with
  nothing sent) at the modeled round time.

  Args: as from_config's; `targets`: utilizations to report the bandwidth
  needed for.

  Returns:
    A dict of JSON numbers: the link, the bytes per sync, the modeled round
    time, utilization and wall-clock time of the whole run (its rounds and
    end_of_run_s), and
    `network_bandwidth_for_utilization` {target: bits/s} (None where latency
    alone forbids the target).
  """
  workload, link = from_config(config, step_time_s, bandwidth_bits_per_s,
                               latency_s, params=params,
                               sync_bytes=sync_bytes,
                               compression_ratio=compression_ratio)
  t = timing(workload, link)
  pretrain = min(config.pretrain_steps, config.total_steps)
  steps = config.total_steps - pretrain
  needed = {}
  for target in targets:
    try:
      needed[str(target)] = bandwidth_for_utilization(target, workload,
                                                      latency_s)
    except ValueError:
      needed[str(target)] = None
  return {
      "network_bandwidth_bits_per_s": bandwidth_bits_per_s,
      "network_latency_s": latency_s,
      "network_step_time_s": step_time_s,
      "network_sync_bytes": workload.sync_bytes,
      "network_round_s": t.round_s,
      "network_utilization": t.utilization,
      "network_wall_s": pretrain * step_time_s
                        + steps / workload.inner_steps * t.round_s
                        + (end_of_run_s(workload, link) if steps else 0.0),
      "network_bandwidth_for_utilization": needed,
  }
