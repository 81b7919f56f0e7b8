r"""Data pipeline throughput and checkpoint save/restore time.

1. Streams C4-format JSONL shards (written from the embedded stdlib corpus
   into a temporary directory) through the real pipeline (read, tokenize,
   pack, batch per island) pinned to ONE core, for the byte tokenizer and for
   a SentencePiece model trained here; compares with the tokens/s the default
   config's training consumes (a short real run in the same process).
2. Saves and restores the full TrainState of the 150M C4 config (global params,
   outer momentum, and params + AdamW moments of every island) with the
   project's orbax Checkpointer.

  python benchmarks/data_and_checkpoint_benchmark.py [--islands=2]
"""

import gzip
import json
import os
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


def _write_c4_shards(directory: str, num_train_shards: int = 4) -> int:
  """Writes stdlib sources as C4-format json.gz shards; returns bytes."""
  from diloco_jax.data import embedded  # pylint: disable=g-import-not-at-top
  paths = embedded.stdlib_source_files("train", 0.05)
  documents = [d.decode("utf-8", "replace")
               for d in embedded.read_documents(paths)]
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
  from diloco_jax.algorithm import state as state_lib  # pylint: disable=g-import-not-at-top
  from diloco_jax.config import overlap_defaults  # pylint: disable=g-import-not-at-top
  from diloco_jax.config import run_config  # pylint: disable=g-import-not-at-top
  from diloco_jax.model import transformer as model_lib  # pylint: disable=g-import-not-at-top
  from diloco_jax.run import checkpoints  # pylint: disable=g-import-not-at-top
  c4 = c4_150m.get_config()
  islands = _ISLANDS.value
  _, params = model_lib.init_params(c4.model, 0)
  inner = optimizers.inner_optimizer(
      run_config.inner_optimizer(c4.inner_optimizer), c4.total_steps)
  outer = optimizers.outer_optimizer(run_config.outer_optimizer(
      overlap_defaults.resolve(c4).diloco.outer_optimizer))
  with jax.default_device(jax.devices()[0]):
    state = jax.jit(lambda p: state_lib.init_state(p, inner, outer,
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


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_num_cpu_devices", 4)
  with tempfile.TemporaryDirectory() as tmp:
    _data_pipeline(tmp)
    _checkpoint(tmp)


if __name__ == "__main__":
  app.run(main)
