"""The full set of config fields, with their defaults and what they mean.

Every file under configs/ starts from `base_config()` and overrides what it
needs, so a field exists in every config and `--config.x.y=...` overrides work
everywhere. Field names here are the project's vocabulary (`config.mode`,
`config.diloco.islands`, `config.diloco.inner_steps`, `config.total_steps`).
"""

import ml_collections

MODES = ("diloco", "ddp", "single")
OUTER_OPTIMIZERS = ("nesterov", "sgd", "momentum", "adam")
INNER_OPTIMIZERS = ("adamw",)


def base_config() -> ml_collections.ConfigDict:
  """Returns a complete config with defaults for a small CPU run."""
  c = ml_collections.ConfigDict()
  c.mode = "diloco"  # 'diloco' | 'ddp' | 'single'
  c.seed = 0
  c.total_steps = 200  # inner steps per island (optimizer steps for ddp/single)
  # The DiLoCo paper's protocol: the first pretrain_steps steps (counted in
  # total_steps) train one worker with the per-island batch, in
  # workdir/pretrain; then the configured mode starts every island and the
  # global params from that model (its inner optimizer state too).
  c.pretrain_steps = 0
  # Start from another run's checkpoint: its workdir (newest checkpoint) or
  # WORKDIR/checkpoints/STEP. Its model becomes x and every island's params;
  # its inner optimizer state is carried where shapes match; the run goes on
  # from that step to total_steps. Only for a run's first start.
  c.init_from = ""

  c.diloco = ml_collections.ConfigDict()
  c.diloco.islands = 4  # k; ddp uses them as data-parallel workers
  c.diloco.inner_steps = 50  # H
  # How pseudo-gradients cross the island link (see compression.py). Dense:
  # 'fp32' | 'bf16' | 'fp16' | 'int8' | 'int4' | 'fp4' (e2m1 4-bit floats;
  # blockwise codecs use one scale per block, an even block_size). Per
  # matrix: 'sign_prune' | 'topk' | 'lowrank' | 'adaptive_lowrank', with
  # vectors and small tensors sent by fallback_codec.
  c.diloco.codec = "fp32"
  c.diloco.codec_block_size = 256
  # Which islands take part in each round (participation.py): a schedule of
  # active islands, 'A->B' (a linear ramp) or 'A<->B' (alternating), e.g.
  # '1->8'; each sync dropped with drop_probability; an inactive island
  # 'train's on and is not synced, or sits 'idle' and rejoins from x with a
  # fresh inner optimizer state.
  c.diloco.island_schedule = ""
  c.diloco.drop_probability = 0.0
  c.diloco.dropped_islands = "train"
  # 'none': islands wait for each round's collective; 'one_step_delay'
  # (DiLoCoX): round r's mean is applied at the end of round r + 1, so its
  # collective overlaps a round of local training, and round r + 1 starts
  # from x_r; 'one_step_delay_rebase': the same timing, but each island
  # starts round r + 1 from x_r plus its own progress of round r (whose mean
  # is in flight), rebased again when the mean lands (diloco.make_outer_step).
  c.diloco.overlap = "none"
  # Where x, the outer optimizer state and the cross-island collective live
  # (outer_placement.py): 'device' with the islands; 'host' on one other
  # device per process (the host's CPU beside accelerators; a CPU device set
  # aside on CPU-only hosts), so the collective can run beside the compute.
  c.diloco.outer_placement = "device"
  # Streaming DiLoCo (fragments.py): the params in `fragments` groups of
  # consecutive blocks, fragment p synced every inner_steps steps at offset
  # p * inner_steps / fragments; each sync's mean is folded into the islands
  # `fragment_delay` steps later (its collective overlaps them) as
  # fragment_alpha * local + (1 - fragment_alpha) * global. 1, 0, 0 is
  # plain DiLoCo.
  c.diloco.fragments = 1
  c.diloco.fragment_delay = 0
  c.diloco.fragment_alpha = 0.0
  c.diloco.stochastic_rounding = False  # unbiased rounding in int8/int4/fp4
  # Keep what the codec did not send, per island, and add it next round.
  c.diloco.error_feedback = False
  c.diloco.fallback_codec = "int4"  # a dense codec
  c.diloco.prune_rate = 0.5  # sign_prune: fraction of each neuron dropped
  c.diloco.topk_fraction = 0.01  # topk: fraction of each matrix kept
  c.diloco.lowrank = ml_collections.ConfigDict()
  c.diloco.lowrank.rank = 4  # lowrank (float32 factors)
  # adaptive_lowrank: per matrix and round, the smallest rank of the ladder
  # min_rank, 2 min_rank, ..., max_rank keeping energy_fraction of the energy;
  # factors sent through factor_codec (a dense codec).
  # The defaults are the best measured on configs/default.py (README).
  c.diloco.lowrank.min_rank = 16
  c.diloco.lowrank.max_rank = 64
  c.diloco.lowrank.energy_fraction = 0.9
  c.diloco.lowrank.factor_codec = "int4"
  c.diloco.outer_optimizer = ml_collections.ConfigDict()
  c.diloco.outer_optimizer.name = "nesterov"  # see OUTER_OPTIMIZERS
  c.diloco.outer_optimizer.learning_rate = 0.7
  c.diloco.outer_optimizer.momentum = 0.9  # nesterov / momentum
  c.diloco.outer_optimizer.b1 = 0.9  # adam
  c.diloco.outer_optimizer.b2 = 0.999  # adam
  # DiLoCo found outer Adam unstable unless eps is large (~0.1).
  c.diloco.outer_optimizer.eps = 0.1  # adam

  c.inner_optimizer = ml_collections.ConfigDict()
  c.inner_optimizer.name = "adamw"
  c.inner_optimizer.learning_rate = 4e-4  # peak
  c.inner_optimizer.warmup_steps = 20
  c.inner_optimizer.final_learning_rate_fraction = 0.1  # cosine floor
  # Steps the warmup + cosine schedule spans (0: total_steps).
  c.inner_optimizer.schedule_steps = 0
  c.inner_optimizer.weight_decay = 0.1
  c.inner_optimizer.b1 = 0.9
  c.inner_optimizer.b2 = 0.95
  c.inner_optimizer.eps = 1e-8
  c.inner_optimizer.grad_clip_norm = 1.0  # 0 disables clipping

  # Mesh axes inside an island; the 'island' axis size is diloco.islands.
  # Islands need no field: they fold onto the devices there are (k / d per
  # device slot, d the largest divisor of k that fits).
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1
  c.mesh.stage = 1
  # Shard params, gradients and inner optimizer states over the island's
  # 'data' devices (FSDP) instead of replicating them.
  c.mesh.fsdp = False

  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 257  # byte-level: 256 bytes + EOS
  c.model.num_layers = 2
  c.model.d_model = 64
  c.model.num_heads = 4
  c.model.head_dim = 16
  c.model.mlp_dim = 256
  c.model.max_sequence_length = 128
  c.model.tie_embeddings = True
  c.model.dtype = "float32"
  c.model.param_dtype = "float32"
  c.model.rope_base = 10000.0
  # jax.nn.dot_product_attention implementation: 'auto' (cuDNN flash
  # attention on NVIDIA GPUs for bf16, XLA elsewhere) | 'xla' | 'cudnn'.
  c.model.attention = "auto"
  # Recompute each block's activations in the backward pass (less memory,
  # about a third more compute).
  c.model.remat = False

  c.data = ml_collections.ConfigDict()
  c.data.corpus = "embedded"  # 'embedded' | 'synthetic' | 'text_files' | 'c4'
  c.data.path = ""  # files/glob for text_files; C4 JSONL dir/glob or TFDS data_dir
  c.data.tfds_name = ""  # corpus 'c4' through TFDS, e.g. 'c4/en' (path = data_dir)
  c.data.tokenizer = "byte"  # 'byte' | 'sentencepiece'
  c.data.tokenizer_path = ""  # SentencePiece .model (e.g. the T5 C4 vocabulary)
  # 'iid' | 'clustered' | 'clustered_balanced': islands get distinct k-means
  # clusters of documents; balanced moves the clusters' boundaries so each
  # holds about 1 / islands of the tokens (plain k-means on text tends to
  # put most of a corpus in one cluster).
  c.data.island_split = "iid"
  c.data.sequence_length = 128
  c.data.batch_size = 16  # per island (per worker); ddp global = islands x this
  # Gradient accumulation: each inner step runs the island's batch in this
  # many sequential parts (same update, less activation memory).
  c.data.microbatches = 1
  c.data.validation_fraction = 0.05
  c.data.seed = 0
  c.data.synthetic = ml_collections.ConfigDict()
  c.data.synthetic.vocab_size = 64
  c.data.synthetic.concentration = 0.1
  c.data.synthetic.num_documents = 2048
  c.data.synthetic.document_length = 256
  c.data.synthetic.validation_documents = 128

  c.eval = ml_collections.ConfigDict()
  c.eval.batch_size = 16
  c.eval.num_batches = 4
  # DiLoCo: also score the islands' plain average at each round's end
  # (eval_loss_island_mean). Averaging is one fp32 all-reduce of the params
  # over the island link per round, beyond what the algorithm sends, so it
  # is off unless asked for.
  c.eval.island_mean = False
  # Evaluate at the end of every N-th round and at the last step; 0: at the
  # last step only. Each evaluation waits for the devices it runs on (and,
  # for Streaming DiLoCo with outer_placement='host', for the fragments in
  # flight), so overlap benchmarks evaluate rarely.
  c.eval.every_rounds = 1
  # ddp/single have no rounds; they evaluate every diloco.inner_steps steps so
  # their curves line up with DiLoCo's rounds.

  # The slow link a run is reported against (network_model.py): summary.json
  # gives the modeled round time, compute utilization and wall-clock of the
  # run's schedule over it, at the step time the run measured, and the
  # bandwidth 90% and 95% utilization would need. Reporting only.
  c.network = ml_collections.ConfigDict()
  c.network.bandwidth_bits_per_s = 1e9
  c.network.latency_s = 0.01

  # Checkpoints go to workdir/checkpoints; rerunning the same command resumes.
  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_rounds = 1  # save at the end of every N-th round (0: off)
  c.checkpoint.every_steps = 0  # also save every N inner steps (0: off)
  c.checkpoint.max_to_keep = 3
  c.checkpoint.async_save = True

  # Resuming under a config that changes the run's meaning (schedule,
  # optimizers, codec, data, mode, seed, model, eval) is refused unless the
  # changed fields are named here, comma-separated (e.g.
  # 'total_steps,diloco.codec'; a section name allows all its fields).
  c.resume = ml_collections.ConfigDict()
  c.resume.allow_changes = ""

  # A NaN or inf loss, gradient norm or eval loss: 'stop' with an error
  # naming the step and island, or 'rollback' to the last good checkpoint,
  # skipping the batches taken since (at most max_rollbacks times per run).
  # In DiLoCo an island whose loss or gradient turns non-finite is left out
  # of its round's outer step and restarts from x (fresh inner optimizer
  # state); the policy applies when every island diverges, or x does.
  c.nonfinite = "stop"
  c.max_rollbacks = 3

  # For tests: 'ISLAND@ROUND' sets that island's params to NaN at the start
  # of that (1-based) round, to exercise the exclusion of diverged islands.
  c.testing = ml_collections.ConfigDict()
  c.testing.nan_island = ""

  c.log_every_seconds = 5.0
  return c


def override(config: ml_collections.ConfigDict,
             overrides: dict) -> ml_collections.ConfigDict:
  """Sets `config`'s dotted fields, e.g. {'diloco.islands': 4}; returns it."""
  for dotted, value in overrides.items():
    node = config
    *parents, leaf = dotted.split(".")
    for part in parents:
      node = node[part]
    node[leaf] = value
  return config


def from_record(record: dict) -> ml_collections.ConfigDict:
  """The config a saved record describes (a checkpoint's, config.json).

  Starts from base_config(), so fields newer than the record keep their
  defaults; fields the schema no longer has are ignored.
  """
  config = base_config()

  def merge(node, values):
    for key, value in values.items():
      if key not in node:
        continue
      if isinstance(value, dict):
        merge(node[key], value)
      else:
        node[key] = type(node[key])(value) if isinstance(
            node[key], float) and isinstance(value, int) else value

  merge(config, record)
  return config
