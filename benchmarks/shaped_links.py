r"""DiLoCo variants over a real, rate-limited link between processes (root).

  sudo .venv/bin/python benchmarks/shaped_links.py \
      [--bandwidths_mbit=1000,100] \
      [--modes=ddp,diloco,overlap_host,eager_host,streaming_host] \
      [--stages=2] \
      [--codecs=fp32,int8] [--steps=60] [--ddp_steps=30] [--inner_steps=10]
      [--out=res.json]

One island per process, one process per Linux network namespace. The
namespaces (dj<pid>n0, dj<pid>n1, ...) hang off a bridge of their own in
the root namespace (dj<pid>br) through veth pairs, and hold 10.77.0.2,
10.77.0.3, ... of the private subnet --subnet (default 10.77.0.0/24, which
nothing else on the machine may use: the script refuses one that is
routed already). Each namespace's egress, its veth end, is shaped with

  tc qdisc replace dev <veth> root tbf rate <R>mbit burst 64kb latency 100ms

(a token bucket: a rate limit; no added delay). gloo connects to the
address the hostname resolves to, so /etc/netns/<ns>/hosts maps
socket.gethostname() to the namespace's own address. Every process runs
`ip netns exec <ns> python -m diloco_jax.main ... --coordinator_address=
<ns0 address>:<port> --num_processes=N --process_id=i`. Everything the
script creates (namespaces, veths, bridge, /etc/netns entries) is removed
at the end, also on an error, Ctrl-C or SIGTERM.

Per run the table gives:
  * round s: the steady-state wall-clock per round (ddp: per H steps),
    from metrics.jsonl's elapsed_s at the round ends: the mean of rounds
    2 .. R-1 (round 1 holds warm-up, the last one the end-of-run syncs);
    train_s / rounds with fewer than 3. Runs evaluate at their last step
    only (config.eval.every_rounds=0): the rounds time training and syncs.
  * util: compute utilization in that steady state, H x inner-step time /
    round s, where the inner-step time is the steady round / H of a
    reference run: diloco fp32, overlap none, in the same namespaces with
    NO rate limit (its syncs over an unshaped veth are included, so it
    slightly overstates the step's compute time, and util); the *_stages
    modes' reference has as many pipeline stages.
  * model round s / model util: workloads.run_estimate for the run's
    config at that reference step time and the shaped rate (latency 0: tbf
    adds none); err: round s / model round s - 1.
  * train s / model train s: the whole loop (warm-up and end-of-run syncs
    included) beside the model's network_wall_s.
  * link MB/proc: bytes that crossed the link, the mean over namespaces of
    the namespace veth's tx_bytes (read inside the namespace before the
    processes start and after they exit: so it includes the coordinator's
    gRPC, gloo's setup, the per-step loss gathers, TCP/IP headers and ACKs);
    rx_bytes is recorded in the JSON. comm MB: summary comm_bytes (what one
    island's syncs sent by the run's own count). ratio: link / comm.

A model sized for 2 CPU cores: 2 layers, d_model 256 (2.16M params, an
8.66 MB fp32 sync); --model_flags replaces those overrides. Results and
what they show: docs/shaped_links.md.
"""

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from absl import app
from absl import flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)
from benchmarks import netns  # pylint: disable=g-import-not-at-top,wrong-import-position

_PROCESSES = flags.DEFINE_integer("processes", 2,
                                  "Processes (= islands, one each).")
_BANDWIDTHS = flags.DEFINE_list("bandwidths_mbit", ["1000", "100", "10"],
                                "Link rates to measure, Mbit/s.")
_MODES = flags.DEFINE_list(
    "modes", ["ddp", "diloco", "overlap_host", "eager_host", "streaming_host"],
    "ddp | diloco (overlap none) | overlap_host (one_step_delay, outer step "
    "on a host device) | eager_host (eager updates, the collective on a host "
    "device) | streaming (fragments/fragment_delay, on the "
    "compute devices) | streaming_host (the same, sends on a host device) | "
    "diloco_stages (diloco on islands of --stages pipeline stages) | "
    "streaming_stages_host (those stages as the fragments, each stage's "
    "sends on a host device of its own: staggered stage syncs).")
_STAGES = flags.DEFINE_integer(
    "stages", 2, "Pipeline stages per island of the *_stages modes (their "
    "inner-step time is an unshaped reference run's with as many stages).")
