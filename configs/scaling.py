"""The compute-optimal study regime: the papers' budget at two CPU scales.

  python -m diloco_jax.main --config=configs/scaling.py:small --workdir=DIR
  python -m diloco_jax.main --config=configs/scaling.py:large --workdir=DIR

Every run trains from scratch on ~20 tokens per parameter (the
compute-optimal budget of the DiLoCo scaling-laws study), here counted on
all parameters, as 4 islands with H=10 and the outer step that won on
this regime (lr 1, momentum 0: plain averaging): over 50 outer rounds at
both scales. The scales (byte-level models on the embedded
corpus; time a run, docs/results.md#the-compute-optimal-regime):

  small  0.15M params,  3.0M tokens,  73 rounds, ~2 min on 2 CPU cores
  large  0.82M params, 16.4M tokens, 401 rounds, ~30 min on 2 CPU cores
         (estimated), 25-240 s on one H100
  gpu    43M params,   0.85B tokens (for a GPU; not run on CPU)
  quick  the tests' tiny model, seconds

`steps_for(config, workers)` gives the steps that spend a config's tokens
with another number of workers (the single-worker baseline takes 4x the
steps of 4 islands); the experiments/scaling_*.py studies use it.
"""

import math

from configs import tiny
from diloco_jax.config import schema as config_schema

TOKENS_PER_PARAM = 20
ISLANDS = 4
INNER_STEPS = 10
# (layers, d_model, heads, mlp) per scale.
_MODELS = {
    "small": (2, 64, 4, 256),
    "large": (3, 128, 4, 512),
    "gpu": (8, 576, 9, 2304),
}


def get_config(arg: str = "small"):
  if arg not in (*_MODELS, "quick"):
    raise ValueError("configs/scaling.py takes small, large, gpu or quick, "
                     f"not {arg!r}")
  if arg == "quick":
    config = tiny.get_config()
    config.diloco.inner_steps = 2
    config.total_steps = 8
  else:
    config = _regime(*_MODELS[arg])
  config.pretrain_steps = 0  # from scratch, as the scaling-laws study
  config.diloco.islands = ISLANDS
  # The measured winner at 4 islands (experiments/scaling_outer.py, small
  # scale): plain averaging. Nesterov's momentum 0.9 costs +43% perplexity
  # here, and less momentum is better all the way to none: at H=10 from
  # scratch, successive pseudo-gradients agree and momentum overshoots.
  config.diloco.outer_optimizer.name = "nesterov"
  config.diloco.outer_optimizer.learning_rate = 1.0
  config.diloco.outer_optimizer.momentum = 0.0
  # Every run saves every few rounds; a killed study resumes from there.
  config.checkpoint.every_rounds = 10
  config.checkpoint.max_to_keep = 1
  if arg != "quick":
    config.total_steps = token_steps(config, ISLANDS)
    rounds = config.total_steps // config.diloco.inner_steps
    config.eval.every_rounds = max(1, rounds // 12)
    config.inner_optimizer.warmup_steps = max(10, config.total_steps // 50)
  return config


def parameters(model_config) -> int:
  """Every parameter of the model (embeddings and norms included)."""
  d, layers, mlp = (model_config.d_model, model_config.num_layers,
                    model_config.mlp_dim)
  inner = model_config.num_heads * model_config.head_dim
  block = 4 * d * inner + 3 * d * mlp + 2 * d
  head = 0 if model_config.tie_embeddings else d * model_config.vocab_size
  return layers * block + model_config.vocab_size * d + d + head


def token_steps(config, workers: int) -> int:
  """Steps per worker that spend TOKENS_PER_PARAM tokens per parameter
  when `workers` workers each take config.data.batch_size sequences a
  step, rounded up to whole rounds of config.diloco.inner_steps."""
  tokens = TOKENS_PER_PARAM * parameters(config.model)
  per_step = workers * config.data.batch_size * config.data.sequence_length
  rounds = math.ceil(tokens / per_step / config.diloco.inner_steps)
  return rounds * config.diloco.inner_steps


def steps_for(config, workers: int) -> int:
  """Steps per worker that spend the tokens `config`'s islands do when
  `workers` workers each take config.data.batch_size sequences a step (in
  whole rounds)."""
  h = config.diloco.inner_steps
  tokens = config.total_steps * config.diloco.islands
  return -(-tokens // (workers * h)) * h


def _regime(layers: int, d_model: int, heads: int, mlp: int):
  config = config_schema.base_config()
  config.mode = "diloco"
  config.diloco.inner_steps = INNER_STEPS

  config.inner_optimizer.learning_rate = 3e-3
  config.inner_optimizer.weight_decay = 0.1

  config.model.num_layers = layers
  config.model.d_model = d_model
  config.model.num_heads = heads
  config.model.head_dim = d_model // heads
  config.model.mlp_dim = mlp
  config.model.max_sequence_length = 64

  config.data.corpus = "embedded"
  config.data.sequence_length = 64
  config.data.batch_size = 16
  config.eval.batch_size = 64
  config.eval.num_batches = 4
  config.log_every_seconds = 30.0
  return config
