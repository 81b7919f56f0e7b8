r"""The papers' network settings side by side, through our network model.

  python -m experiments.network_model [--dilocox_step_s=10] [...]

Prints markdown tables (docs/network_model.md pastes them): what
diloco_jax/analysis/network_model.py says about DiLoCoX's 107B run over
1 Gbit/s, OpenDiLoCo's and INTELLECT-1's utilization across continents, the
bandwidth Streaming DiLoCo's simulation needs for 95% utilization at 1B, and
what the elastic path's coordinator (analysis/star_channel.py) costs against
a ring all-reduce.

Each setting's inputs are written below as the papers give them. What the
papers do not give (step time, latency, and for DiLoCoX H and the
compression; for Streaming DiLoCo the worker count, fragments and tau) are
assumptions, marked `*` in the tables and settable by flags. The model
computes; nothing is fitted to the papers' figures.
"""

import math

from absl import app
from absl import flags
import jax

from configs import c4_150m
from configs import default as default_config
from diloco_jax.analysis import network_model as nm
from diloco_jax.analysis import star_channel
from diloco_jax.analysis import workloads
from diloco_jax.codecs import dense as codecs
from diloco_jax.model import transformer as model_lib

# Streaming DiLoCo sends 4-bit floats; int4 sends as many bytes where this
# tree's codecs have no fp4.
_FP4 = "fp4" if "fp4" in codecs.DENSE_CODECS else "int4"
_FP4_LABEL = "fp4" if _FP4 == "fp4" else "fp4 (our int4: as many bytes)"

# Assumptions (flags). Step times are not inputs any of these papers state
# for the setting quoted; required bandwidth scales as 1 / step time.
_DILOCOX_STEP_S = flags.DEFINE_float(
    "dilocox_step_s", 10.0, "DiLoCoX: seconds per inner step (assumed).")
_DILOCOX_H = flags.DEFINE_integer(
    "dilocox_inner_steps", 100, "DiLoCoX: H (assumed).")
_DILOCOX_CODEC = flags.DEFINE_string(
    "dilocox_codec", "int4",
    "DiLoCoX: our codec standing for its compression (assumed; it adds low "
    "rank to quantization, so int4's 7.8x is a floor).")
_DILOCOX_RATIO = flags.DEFINE_float(
    "dilocox_ratio", 0.0,
    "DiLoCoX: a compression ratio vs fp32 to use instead of the codec "
    "(0: use --dilocox_codec).")
_DILOCOX_LATENCY_S = flags.DEFINE_float(
    "dilocox_latency_s", 0.01, "DiLoCoX: one-way latency (assumed).")
_OPENDILOCO_STEP_S = flags.DEFINE_float(
    "opendiloco_step_s", 1.0, "OpenDiLoCo 1.1B: seconds per step (assumed).")
_INTELLECT1_STEP_S = flags.DEFINE_float(
    "intellect1_step_s", 20.0, "INTELLECT-1: seconds per step (assumed).")
_WAN_LATENCY_S = flags.DEFINE_float(
    "wan_latency_s", 0.1,
    "OpenDiLoCo and INTELLECT-1: one-way latency across continents "
    "(assumed).")
_STREAMING_STEP_S = flags.DEFINE_float(
    "streaming_step_s", 0.1, "Streaming DiLoCo 1B: seconds per step "
    "(assumed).")
_STREAMING_WORKERS = flags.DEFINE_integer(
    "streaming_workers", 2, "Streaming DiLoCo: workers (assumed).")
_STREAMING_FRAGMENTS = flags.DEFINE_integer(
    "streaming_fragments", 8,
    "Streaming DiLoCo: P (assumed: 3-layer fragments of a 24-layer model).")
_STREAMING_TAU = flags.DEFINE_integer(
    "streaming_tau", 1, "Streaming DiLoCo: overlapped steps tau (assumed).")
_STREAMING_LATENCY_S = flags.DEFINE_float(
    "streaming_latency_s", 0.0, "Streaming DiLoCo: latency (assumed).")
