"""The base of the studies in experiments/: the DiLoCo paper's protocol at a
size where a point x seed takes about a minute on 2 CPU cores.

  python -m diloco_jax.main --config=configs/study.py --workdir=DIR
  python -m diloco_jax.main --config=configs/study.py:quick --workdir=DIR

As in the paper, every run starts from one model pretrained as a single
worker (here 100 of the 400 steps; the paper: 24k of 88k), then DiLoCo runs
4 islands with H=25 (12 rounds) and the outer Nesterov optimizer at the
overlap mode's defaults (lr 0.7, momentum 0.9 without overlap;
config/overlap_defaults.py). The model is a 2-layer byte-level transformer on the embedded
corpus. `quick` is a seconds-long version on the synthetic corpus that
the tests run.
"""

from configs import tiny
from diloco_jax.config import schema as config_schema


def get_config(arg: str = ""):
  if arg not in ("", "quick"):
    raise ValueError(f"configs/study.py takes '' or 'quick', not {arg!r}")
  if arg == "quick":
    # The tests' tiny model and synthetic corpus, with the same protocol.
    config = tiny.get_config()
    config.pretrain_steps = 2
    config.diloco.inner_steps = 2
  else:
    config = _full_size()
  # Every run saves at its end; a killed study resumes from round ends.
  config.checkpoint.every_rounds = 4
  config.checkpoint.max_to_keep = 1
  return config


def _full_size():
  config = config_schema.base_config()
  config.mode = "diloco"
  config.total_steps = 400
  config.pretrain_steps = 100
  config.diloco.islands = 4
  config.diloco.inner_steps = 25
  config.diloco.outer_optimizer.name = "nesterov"

  config.inner_optimizer.learning_rate = 3e-3
  config.inner_optimizer.warmup_steps = 20
  config.inner_optimizer.weight_decay = 0.1

  config.model.num_layers = 2
  config.model.d_model = 96
  config.model.num_heads = 4
  config.model.head_dim = 24
  config.model.mlp_dim = 384
  config.model.max_sequence_length = 64

  config.data.corpus = "embedded"
  config.data.sequence_length = 64
  config.data.batch_size = 16
  config.eval.batch_size = 64
  config.eval.num_batches = 4
  config.log_every_seconds = 30.0
  return config
