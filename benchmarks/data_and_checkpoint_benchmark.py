r"""Data pipeline throughput and checkpoint save/restore time.

1. Streams C4-format JSONL shards (written from the embedded stdlib corpus
   into a temporary directory) through the real pipeline (read, tokenize,
   pack, batch per island) pinned to ONE core, for the byte tokenizer and for
   a SentencePiece model trained here; compares with the tokens/s the default
   config's training consumes (a short real run in the same process).
2. Saves and restores the full TrainState of the 150M C4 config (global params,
   outer momentum, and params + AdamW moments of every island) with the
   project's orbax Checkpointer.
3. Pre-tokenizing (`python -m diloco_jax.data.prepare`): SentencePiece's
   tokens/s in one process, the prepare's tokens/s with 1, 2, ... worker
   processes on a few MB of C4-format shards, and the batch assembly of
   the "tokens" corpus (memory-mapped shards) pinned to one core.

  python benchmarks/data_and_checkpoint_benchmark.py [--islands=2] \
      [--sections=stream,checkpoint,prepare]
"""

import gzip
import json
import os
import resource
import sys
import tempfile
import time

from absl import app
from absl import flags

# The configs/ package lives at the repository root, beside this folder.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_ISLANDS = flags.DEFINE_integer(
    "islands", 2, "Islands in the 150M checkpoint (memory grows 3x params "
    "per island).")
_TOKENS = flags.DEFINE_integer(
    "tokens", 40_000_000,
    "Tokens to stream per tokenizer (more than one pass over the shards).")
_SECTIONS = flags.DEFINE_list(
    "sections", ["stream", "checkpoint", "prepare"],
    "What to measure: stream (the C4 pipeline), checkpoint, prepare.")
_PREPARE_MEGABYTES = flags.DEFINE_integer(
    "prepare_megabytes", 16, "Text the prepare section tokenizes, in MB.")
_PREPARE_PROCESSES = flags.DEFINE_list(
    "prepare_processes", ["1", "2"], "Worker processes to time the prepare "
    "with.")


def _write_c4_shards(directory: str, num_train_shards: int = 4,
                     megabytes: float | None = None) -> int:
  """Writes stdlib sources (their first `megabytes` if given) as C4-format
  json.gz shards; returns the characters written."""
  from diloco_jax.data import embedded  # pylint: disable=g-import-not-at-top
  paths = embedded.stdlib_source_files("train", 0.05)
  documents, total = [], 0
  for document in embedded.read_documents(paths):
    documents.append(document.decode("utf-8", "replace"))
    total += len(documents[-1])
    if megabytes is not None and total >= megabytes * 1e6:
      break
  total = 0
  shards = [("c4-train.%05d-of-%05d.json.gz" % (i, num_train_shards),
             documents[i::num_train_shards + 1])
            for i in range(num_train_shards)]
  shards.append(("c4-validation.00000-of-00001.json.gz",
                 documents[num_train_shards::num_train_shards + 1]))
  for name, docs in shards:
    with gzip.open(os.path.join(directory, name), "wt") as f:
      for text in docs:
        f.write(json.dumps({"text": text, "url": "", "timestamp": ""}) + "\n")
        total += len(text)
  return total


def _train_sentencepiece(directory: str, vocab_size: int = 8000) -> str:
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  from diloco_jax.data import embedded  # pylint: disable=g-import-not-at-top
  sample = os.path.join(directory, "sample.txt")
  with open(sample, "wb") as f:
    for i, document in enumerate(embedded.read_documents(
        embedded.stdlib_source_files("train", 0.05))):
      if i % 8 == 0:
        f.write(document + b"\n")
  prefix = os.path.join(directory, "spm")
  spm.SentencePieceTrainer.train(
      input=sample, model_prefix=prefix, vocab_size=vocab_size,
      model_type="unigram", input_sentence_size=200_000,
      shuffle_input_sentence=True, minloglevel=2)
  return prefix + ".model"


def _stream_tokens_per_second(data_config, tokens: int) -> float:
  from diloco_jax.data import sources  # pylint: disable=g-import-not-at-top
  islands, batch = 4, 16
  start = time.perf_counter()  # opening shards counts too
  source = sources.make_batch_source(data_config, islands, batch, seed=0)
  per_batch = islands * batch * data_config.sequence_length
  produced = 0
  while produced < tokens:
    source.next_batch()
    produced += per_batch
  return produced / (time.perf_counter() - start)