_ISLAND_TOKENS = flags.DEFINE_integer(
    "dilocox_island_tokens", 2**19,
    "DiLoCoX-style scaling: tokens per inner step of one island (assumed).")
_GPU_FLOPS = flags.DEFINE_float(
    "dilocox_gpu_flops", 312e12,
    "DiLoCoX-style scaling: each GPU's bf16 peak (A800: 312 TFLOP/s).")
_MFU = flags.DEFINE_float(
    "dilocox_mfu", 0.4, "DiLoCoX-style scaling: model FLOP utilization "
    "inside an island (assumed).")
_ELASTIC_LATENCY_S = flags.DEFINE_float(
    "elastic_latency_s", 0.01,
    "Elastic channel: one-way latency of every link (assumed).")

GBIT = 1e9


def _gbit(bits_per_s: float | None) -> str:
  if bits_per_s is None:
    return "unreachable"
  if bits_per_s >= 100 * GBIT:
    return f"{bits_per_s / GBIT:,.0f}"
  return f"{bits_per_s / GBIT:.2f}" if bits_per_s < GBIT else (
      f"{bits_per_s / GBIT:.1f}")


def _needed(target: float, workload: nm.Workload, latency_s: float):
  """Bandwidth for `target` utilization, or None where latency forbids it."""
  try:
    return nm.bandwidth_for_utilization(target, workload, latency_s)
  except ValueError:
    return None


def _bytes(n: float) -> str:
  return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def _least(predicate, lo: float, hi: float, integer: bool = False):
  """The least x in [lo, hi] with predicate(x) (monotone), or None."""
  if not predicate(hi):
    return None
  if integer:
    lo, hi = int(lo), int(hi)
    while lo < hi:
      mid = (lo + hi) // 2
      lo, hi = (lo, mid) if predicate(mid) else (mid + 1, hi)
    return lo
  for _ in range(200):
    mid = (lo + hi) / 2
    lo, hi = (lo, mid) if predicate(mid) else (mid, hi)
  return hi


