r"""Inner step speed on one device: MFU, token sources, the real loop end
to end, folded islands and microbatching.

Sections (--sections; all by default), on the config's model, each printing
its figures (medians of interleaved repeats, so both sides of a comparison
see the same machine noise):

  step        the DiLoCo inner step (one island, the config's batch) against
              a plain jitted optax step of the same model and batch; model
              FLOP utilization against the device's peak for the compute
              dtype (flops.py's table of GPUs/TPUs) and against a matmul of
              that dtype measured in this run; the outer step against 100
              inner steps. Random tokens.
  tokens      the inner step on each --token_sources: `random` (uniform
              ids), `corpus` (the config's own corpus, as the run reads
              it) and `constant` (one id everywhere: the most repeats a
              batch can have), as ratios to random; and the embedding
              look-up's gradient alone on each, the plain scatter-add of
              the table in the compute dtype (what nnx.Embed's gradient
              is) against the model's sorted float32 sum
              (model/embedding.py).
  end_to_end  the real run: `python -m diloco_jax.main` with this config
              (and its --config.* overrides) for --e2e_rounds rounds in a
              temporary workdir, evals, outer steps and checkpoints
              included; its tokens/s against the inner step's on random
              tokens (all islands, folded on this device) as a ratio, and
              the first round end's cost against the later ones'.
  fold        --fold_islands islands of batch --fold_batch folded onto the
              one device against one island of batch islands x fold_batch.
  microbatch  one island of batch --big_batch in --microbatches accumulated
              parts against one island of the config's batch.

  python benchmarks/step_benchmark.py --config=configs/default.py
  python benchmarks/step_benchmark.py --config=configs/default.py \
      --sections=tokens,end_to_end
  # The 150M model on a GPU (bf16; the C4 config needs no data here):
  python benchmarks/step_benchmark.py --config=configs/c4_150m.py \
      --config.data.batch_size=16 --big_batch=512
"""

import os
import statistics
import subprocess
import sys
import tempfile

from absl import app
from absl import flags
from ml_collections import config_flags

import step_timing as timing

# Configs import each other as `configs.*` (c4_150m.py, c4_small.py): the
# repository root goes on the path, as `python -m` puts the working
# directory there for diloco_jax.main.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py",
                                          "Config whose model to measure.")
_SECTIONS = flags.DEFINE_list(
    "sections", ["step", "tokens", "end_to_end", "fold", "microbatch"],
    "Which comparisons to run.")
_TOKEN_SOURCES = flags.DEFINE_list("token_sources",
                                   ["random", "corpus", "constant"],
                                   "tokens: where the batches come from.")
_E2E_ROUNDS = flags.DEFINE_integer(
    "e2e_rounds", 4, "end_to_end: rounds of the run (at least 3: the first "
    "round end is compared with the later ones).")
_REPEATS = flags.DEFINE_integer("repeats", 7, "Interleaved timing repeats.")
_STEPS = flags.DEFINE_integer("steps", 10, "Steps per timed block.")
_FOLD_ISLANDS = flags.DEFINE_integer("fold_islands", 8,
                                     "fold: islands stacked on the device.")
_FOLD_BATCH = flags.DEFINE_integer("fold_batch", 8,
                                   "fold: per-island batch of those islands.")
_BIG_BATCH = flags.DEFINE_integer(
    "big_batch", None, "microbatch: the accumulated batch (default: "
    "microbatches x the config's batch).")
_MICROBATCHES = flags.DEFINE_integer("microbatches", 32,
                                     "microbatch: parts of big_batch.")


