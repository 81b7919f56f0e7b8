"""Shared settings of the DiLoCo paper's C4 runs (arXiv 2311.08105).

Sequence length 1024, a 32,000-token SentencePiece vocabulary, batch 512 per
worker, inner AdamW lr 4e-4 with 1,000 warmup steps and weight decay 0.1,
outer Nesterov lr 0.7 momentum 0.9, 8 workers, H=500, 88k steps of which
the first 24k pretrain one worker (then 128 rounds). The C4 data path
(config.data.path) and a SentencePiece model (config.data.tokenizer_path)
are required; docs/c4.md gets both.
"""

from diloco_jax.config import schema as config_schema


def c4_config(num_layers: int, d_model: int, num_heads: int, head_dim: int,
              mlp_dim: int):
  """A paper-shaped C4 config for the given model dimensions."""
  config = config_schema.base_config()
  config.mode = "diloco"
  config.total_steps = 88_000
  # The paper's protocol: DiLoCo and its baselines all start from one model
  # pretrained as a single worker for 24k steps (128 rounds of H=500 follow).
  config.pretrain_steps = 24_000
  config.diloco.islands = 8
  config.diloco.inner_steps = 500

  config.inner_optimizer.learning_rate = 4e-4
  config.inner_optimizer.warmup_steps = 1_000
  config.inner_optimizer.weight_decay = 0.1

  config.model.vocab_size = 32_000
  config.model.num_layers = num_layers
  config.model.d_model = d_model
  config.model.num_heads = num_heads
  config.model.head_dim = head_dim
  config.model.mlp_dim = mlp_dim
  config.model.max_sequence_length = 1024
  config.model.tie_embeddings = True
  config.model.dtype = "bfloat16"

  config.data.corpus = "c4"
  config.data.path = ""  # --config.data.path=... (required): JSONL shards
  # or, with --config.data.tfds_name=c4/en, the TFDS data_dir (gs://... works
  # on TPU/Colab).
  config.data.tokenizer = "sentencepiece"
  config.data.tokenizer_path = ""  # --config.data.tokenizer_path=.../spm.model
  config.data.sequence_length = 1024
  config.data.batch_size = 512

  config.eval.batch_size = 64
  config.eval.num_batches = 16
  config.log_every_seconds = 30.0
  return config