def dilocox() -> list[str]:
  """DiLoCoX (arXiv 2506.21263): 107B params over a 1 Gbit/s network, 20
  nodes, one-step-delay overlap; 357x faster than vanilla AllReduce."""
  params, nodes, bandwidth, claim = 107_000_000_000, 20, 1 * GBIT, 357.0
  step, h = _DILOCOX_STEP_S.value, _DILOCOX_H.value
  link = nm.Link(bandwidth, _DILOCOX_LATENCY_S.value)
  ratio = _DILOCOX_RATIO.value or None
  codec = "adaptive_lowrank" if ratio else _DILOCOX_CODEC.value

  def speedup(step_s, inner_steps, compression_ratio=ratio):
    """All-reduce round time / DiLoCoX round time, for the same steps."""
    ddp = workloads.ddp_workload(params, nodes, step_s, inner_steps=inner_steps)
    x = workloads.diloco_workload(
        params, nodes, step_s, inner_steps,
        codec="adaptive_lowrank" if compression_ratio else codec,
        compression_ratio=compression_ratio, overlap="one_step_delay")
    return nm.round_time(ddp, link) / nm.round_time(x, link)

  ddp = workloads.ddp_workload(params, nodes, step, inner_steps=h)
  x = workloads.diloco_workload(params, nodes, step, h, codec=codec,
                                compression_ratio=ratio,
                                overlap="one_step_delay")
  fp32 = workloads.bytes_per_sync(params, nodes, "fp32")
  c_ddp = nm.allreduce_time(ddp.sync_bytes, nodes, link)
  c_x = nm.allreduce_time(x.sync_bytes, nodes, link)
  model = speedup(step, h)
  bf16_c = nm.allreduce_time(
      workloads.bytes_per_sync(params, nodes, "bf16"), nodes, link)
  # Comm hidden (c_x <= H step): the speedup is (step + c_ddp) / step, so
  # the claim pins the step time; otherwise it grows with H x ratio.
  hidden_step = c_ddp / (claim - 1)
  least_ratio = _least(lambda r: speedup(step, h, r) >= claim, 1.0, 1e6)
  least_h = _least(lambda n: speedup(step, n) >= claim, 1, 100_000,
                   integer=True)
  codec_text = (f"ratio {ratio:g}x*" if ratio else
                f"{codec}* ({fp32 / x.sync_bytes:.2f}x)")
  return [
      f"| DiLoCoX, one-step delay | 107B | {nodes} | {h}* | {codec_text} | "
      f"1 Gbit/s, {link.latency_s * 1e3:g} ms* | {step:g} s* | "
      f"sync {c_x:,.0f} s vs {h * step:,.0f} s of compute: utilization "
      f"{nm.utilization(x, link):.1%}; **{model:,.0f}x** the all-reduce | "
      f"357x vanilla AllReduce |",
      f"| all-reduce every step (its baseline) | 107B | {nodes} | 1 | fp32 |"
      f" 1 Gbit/s | {step:g} s* | {c_ddp:,.0f} s per step: utilization "
      f"{nm.utilization(ddp, link):.2%} | |",
  ], [
      f"What 357x takes in the model (fp32 all-reduce of {_bytes(fp32)} per "
      f"node per step, {c_ddp:,.0f} s at 1 Gbit/s):",
      f"- with the sync hidden behind compute (one-step delay), the speedup"
      f" is (step + {c_ddp:,.0f} s) / step, so 357x is a step of "
      f"**{hidden_step:.1f} s**; at {step:g} s/step the ceiling is "
      f"{(step + c_ddp) / step:,.0f}x.",
      f"- at {step:g} s/step and H = {h}: a compression ratio of "
      + (f"**{least_ratio:.2f}x** or more vs fp32" if least_ratio else
         "no size (the ceiling is below 357x)")
      + f" (below it the sync outlasts H steps and the speedup is about "
      f"H x ratio); with {codec_text.rstrip('*')}, H = "
      + (f"**{least_h}** or more." if least_h else "no H reaches it."),
      f"- against a bf16 all-reduce ({bf16_c:,.0f} s a step) 357x is a "
      f"step of {bf16_c / (claim - 1):.1f} s with the sync hidden. If each "
      "node held one pipeline stage, it would send 1/stages of the model: "
      "the same as that much more compression.",
  ]


def dilocox_scaling() -> list[str]:
  """DiLoCoX-style islands at growing sizes: 160 GPUs as 10 islands of 8
  pipeline stages x 2 data-parallel replicas, 1 Gbit/s between islands.
  The step time follows from the FLOPs (6 N per token), the GPUs' peak and
  an MFU, all assumed; each stage sends its share, over the island's one
  link or over a link per stage (a node each)."""
  islands, stages, replicas, bandwidth = 10, 8, 2, 1 * GBIT
  h, codec = _DILOCOX_H.value, _DILOCOX_CODEC.value
  latency = _DILOCOX_LATENCY_S.value
  link = nm.Link(bandwidth, latency)
  rows = []
  for params in (1_300_000_000, 7_000_000_000, 30_000_000_000,
                 107_000_000_000):
    step = (6 * params * _ISLAND_TOKENS.value
            / (stages * replicas * _GPU_FLOPS.value * _MFU.value))
    diloco = lambda links, overlap="none", inner_steps=h: (
        workloads.diloco_workload(params, islands, step, inner_steps,
                                  codec=codec, overlap=overlap,
                                  stages=stages, stage_links=links))
    least_h = _least(lambda n: nm.utilization(diloco(1, inner_steps=n),
                                              link) >= 0.95,
                     1, 100_000, integer=True)
    ddp = workloads.ddp_workload(params, islands, step, inner_steps=h,
                                 stages=stages)
    rows.append(
        f"| {params / 1e9:g}B | {step:,.1f} s* | "
        f"{_bytes(diloco(1).sync_bytes / stages)} | "
        f"{nm.timing(diloco(1), link).collective_s:,.0f} s / "
        f"{nm.timing(diloco(stages), link).collective_s:,.0f} s | "
        f"{nm.utilization(diloco(1), link):.1%} / "
        f"{nm.utilization(diloco(stages), link):.1%} | "
        f"**{nm.utilization(diloco(1, 'one_step_delay'), link):.1%}** | "
        f"{least_h} | {nm.utilization(ddp, link):.2%} |")
  return rows


