"""A seconds-long run for tests and smoke checks: 2 islands, a tiny model."""

from diloco_jax.config import schema as config_schema


def get_config():
  config = config_schema.base_config()
  config.total_steps = 8
  config.diloco.islands = 2
  config.diloco.inner_steps = 4
  config.inner_optimizer.warmup_steps = 2
  config.model.num_layers = 1
  config.model.d_model = 32
  config.model.num_heads = 2
  config.model.head_dim = 16
  config.model.mlp_dim = 64
  config.model.max_sequence_length = 32
  config.data.corpus = "synthetic"
  config.data.sequence_length = 32
  config.data.batch_size = 4
  config.data.synthetic.vocab_size = 32
  config.data.synthetic.num_documents = 256
  config.data.synthetic.document_length = 64
  config.data.synthetic.validation_documents = 32
  config.model.vocab_size = config.data.synthetic.vocab_size + 1
  config.eval.batch_size = 8
  config.eval.num_batches = 2
  config.log_every_seconds = 1.0
  return config
