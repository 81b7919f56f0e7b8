r"""The DiLoCo paper's protocol on C4 at sizes one GPU or a Colab affords.

  python -m diloco_jax.main --config=configs/c4_small.py:gpu --workdir=DIR \
      --config.data.path=~/c4 --config.data.tokenizer_path=MODEL \
      [--config.mode=single|ddp]

Every run, DiLoCo and the baselines alike, first pretrains one worker (the
paper: 24k of 88k steps), then trains its mode from that model, as the
paper's Table 2 compares them: `diloco` (k islands, outer Nesterov lr 0.7,
momentum 0.9), `ddp` (k workers averaging gradients every step: k x the
batch) and `single` (one worker, 1/k of the compute). The sizes:

  gpu    the paper's 60M model (3 x 896, vocab 32,000, sequence 1024),
         8 islands of batch 64 in 8 microbatches, 8,800 steps of which
         2,400 pretrain, then 64 rounds of H=100: a tenth of the paper's
         steps, an eighth of its batch. Needs a 32,000-piece tokenizer and
         24 train shards (docs/c4.md); one H100 for ~1 h (diloco, ddp),
         ~10 min (single), estimated from FLOPs, not run yet.
  colab  a 5.5M model (4 x 256, vocab 8,192, sequence 256), 4 islands of
         batch 16, 1,100 steps of which 300 pretrain, then 16 rounds of
         H=50: minutes a run on a Colab GPU (estimated from FLOPs). Needs
         an 8,192-piece tokenizer and 4 train shards.
  quick  the tests' tiny model on C4-format shards and a tokenizer of at
         most 512 pieces: seconds on a CPU (colabs/02_c4_repro.ipynb's
         QUICK run).

docs/c4.md gets the shards and the tokenizer and gives the time and the
numbers per size. --config.data.path and --config.data.tokenizer_path are
required; without them the run stops in one line naming the field.
"""

from configs import c4_common
from configs import tiny

SIZES = ("gpu", "colab", "quick")
# Tokenizer pieces per size: config.model.vocab_size, and the --vocab_size
# to train the tokenizer with (python -m diloco_jax.data.train_tokenizer).
VOCAB_SIZES = {"gpu": 32_000, "colab": 8_192, "quick": 512}


def get_config(arg: str = "gpu"):
  if arg not in SIZES:
    raise ValueError(f"configs/c4_small.py takes {', '.join(SIZES)}, not "
                     f"{arg!r}")
  config = {"gpu": _gpu, "colab": _colab, "quick": _quick}[arg]()
  config.model.vocab_size = VOCAB_SIZES[arg]
  # The outer step is the schema's default, the paper's: Nesterov, lr 0.7
  # and momentum 0.9 (without overlap; config/overlap_defaults.py).
  return config


def _gpu():
  config = c4_common.c4_config(num_layers=3, d_model=896, num_heads=16,
                               head_dim=64, mlp_dim=2432)
  config.total_steps = 8_800
  config.pretrain_steps = 2_400  # the paper's 24k of 88k
  config.diloco.inner_steps = 100  # 64 rounds after the pretraining
  config.inner_optimizer.warmup_steps = 100
  config.data.batch_size = 64
  # 8 islands folded on one GPU hold 8 microbatches of 8 x 1024 at once,
  # the shape measured on an H100 for the 150M model (docs/benchmarks.md).
  config.data.microbatches = 8
  # 1M held-out tokens, in batches that keep the 32,000-wide logits small.
  config.eval.batch_size = 16
  config.eval.num_batches = 64
  config.eval.every_rounds = 4
  # A save is ~6 GB (8 islands' params and AdamW states): every 8 rounds.
  config.checkpoint.every_rounds = 8
  config.checkpoint.max_to_keep = 2
  return config


def _colab():
  config = c4_common.c4_config(num_layers=4, d_model=256, num_heads=4,
                               head_dim=64, mlp_dim=768)
  config.total_steps = 1_100
  config.pretrain_steps = 300
  config.diloco.islands = 4
  config.diloco.inner_steps = 50  # 16 rounds after the pretraining
  config.inner_optimizer.learning_rate = 1e-3
  config.inner_optimizer.warmup_steps = 50
  # float32: a T4 (Colab's free GPU) has no bfloat16 units; on an A100,
  # L4 or TPU pass --config.model.dtype=bfloat16.
  config.model.dtype = "float32"
  config.model.max_sequence_length = 256
  config.data.sequence_length = 256
  config.data.batch_size = 16
  config.eval.batch_size = 32
  config.eval.num_batches = 8
  config.eval.every_rounds = 2
  config.checkpoint.every_rounds = 4
  config.checkpoint.max_to_keep = 1
  config.log_every_seconds = 10.0
  return config


def _quick():
  config = tiny.get_config()
  config.total_steps = 8
  config.pretrain_steps = 2
  config.diloco.inner_steps = 2
  config.data.corpus = "c4"
  config.data.tokenizer = "sentencepiece"
  config.data.path = ""
  config.data.tokenizer_path = ""
  return config