def _step_section(config) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  from diloco_jax.analysis import flops
  from diloco_jax.model import transformer as model_lib  # pylint: disable=g-import-not-at-top
  device = jax.devices()[0]
  on_cpu = device.platform == "cpu"
  inner = timing.InnerSteps(config, 1, config.data.batch_size)
  med = timing.interleaved(
      {"plain": timing.plain_steps(config), "inner": inner}, _REPEATS.value,
      _STEPS.value)
  med.update(timing.interleaved({"outer": inner.outer_steps},
                                _REPEATS.value, _STEPS.value))
  tokens = inner.tokens_per_step
  model_flops = flops.training_flops_per_token(
      config.model, config.data.sequence_length) * tokens / med["inner"]
  print(f"step: 1 island, batch {config.data.batch_size} x "
        f"{config.data.sequence_length}, attention "
        f"{model_lib.attention_implementation(config.model)}, remat "
        f"{config.model.remat}")
  print(f"  plain optax step      {med['plain'] * 1e3:9.2f} ms  "
        f"{tokens / med['plain']:12,.0f} tokens/s")
  print(f"  DiLoCo inner step     {med['inner'] * 1e3:9.2f} ms  "
        f"{tokens / med['inner']:12,.0f} tokens/s")
  print(f"    plain time / inner time: {med['plain'] / med['inner']:.3f}"
        "  (target >= 0.97)")
  print(f"  DiLoCo outer step     {med['outer'] * 1e3:9.2f} ms = "
        f"{med['outer'] / med['inner']:.3f}% of 100 inner steps"
        "  (target <= 1%)")
  matmul = timing.matmul_flops_per_s(config.model.dtype, on_cpu)
  per_token = flops.training_flops_per_token(config.model,
                                             config.data.sequence_length)
  print(f"  {config.model.dtype} matmul (this run)  "
        f"{timing.format_flops(matmul)}")
  print(f"  model FLOP/s          {timing.format_flops(model_flops)} "
        f"({per_token / 1e6:.2f} MFLOP per token)")
  peak = flops.peak_flops_per_s(device.device_kind, config.model.dtype)
  if peak:
    print(f"    MFU vs the {device.device_kind} {config.model.dtype} peak "
          f"({peak / 1e12:.0f} TFLOP/s): {model_flops / peak:.1%}")
  else:
    print(f"    no {config.model.dtype} peak on record for "
          f"{device.device_kind!r}")
  print(f"    vs the {config.model.dtype} matmul measured above: "
        f"{model_flops / matmul:.1%}", flush=True)


def _token_batches(config, islands: int) -> dict:
  """[islands, batch, L+1] int32 batches per --token_sources name; a source
  that cannot be built here is left out, saying why."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from diloco_jax.data import errors  # pylint: disable=g-import-not-at-top
  from diloco_jax.data import sources  # pylint: disable=g-import-not-at-top
  shape = (islands, config.data.batch_size, config.data.sequence_length + 1)
  batches = {}
  for name in _TOKEN_SOURCES.value:
    if name == "random":
      batches[name] = np.random.default_rng(0).integers(
          0, config.model.vocab_size, shape, np.int32)
    elif name == "constant":
      batches[name] = np.zeros(shape, np.int32)
    elif name == "corpus":
      try:
        source = sources.make_batch_source(config.data, islands,
                                           config.data.batch_size,
                                           config.seed)
        batches["corpus"] = source.next_batch()
        print(f"  corpus: {source.info.name}")
      except errors.DataError as e:
        print(f"  corpus: left out, {e}")
    else:
      raise app.UsageError(f"--token_sources: unknown source {name!r} "
                           "(random, corpus or constant)")
  return batches


def _most_repeats(tokens) -> int:
  """How many positions hold the batch's most frequent id."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  return int(np.bincount(np.asarray(tokens).reshape(-1)).max())