def _data_pipeline(tmp: str) -> None:
  """The C4 pipeline's tokens/s on one core, against what training takes."""
  from configs import default  # pylint: disable=g-import-not-at-top
  from diloco_jax.run import train  # pylint: disable=g-import-not-at-top
  shard_dir = os.path.join(tmp, "c4")
  os.makedirs(shard_dir)
  _write_c4_shards(shard_dir)
  spm_path = _train_sentencepiece(tmp)
  all_cores = os.sched_getaffinity(0)
  os.sched_setaffinity(0, {min(all_cores)})
  rates = {}
  for tokenizer in ("byte", "sentencepiece"):
    data_config = default.get_config().data
    data_config.corpus = "c4"
    data_config.path = shard_dir
    data_config.tokenizer = tokenizer
    data_config.tokenizer_path = spm_path if tokenizer != "byte" else ""
    rates[tokenizer] = _stream_tokens_per_second(data_config, _TOKENS.value)
  os.sched_setaffinity(0, all_cores)
  config = default.get_config()
  config.total_steps = 12
  summary = train.train_and_evaluate(config, os.path.join(tmp, "run"))
  consumed = summary["tokens_per_s"]
  print(f"training consumes (default config, 4 islands, 2 cores): "
        f"{consumed:,.0f} tokens/s")
  for tokenizer, rate in rates.items():
    print(f"C4 JSONL pipeline, {tokenizer:13s} on 1 core: {rate:,.0f} "
          f"tokens/s = {rate / consumed:.0f}x what training consumes")


def _checkpoint(tmp: str) -> None:
  """Saving and restoring the 150M config's whole state."""
  import jax  # pylint: disable=g-import-not-at-top
  from configs import c4_150m  # pylint: disable=g-import-not-at-top
  from diloco_jax.algorithm import optimizers  # pylint: disable=g-import-not-at-top
  from diloco_jax.algorithm import outer_settings  # pylint: disable=g-import-not-at-top
  from diloco_jax.algorithm import state as state_lib  # pylint: disable=g-import-not-at-top
  from diloco_jax.config import overlap_defaults  # pylint: disable=g-import-not-at-top
  from diloco_jax.config import run_config  # pylint: disable=g-import-not-at-top
  from diloco_jax.model import transformer as model_lib  # pylint: disable=g-import-not-at-top
  from diloco_jax.storage import checkpoints  # pylint: disable=g-import-not-at-top
  c4 = c4_150m.get_config()
  islands = _ISLANDS.value
  _, params = model_lib.init_params(c4.model, 0)
  inner = optimizers.inner_optimizer(
      run_config.inner_optimizer(c4.inner_optimizer), c4.total_steps)
  outer = optimizers.outer_optimizer(run_config.outer_optimizer(
      overlap_defaults.resolve(c4).diloco.outer_optimizer))
  with jax.default_device(jax.devices()[0]):
    state = jax.jit(lambda p: outer_settings.init_state(p, inner, outer,
                                                        islands))(params)
  jax.block_until_ready(state)
  num_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  checkpointer = checkpoints.Checkpointer(os.path.join(tmp, "ckpt"))
  start = time.perf_counter()
  checkpointer.save(1, state, {"step": 1})
  blocking = time.perf_counter() - start
  checkpointer.wait()
  saved = time.perf_counter() - start
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      state)
  del state
  start = time.perf_counter()
  restored = checkpointer.restore_state(1, abstract)
  jax.block_until_ready(restored)
  restore_s = time.perf_counter() - start
  checkpointer.close()
  print(f"150M config state, {islands} islands: "
        f"{model_lib.count_params(params):,} params, {num_bytes / 1e9:.2f} GB")
  print(f"  save: {blocking:.2f} s blocking (async), {saved:.1f} s until on "
        f"disk ({num_bytes / 1e6 / saved:,.0f} MB/s)")
  print(f"  restore: {restore_s:.1f} s ({num_bytes / 1e6 / restore_s:,.0f} "
        "MB/s)")


def _cpu_seconds() -> float:
  """CPU time of this process and of its finished children: on a loaded
  machine, tokens per CPU second is what a core would give alone."""
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return time.process_time() + children.ru_utime + children.ru_stime