def opendiloco_and_intellect1() -> list[str]:
  """OpenDiLoCo (arXiv 2407.07852) and INTELLECT-1 (arXiv 2412.01152)."""
  rows = []
  latency = _WAN_LATENCY_S.value
  settings = (
      # name, params, islands, H, codec, step (assumed), reported range
      ("OpenDiLoCo 1.1B", 1_100_000_000, 4, 125, "fp16",
       _OPENDILOCO_STEP_S.value, (0.90, 0.95), "90-95% utilization"),
      ("INTELLECT-1", 10_000_000_000, 14, 100, "int8",
       _INTELLECT1_STEP_S.value, (0.83, 0.96), "83-96% utilization"),
  )
  for name, params, k, h, codec, step, targets, paper in settings:
    w = workloads.diloco_workload(params, k, step, h, codec=codec)
    needed = ", ".join(
        f"{t:.0%}: **{_gbit(_needed(t, w, latency))} Gbit/s**"
        for t in targets)
    rows.append(
        f"| {name} | {params / 1e9:g}B | {k} | {h} | {codec} "
        f"({_bytes(w.sync_bytes)} per sync) | {latency * 1e3:g} ms* | "
        f"{step:g} s* | needs {needed} | {paper} |")
  return rows


def streaming() -> list[str]:
  """Streaming DiLoCo (arXiv 2501.18512): the bandwidth its simulation
  needs for 95% utilization at 1B params, H = 100."""
  params, h, target = 1_000_000_000, 100, 0.95
  k, step = _STREAMING_WORKERS.value, _STREAMING_STEP_S.value
  p, tau = _STREAMING_FRAGMENTS.value, _STREAMING_TAU.value
  latency = _STREAMING_LATENCY_S.value
  ddp = lambda codec, hidden=0.0: workloads.ddp_workload(
      params, k, step, inner_steps=h, codec=codec, hidden_fraction=hidden)
  dl = lambda codec, **kw: workloads.diloco_workload(params, k, step, h,
                                                     codec=codec, **kw)
  rows = (
      # method, workload for fp32 payloads, for bf16, the paper's Gbit/s
      ("Data-Parallel (all-reduce blocks each step)", ddp("fp32"),
       ddp("bf16"), "222"),
      ("Data-Parallel, all-reduce behind 2/3 of the step (backward)",
       ddp("fp32", 2 / 3), ddp("bf16", 2 / 3), ""),
      ("DiLoCo", dl("fp32"), dl("bf16"), "23.3"),
      (f"Streaming DiLoCo, P = {p}*, tau = 0", dl("fp32", fragments=p),
       dl("bf16", fragments=p), "16.0"),
      (f"Streaming DiLoCo + overlap, tau = {tau}*",
       dl("fp32", fragments=p, fragment_delay=tau),
       dl("bf16", fragments=p, fragment_delay=tau), "9.1"),
      (f"Streaming DiLoCo + overlap + {_FP4_LABEL}, tau = {tau}*",
       dl(_FP4, fragments=p, fragment_delay=tau), None, "2.0"),
  )
  lines = []
  for name, fp32, bf16, paper in rows:
    ours_bf16 = "" if bf16 is None else _gbit(_needed(target, bf16, latency))
    lines.append(
        f"| {name} | {_bytes(nm.peak_bytes(fp32))} | "
        f"**{_gbit(_needed(target, fp32, latency))}** | {ours_bf16} | "
        f"{paper} |")
  return lines


def _seconds(t: float) -> str:
  return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:,.2f} s"