_CODECS = flags.DEFINE_list("codecs", ["fp32", "int8"],
                            "config.diloco.codec values (ddp: fp32 only; it "
                            "all-reduces fp32 gradients whatever the codec).")
_CONFIG = flags.DEFINE_string("config", "configs/default.py", "Base config.")
_STEPS = flags.DEFINE_integer("steps", 60, "config.total_steps of each "
                              "DiLoCo run.")
_DDP_STEPS = flags.DEFINE_integer("ddp_steps", 30, "config.total_steps of "
                                  "the ddp runs (slow on slow links).")
_INNER = flags.DEFINE_integer("inner_steps", 10, "H.")
_FRAGMENTS = flags.DEFINE_integer("fragments", 2, "Streaming: fragments P.")
_DELAY = flags.DEFINE_integer("fragment_delay", 2, "Streaming: tau.")
_MODEL_FLAGS = flags.DEFINE_list(
    "model_flags",
    ["--config.model.num_layers=2", "--config.model.d_model=256",
     "--config.model.num_heads=4", "--config.model.head_dim=64",
     "--config.model.mlp_dim=1024", "--config.data.batch_size=8",
     "--config.inner_optimizer.warmup_steps=5",
     "--config.eval.batch_size=8", "--config.eval.num_batches=1",
     "--config.eval.every_rounds=0"],
    "Overrides of the base config: the model, the batch, the evaluation.")
_EXTRA = flags.DEFINE_list("extra_flags", [], "More diloco_jax.main flags.")
_REFERENCE = flags.DEFINE_bool(
    "reference", True, "Run the unshaped reference run (for util and the "
    "model's step time); without it util and the model columns are blank.")
_SUBNET = flags.DEFINE_string("subnet", "10.77.0", "First 3 octets of the "
                              "private /24 the namespaces use.")
_PORT = flags.DEFINE_integer("port", 12357, "Coordinator port (in ns0).")
_TIMEOUT = flags.DEFINE_integer("run_timeout_s", 600,
                                "A run that takes longer is killed.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/shaped_links",
                               "Parent of the runs' workdirs (emptied).")
_OUT = flags.DEFINE_string("out", None, "Write the rows as JSON here.")
_QUIET = flags.DEFINE_bool("quiet", True,
                           "Runs' output to <workdir>/<run>.<i>.log only.")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
  ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _kill_all(children) -> None:
  for child in children:
    if child.poll() is None:
      child.terminate()
  deadline = time.monotonic() + 5
  for child in children:
    try:
      child.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
      child.kill()
      child.wait()


_CHILDREN: list[subprocess.Popen] = []


def _run(net: netns.Network, name: str, main_flags: list[str]) -> dict:
  """One run, one process per namespace; its summary and link counters."""
  workdir = os.path.join(os.path.abspath(_WORKDIR.value), name)
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  n = len(net.ns)
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env.update(PYTHONPATH=_REPO, JAX_PLATFORMS="cpu")
  before = net.counters()
  start = time.perf_counter()
  logs = []
  try:
    for i, ns in enumerate(net.ns):
      log = open(os.path.join(workdir, f"process{i}.log"), "wb")
      logs.append(log)
      _CHILDREN.append(subprocess.Popen(
          ["ip", "netns", "exec", ns, sys.executable, "-m", "diloco_jax.main",
           f"--config={_CONFIG.value}", f"--workdir={workdir}",
           f"--coordinator_address={net.addr[0]}:{_PORT.value}",
           f"--num_processes={n}", f"--process_id={i}", *main_flags],
          cwd=_REPO, env=env, stdout=log if _QUIET.value else None,
          stderr=subprocess.STDOUT, preexec_fn=_die_with_parent))
    deadline = time.monotonic() + _TIMEOUT.value
    while True:
      codes = [c.poll() for c in _CHILDREN]
      if any(code not in (None, 0) for code in codes):
        bad = next(i for i, c in enumerate(codes) if c not in (None, 0))
        raise RuntimeError(f"{name}: process {bad} exited {codes[bad]}; see "
                           f"{workdir}/process{bad}.log")
      if all(code == 0 for code in codes):
        break
      if time.monotonic() > deadline:
        raise RuntimeError(f"{name}: over --run_timeout_s={_TIMEOUT.value}")
      time.sleep(0.2)
  finally:
    _kill_all(_CHILDREN)
    _CHILDREN.clear()
    for log in logs:
      log.close()
  wall = time.perf_counter() - start
  after = net.counters()
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  with open(os.path.join(workdir, "config.json")) as f:
    config = json.load(f)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    metrics = [json.loads(line) for line in f]
  delta = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
  return {"summary": summary, "config": config, "counters": delta,
          "wall_s": wall, "metrics": metrics}