def _prepare_seconds(shard_dir: str, output: str, tokenizer_path: str,
                     processes: int):
  """(wall seconds, CPU seconds, index) of one prepare of the shards."""
  from diloco_jax.data import prepare  # pylint: disable=g-import-not-at-top
  from diloco_jax.data import prepare_plan  # pylint: disable=g-import-not-at-top
  start, cpu = time.perf_counter(), _cpu_seconds()
  plan = prepare_plan.make_plan("c4", shard_dir, output, tokenizer_path)
  index = prepare.prepare(plan, processes)  # starting workers counts too
  return time.perf_counter() - start, _cpu_seconds() - cpu, index


def _assembly_tokens_per_second(path: str, islands: int, batch: int,
                                sequence_length: int,
                                tokens: int = 10**9) -> float:
  """The tokens corpus's next_batch on the current core, in tokens/s."""
  from diloco_jax.data import token_batches  # pylint: disable=g-import-not-at-top
  from diloco_jax.data import token_shards  # pylint: disable=g-import-not-at-top
  source = token_batches.TokenIslandBatches(
      token_shards.read_index(path), islands, batch, sequence_length, seed=0)
  per_batch = islands * batch * (sequence_length + 1)
  steps = max(1, tokens // per_batch)
  source.next_batch()  # maps the first shards
  start = time.perf_counter()
  for _ in range(steps):
    source.next_batch()
  return steps * per_batch / (time.perf_counter() - start)


def _prepare(tmp: str) -> None:
  """SentencePiece per process, the prepare's scaling, the tokens corpus."""
  from diloco_jax.data import c4_files  # pylint: disable=g-import-not-at-top
  from diloco_jax.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  shard_dir = os.path.join(tmp, "c4_prepare")
  os.makedirs(shard_dir)
  train_shards = 8
  chars = _write_c4_shards(shard_dir, num_train_shards=train_shards,
                           megabytes=_PREPARE_MEGABYTES.value)
  spm_path = _train_sentencepiece(tmp)
  print(f"prepare: {chars / 1e6:.1f}M characters of stdlib sources in "
        f"{train_shards + 1} C4-format shards, {os.cpu_count()} CPUs, load "
        f"average {os.getloadavg()[0]:.1f}")
  texts = [text for shard in c4_files.list_shards(shard_dir)
           for _, text in c4_files.read_texts(shard)]
  encoder = tokenizer_lib.SentencePieceTokenizer(spm_path)
  start, cpu = time.perf_counter(), time.process_time()
  encoded = sum(encoder.encode(text).size for text in texts)
  print(f"  SentencePiece ({encoder.vocab_size:,} pieces) encode alone, one "
        f"process: {encoded / (time.perf_counter() - start) / 1e6:.2f}M "
        f"tokens/s, {encoded / (time.process_time() - cpu) / 1e6:.2f}M "
        "tokens per CPU second")
  for name, model in (("sentencepiece", spm_path), ("byte", "")):
    base = None
    for processes in map(int, _PREPARE_PROCESSES.value):
      output = os.path.join(tmp, f"tokens_{name}_{processes}")
      seconds, cpu, index = _prepare_seconds(shard_dir, output, model,
                                             processes)
      tokens = index.tokens("train") + index.tokens("validation")
      base = base or tokens / seconds
      print(f"  prepare, {name:13s} {processes} process(es): {tokens:,} "
            f"tokens in {seconds:.2f} s = {tokens / seconds / 1e6:.2f}M "
            f"tokens/s ({tokens / seconds / base:.2f}x one process), "
            f"{tokens / cpu / 1e6:.2f}M per CPU second")
  all_cores = os.sched_getaffinity(0)
  os.sched_setaffinity(0, {min(all_cores)})
  path = os.path.join(tmp, f"tokens_byte_{_PREPARE_PROCESSES.value[0]}")
  for islands, batch, sequence_length in ((4, 16, 128), (8, 64, 1024),
                                          (8, 512, 1024)):
    rate = _assembly_tokens_per_second(path, islands, batch, sequence_length)
    print(f"  tokens corpus batch assembly, {islands} islands x {batch} x "
          f"{sequence_length + 1}, 1 core: {rate / 1e6:,.0f}M tokens/s")
  os.sched_setaffinity(0, all_cores)


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_num_cpu_devices", 4)
  sections = {"stream": _data_pipeline, "checkpoint": _checkpoint,
              "prepare": _prepare}
  unknown = set(_SECTIONS.value) - set(sections)
  if unknown:
    raise app.UsageError(f"--sections: no section {sorted(unknown)}; "
                         f"choose from {sorted(sections)}")
  with tempfile.TemporaryDirectory() as tmp:
    for name in _SECTIONS.value:
      sections[name](tmp)


if __name__ == "__main__":
  app.run(main)