def _embedding_gradient_runs(config, tokens):
  """Timed runs of the embedding look-up's gradient alone on `tokens`: the
  plain one (the table cast to the compute dtype, then taken: its gradient
  is a scatter-add in that dtype) and the model's (model/embedding.py)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from diloco_jax.model import embedding  # pylint: disable=g-import-not-at-top
  dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[
      config.model.dtype]
  ids = jax.device_put(tokens[0, :, :-1])
  table = jax.random.normal(jax.random.key(0), (config.model.vocab_size,
                                                config.model.d_model))
  cotangent = jax.random.normal(jax.random.key(1),
                                ids.shape + (config.model.d_model,), dtype)
  lookups = {"plain": lambda t: jnp.take(t.astype(dtype), ids, axis=0),
             "sorted": lambda t: embedding.take_rows(t, ids, dtype)}
  runs = {}
  for name, lookup in lookups.items():
    gradient = jax.jit(lambda t, g, lookup=lookup: jax.vjp(lookup, t)[1](g)[0])

    def run(steps, gradient=gradient):
      for _ in range(steps):
        out = gradient(table, cotangent)
      out.block_until_ready()

    runs[name] = run
  return runs


def _tokens_section(config) -> None:
  import gc  # pylint: disable=g-import-not-at-top
  print(f"tokens: the inner step by token source, 1 island, batch "
        f"{config.data.batch_size} x {config.data.sequence_length}")
  batches = _token_batches(config, 1)
  steps = {name: timing.InnerSteps(config, 1, config.data.batch_size,
                                   tokens=tokens)
           for name, tokens in batches.items()}
  med = timing.interleaved(steps, _REPEATS.value, _STEPS.value)
  tokens_per_step = config.data.batch_size * config.data.sequence_length
  base = med.get("random")
  for name, seconds in med.items():
    ratio = f"  random / this: {base / seconds:.3f}" if base else ""
    print(f"  {name:28s} {seconds * 1e3:9.2f} ms  "
          f"{tokens_per_step / seconds:12,.0f} tokens/s  most repeated id "
          f"x{_most_repeats(batches[name]):,}{ratio}")
  steps.clear()
  gc.collect()
  print("  the embedding gradient alone, plain scatter-add in "
        f"{config.model.dtype} vs the model's sorted float32 sum:")
  for name, tokens in batches.items():
    grad = timing.interleaved(_embedding_gradient_runs(config, tokens),
                        _REPEATS.value, _STEPS.value)
    print(f"    {name:26s} plain {grad['plain'] * 1e3:9.3f} ms  sorted "
          f"{grad['sorted'] * 1e3:9.3f} ms  plain / sorted "
          f"{grad['plain'] / grad['sorted']:.2f}", flush=True)


def _run_main(workdir: str, total_steps: int) -> str:
  """Runs `python -m diloco_jax.main` with this benchmark's --config and
  its overrides for `total_steps` steps; returns the run's log."""
  config_flag = flags.FLAGS["config"]
  command = [sys.executable, "-m", "diloco_jax.main",
             f"--config={config_flags.get_config_filename(config_flag)}",
             f"--workdir={workdir}"]
  overrides = config_flags.get_override_values(config_flag)
  overrides.update({"total_steps": total_steps, "pretrain_steps": 0})
  command += [f"--config.{key}={value}" for key, value in overrides.items()]
  print("  " + " ".join(command[1:]), flush=True)
  # From this working directory (paths in flags stay as given), with the
  # repository root on the path for configs/.
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      filter(None, [_REPO, os.environ.get("PYTHONPATH")])))
  done = subprocess.run(command, capture_output=True, text=True, env=env,
                        check=False)
  if done.returncode:
    raise SystemExit(f"end_to_end: the run failed:\n{done.stderr[-3000:]}")
  return done.stderr


def _step_intervals(records: list) -> dict:
  """{step: seconds from the previous record to this one}, from the
  metrics.jsonl records (elapsed_s counts from the first step's start)."""
  intervals, previous = {}, None
  for record in records:
    if previous is not None:
      intervals[record["step"]] = record["elapsed_s"] - previous
    previous = record["elapsed_s"]
  return intervals