def steady_round_s(metrics: list[dict], inner_steps: int,
                   train_s: float) -> float:
  """The mean wall-clock of rounds 2 .. R-1 from the records' elapsed_s at
  the round ends (train_s / R with fewer than 3 rounds)."""
  ends = {r["step"]: r["elapsed_s"] for r in metrics
          if r["step"] % inner_steps == 0}
  rounds = len(ends)
  if rounds < 3:
    return train_s / max(rounds, 1)
  return (ends[(rounds - 1) * inner_steps] - ends[inner_steps]) / (rounds - 2)


def _stages(mode: str) -> int:
  return _STAGES.value if "stages" in mode else 1


def _mode_flags(mode: str, codec: str) -> list[str]:
  f = [f"--config.diloco.codec={codec}"]
  if mode == "ddp":
    return ["--config.mode=ddp"]
  f.append("--config.mode=diloco")
  if _stages(mode) > 1:
    f.append(f"--config.mesh.stage={_stages(mode)}")
  if mode == "streaming_stages_host":
    # One fragment per stage, each stage's sends on its own outer device.
    f += [f"--config.diloco.fragments={_STAGES.value}",
          f"--config.diloco.fragment_delay={_DELAY.value}",
          "--config.diloco.outer_placement=host"]
  elif mode in ("overlap_host", "eager_host"):
    overlap = "eager" if mode == "eager_host" else "one_step_delay"
    f += [f"--config.diloco.overlap={overlap}",
          "--config.diloco.outer_placement=host"]
    if mode == "eager_host":
      # The steady overlap from the first round: warm-up rounds wait as
      # plain DiLoCo's do, and the round time is measured over the middle.
      f.append("--config.diloco.overlap_warmup_rounds=0")
  elif mode in ("streaming", "streaming_host"):
    f += [f"--config.diloco.fragments={_FRAGMENTS.value}",
          f"--config.diloco.fragment_delay={_DELAY.value}"]
    if mode == "streaming_host":
      f.append("--config.diloco.outer_placement=host")
  elif mode not in ("diloco", "diloco_stages"):
    raise app.UsageError(f"unknown mode {mode}")
  return f


def _model(config_dict: dict, step_s: float, mbit: float) -> dict:
  import ml_collections  # pylint: disable=g-import-not-at-top
  from diloco_jax.analysis import workloads  # pylint: disable=g-import-not-at-top
  config = ml_collections.ConfigDict(config_dict)
  return workloads.run_estimate(config, step_time_s=step_s,
                                bandwidth_bits_per_s=mbit * 1e6,
                                latency_s=0.0)


def _row(name, mode, codec, mbit, result, ref_step_s):
  s = result["summary"]
  h = s["inner_steps"]
  round_s = steady_round_s(result["metrics"], h, s["train_s"])
  row = {"run": name, "mode": mode, "codec": codec, "mbit": mbit,
         "train_s": s["train_s"], "wall_s": result["wall_s"],
         "round_s": round_s, "step_s": round_s / h,
         "round_ends_s": [r["elapsed_s"] for r in result["metrics"]
                          if r["step"] % h == 0],
         "comm_bytes": s["comm_bytes"],
         "link_tx_bytes": [c["tx_bytes"] for c in result["counters"]],
         "link_rx_bytes": [c["rx_bytes"] for c in result["counters"]],
         "summary_network_round_s": s.get("network_round_s"),
         "summary_network_utilization": s.get("network_utilization"),
         "final_eval_loss": s["final_eval_loss"]}
  n = len(result["counters"])
  row["link_bytes_per_process"] = sum(row["link_tx_bytes"]) / n
  row["link_over_comm"] = (row["link_bytes_per_process"] / s["comm_bytes"]
                           if s["comm_bytes"] else None)
  if ref_step_s:
    row["utilization"] = h * ref_step_s / round_s
    if mbit:
      est = _model(result["config"], ref_step_s, mbit)
      row["model_round_s"] = est["network_round_s"]
      row["model_utilization"] = est["network_utilization"]
      row["model_train_s"] = est["network_wall_s"]
      row["model_error"] = round_s / est["network_round_s"] - 1
  return row