def elastic_channel() -> list[str]:
  """One round's exchange of the elastic path (k islands, a coordinator;
  x down in float32, the params up in float32 or int8) against a ring
  all-reduce of the same payloads, over 1 Gbit/s links."""
  link, rows = nm.Link(1 * GBIT, _ELASTIC_LATENCY_S.value), []
  int8 = codecs.make_codec("int8")
  need = lambda t: _seconds(star_channel.compute_for_utilization(0.9, t))
  for name, module in (("default", default_config), ("150M", c4_150m)):
    shapes = model_lib.param_shapes(module.get_config().model)
    n = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes))
    # int8 encodes the flat vector: values plus a scale per block.
    blocks = math.ceil(n / int8.block_size) * int8.block_size
    for up_name, up in (("fp32", 4 * n), ("int8", int8.payload_bytes(blocks))):
      for k in (2, 4, 8, 16):
        star = star_channel.Star(up, 4 * n)
        wide = star_channel.Star(up, 4 * n, k * link.bandwidth_bits_per_s)
        s = star_channel.star_time(star, k, link)
        r = star_channel.ring_time(star, k, link)
        w_c = star_channel.crossover_bits_per_s(star, k, link)
        match = "never" if w_c == math.inf else (
            f"{w_c / GBIT:.2f} Gbit/s ({w_c / link.bandwidth_bits_per_s:.1f}"
            " W)")
        rows.append(
            f"| {name} ({n / 1e6:.1f}M) | {up_name}, {_bytes(up)} | {k} | "
            f"{_seconds(s)} | {_seconds(star_channel.star_time(wide, k, link))}"
            f" | {_seconds(r)} | {s / r:.1f}x | {match} | {need(s)} / "
            f"{need(r)} |")
  return rows


def main(argv):
  del argv
  x_rows, x_notes = dilocox()
  print("Settings (`*`: assumed, not given by the paper; flags set them)\n")
  print("| setting | params | islands | H | codec | link | step | model | "
        "paper |")
  print("|---|---|---|---|---|---|---|---|---|")
  print("\n".join(x_rows + opendiloco_and_intellect1()))
  print()
  print("\n".join(x_notes))
  print()
  print(f"Bandwidth for 95% utilization, 1B params, H = 100, "
        f"{_STREAMING_WORKERS.value} workers*, {_STREAMING_STEP_S.value:g} "
        f"s/step*, latency {_STREAMING_LATENCY_S.value * 1e3:g} ms* "
        f"(Gbit/s per worker)\n")
  print("| method | largest collective | ours, fp32 payloads | ours, bf16 "
        "payloads | paper's simulation |")
  print("|---|---|---|---|---|")
  print("\n".join(streaming()))
  print()
  print(f"DiLoCoX-style islands: 10 islands x (8 pipeline stages x 2 "
        f"replicas) = 160 GPUs, 1 Gbit/s between islands, latency "
        f"{_DILOCOX_LATENCY_S.value * 1e3:g} ms*, H = {_DILOCOX_H.value}*, "
        f"{_DILOCOX_CODEC.value}*; step time from 6 N FLOPs per token, "
        f"{_ISLAND_TOKENS.value:,} tokens per island step*, "
        f"{_GPU_FLOPS.value / 1e12:g} TFLOP/s per GPU at {_MFU.value:.0%} "
        "MFU*\n")
  print("| params | step | a stage's sync | sync: shared link / link per "
        "stage | utilization, blocking: shared / per stage | one-step "
        "delay, shared | least H for 95%, blocking, shared | all-reduce "
        "every step |")
  print("|---|---|---|---|---|---|---|---|")
  print("\n".join(dilocox_scaling()))
  print()
  print(f"The elastic channel: one round's exchange over 1 Gbit/s links "
        f"(W), latency {_ELASTIC_LATENCY_S.value * 1e3:g} ms*; x sent down "
        "in fp32; star: through a coordinator whose link is W_c; ring: an "
        "all-reduce of the same payloads among the islands\n")
  print("| model | up payload | k | star, W_c = W | star, W_c = k W | ring |"
        " star / ring (W_c = W) | W_c for the star to match the ring | "
        "compute per round for 90%: star / ring |")
  print("|---|---|---|---|---|---|---|---|---|")
  print("\n".join(elastic_channel()))


if __name__ == "__main__":
  app.run(main)