def _end_to_end_section(config) -> None:
  import json  # pylint: disable=g-import-not-at-top
  inner_steps = config.diloco.inner_steps
  if inner_steps < 3:
    raise app.UsageError(
        f"end_to_end: inner_steps={inner_steps} leaves no step between round "
        "ends to time; set --config.diloco.inner_steps to 3 or more")
  rounds = max(_E2E_ROUNDS.value, 3)
  islands = config.diloco.islands if config.mode != "single" else 1
  print(f"end_to_end: the run for {rounds} rounds of {inner_steps} steps, "
        f"{islands} island(s) x batch {config.data.batch_size} x "
        f"{config.data.sequence_length}")
  with tempfile.TemporaryDirectory() as workdir:
    log = _run_main(os.path.join(workdir, "run"),
                    rounds * inner_steps)
    with open(os.path.join(workdir, "run", "metrics.jsonl")) as f:
      records = [json.loads(line) for line in f]
  for line in log.splitlines():
    if "placement:" in line:
      print("  run's " + line[line.index("placement:"):])
  first, last = records[0], records[-1]
  run_rate = ((last["tokens_seen"] - first["tokens_seen"])
              / (last["elapsed_s"] - first["elapsed_s"]))
  intervals = _step_intervals(records)
  # Steps that neither end a round nor follow one: the loop's plain step.
  plain = [t for step, t in intervals.items()
           if step % inner_steps not in (0, 1)]
  step_s = statistics.median(plain)
  # A round end's cost: the two intervals around it (its last step with
  # the eval, then the outer step and the save before the next step's
  # record) less two plain steps.
  ends = {step: intervals[step] + intervals[step + 1] - 2 * step_s
          for step in range(inner_steps, last["step"], inner_steps)
          if step in intervals and step + 1 in intervals}
  inner = timing.InnerSteps(config, islands, config.data.batch_size)
  inner_s = timing.interleaved({"inner": inner}, _REPEATS.value,
                         _STEPS.value)["inner"]
  inner_rate = inner.tokens_per_step / inner_s
  tokens_per_step = inner.tokens_per_step
  print(f"  end to end over steps 2..{last['step']}  "
        f"{run_rate:12,.0f} tokens/s")
  print(f"  the run's median plain step  {tokens_per_step / step_s:12,.0f} "
        f"tokens/s ({step_s * 1e3:.2f} ms)")
  print(f"  inner step here, random tokens {inner_rate:12,.0f} tokens/s "
        f"({inner_s * 1e3:.2f} ms; islands folded on one device)")
  print(f"    end to end / the run's own step: "
        f"{run_rate * step_s / tokens_per_step:.3f} (what round ends, evals "
        "and data cost)")
  print(f"    end to end / inner step: {run_rate / inner_rate:.3f}"
        "  (target >= 0.95; like with like where the run also has one "
        "device)")
  later = [cost for step, cost in ends.items() if step > inner_steps]
  if inner_steps in ends and later:
    print(f"  first round end {ends[inner_steps] * 1e3:9.1f} ms; later ones "
          f"(median of {len(later)}) {statistics.median(later) * 1e3:9.1f} ms"
          "  (eval, outer step and save each)", flush=True)


def _ratio_section(title: str, runs: dict) -> None:
  import gc  # pylint: disable=g-import-not-at-top
  med = timing.interleaved(runs, _REPEATS.value, max(_STEPS.value // 2, 2))
  rates = {name: run.tokens_per_step / med[name] for name, run in runs.items()}
  (first, first_rate), (second, second_rate) = rates.items()
  print(title)
  for name, rate in rates.items():
    print(f"  {name:32s} {med[name] * 1e3:9.2f} ms  {rate:12,.0f} tokens/s")
  print(f"    {first} / {second}: {first_rate / second_rate:.3f}", flush=True)
  runs.clear()
  gc.collect()


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  config = _CONFIG.value
  device = jax.devices()[0]
  print(f"device: {device.device_kind} ({device.platform}), jax "
        f"{jax.__version__}; model dtype {config.model.dtype}, "
        f"{config.model.num_layers} x {config.model.d_model}, vocab "
        f"{config.model.vocab_size}", flush=True)
  if "step" in _SECTIONS.value:
    _step_section(config)
  if "tokens" in _SECTIONS.value:
    _tokens_section(config)
  if "end_to_end" in _SECTIONS.value:
    _end_to_end_section(config)
  if "fold" in _SECTIONS.value:
    k, b = _FOLD_ISLANDS.value, _FOLD_BATCH.value
    _ratio_section("fold: islands stacked on one device vs one island", {
        f"{k} islands x batch {b}, folded": timing.InnerSteps(config, k, b),
        f"1 island x batch {k * b}": timing.InnerSteps(config, 1, k * b)})
  if "microbatch" in _SECTIONS.value:
    parts = _MICROBATCHES.value
    big = _BIG_BATCH.value or parts * config.data.batch_size
    _ratio_section("microbatch: gradient accumulation vs the plain batch", {
        f"batch {big} in {parts} microbatches": timing.InnerSteps(
            config, 1, big, parts),
        f"batch {config.data.batch_size}": timing.InnerSteps(
            config, 1, config.data.batch_size)})


if __name__ == "__main__":
  app.run(main)