def _table(rows, ref_step_s) -> str:
  fmt = lambda x, f: "" if x is None else format(x, f)
  steps = ", ".join(f"{fmt(step, '.4f')} s at {stages} stage(s)"
                    for stages, step in sorted(ref_step_s.items()))
  lines = [f"inner-step time (reference: diloco fp32, unshaped): {steps}\n",
           "| mode | codec | Mbit/s | round s | util | model round s | "
           "model util | err | train s | model train s | link MB/proc | "
           "comm MB | link/comm | eval loss |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(
        f"| {r['mode']} | {r['codec']} | {r['mbit'] or 'unshaped'} | "
        f"{r['round_s']:.2f} | {fmt(r.get('utilization'), '.2f')} | "
        f"{fmt(r.get('model_round_s'), '.2f')} | "
        f"{fmt(r.get('model_utilization'), '.2f')} | "
        f"{fmt(r.get('model_error'), '+.0%')} | {r['train_s']:.1f} | "
        f"{fmt(r.get('model_train_s'), '.1f')} | "
        f"{r['link_bytes_per_process'] / 1e6:.2f} | "
        f"{r['comm_bytes'] / 1e6:.2f} | {fmt(r['link_over_comm'], '.2f')} | "
        f"{r['final_eval_loss']:.4f} |")
  return "\n".join(lines)


def _on_signal(signum, _):
  raise KeyboardInterrupt(f"signal {signum}")


def main(argv):
  del argv
  if os.geteuid() != 0:
    sys.exit("shaped_links.py needs root (network namespaces, veth, tc): "
             "run it with sudo.")
  for sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, _on_signal)
  common = [f"--config.diloco.islands={_PROCESSES.value}",
            f"--config.diloco.inner_steps={_INNER.value}",
            "--config.checkpoint.every_rounds=0",
            "--config.network.latency_s=0.0",
            *_MODEL_FLAGS.value, *_EXTRA.value]
  net = netns.Network(_PROCESSES.value, _SUBNET.value)
  rows, ref_step_s, failures = [], {}, []
  try:
    net.create()
    plan = []
    if _REFERENCE.value:  # one per stage count the modes use
      for stages in sorted({_stages(mode) for mode in _MODES.value}):
        plan.append(("reference" if stages == 1 else f"reference_{stages}"
                     "_stages", "diloco" if stages == 1 else "diloco_stages",
                     "fp32", None))
    for mbit in map(float, _BANDWIDTHS.value):
      mbit = int(mbit) if mbit == int(mbit) else mbit
      for mode in _MODES.value:
        for codec in (["fp32"] if mode == "ddp" else _CODECS.value):
          plan.append((f"{mode}_{codec}_{mbit}mbit", mode, codec, mbit))
    for name, mode, codec, mbit in plan:
      net.shape(mbit)
      print(f"{name} ...", flush=True)
      rate = [f"--config.network.bandwidth_bits_per_s={mbit * 1e6}"] if mbit \
          else []
      try:
        steps = _DDP_STEPS.value if mode == "ddp" else _STEPS.value
        result = _run(net, name, common + _mode_flags(mode, codec) + rate
                      + [f"--config.total_steps={steps}"])
      except RuntimeError as e:  # one failed run: note it, go on
        print(f"  FAILED: {e}", flush=True)
        failures.append(str(e))
        continue
      if name.startswith("reference"):
        ref_step_s[_stages(mode)] = steady_round_s(
            result["metrics"], _INNER.value,
            result["summary"]["train_s"]) / _INNER.value
      rows.append(_row(name, mode, codec, mbit, result,
                       ref_step_s.get(_stages(mode))))
      r = rows[-1]
      print(f"  round {r['round_s']:.2f} s, link "
            f"{r['link_bytes_per_process'] / 1e6:.2f} MB/proc, comm "
            f"{r['comm_bytes'] / 1e6:.2f} MB", flush=True)
  finally:
    _kill_all(_CHILDREN)
    net.close()
    if rows:
      table = _table(rows, ref_step_s)
      table += "".join(f"\nFAILED: {f}" for f in failures)
      print("\n" + table)
      if _OUT.value:
        os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)),
                    exist_ok=True)
        with open(_OUT.value, "w") as f:
          json.dump({"reference_step_s": ref_step_s, "rows": rows,
                     "failures": failures,
                     "table": table,
                     "flags": {"steps": _STEPS.value,
                               "ddp_steps": _DDP_STEPS.value,
                               "H": _INNER.value,
                               "processes": _PROCESSES.value,
                               "model_flags": _MODEL_FLAGS.value,
                               "config": _CONFIG.value}}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
