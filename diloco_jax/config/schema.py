"""The full set of config fields, with their defaults and what they mean.

Every file under configs/ starts from `base_config()` and overrides what it
needs, so a field exists in every config and `--config.x.y=...` overrides work
everywhere. Field names here are the project's vocabulary (`config.mode`,
`config.diloco.islands`, `config.diloco.inner_steps`, `config.total_steps`).
Each section is built by its own function below; validation.py checks them.
"""

import ml_collections
from ml_collections import config_dict

MODES = ("diloco", "ddp", "single")
OUTER_OPTIMIZERS = ("nesterov", "sgd", "momentum", "adam", "sparseloco")
INNER_OPTIMIZERS = ("adamw", "muon")
INNER_STATES = ("keep", "reset")
Section = ml_collections.ConfigDict


def base_config() -> ml_collections.ConfigDict:
  """Returns a complete config with defaults for a small CPU run."""
  return ml_collections.ConfigDict({
      "mode": "diloco",  # 'diloco' | 'ddp' | 'single'
      "seed": 0,
      # Inner steps per island (optimizer steps for ddp/single).
      "total_steps": 200,
      # The DiLoCo paper's protocol: the first pretrain_steps steps (counted
      # in total_steps) train one worker with the per-island batch, in
      # workdir/pretrain; then the configured mode starts every island and
      # the global params from that model (its inner optimizer state too).
      "pretrain_steps": 0,
      # Start from another run's checkpoint: its workdir (newest checkpoint)
      # or WORKDIR/checkpoints/STEP. Its model becomes x and every island's
      # params; its inner optimizer state is carried where shapes match; the
      # run goes on from that step to total_steps. Only for a first start.
      "init_from": "",
      "diloco": _diloco(),
      "inner_optimizer": _inner_optimizer(),
      "mesh": _mesh(),
      "pipeline": _pipeline(),
      "model": _model(),
      "data": _data(),
      "eval": _eval(),
      "network": _network(),
      "checkpoint": _checkpoint(),
      # Resuming under a config that changes the run's meaning (schedule,
      # optimizers, codec, data, mode, seed, model, eval) is refused unless
      # the changed fields are named here, comma-separated (e.g.
      # 'total_steps,diloco.codec'; a section name allows all its fields).
      "resume": Section({
          "allow_changes": "",
          # When checkpoints exist but none reads back, the run stops and
          # lists them; True sets them aside (checkpoints.unreadable/) and
          # trains from step 0, as summary.json then records.
          "from_scratch_if_unreadable": False,
      }),
      # A NaN or inf loss, gradient norm or eval loss: 'stop' with an error
      # naming the step and island, or 'rollback' to the last good
      # checkpoint, skipping the batches taken since (at most max_rollbacks
      # times per run). In DiLoCo an island whose loss or gradient turns
      # non-finite is left out of its round's outer step and restarts from x
      # (fresh inner optimizer state); the policy applies when every island
      # diverges, or x does.
      "nonfinite": "stop",
      "max_rollbacks": 3,
      # Elastic islands (python -m diloco_jax.elastic): each island its own
      # program under Ray. A round closes once min_islands (0: all) have
      # sent their params and grace_seconds more have passed; an island
      # that died or is later still is left out of it. A dead island's
      # process is restarted up to max_restarts times.
      "elastic": Section({
          "min_islands": 0,
          "grace_seconds": 0.0,
          "max_restarts": 3,
      }),
      # For tests: 'ISLAND@ROUND' sets that island's params to NaN at the
      # start of that (1-based) round, to exercise the exclusion of diverged
      # islands. Elastic islands: kill_island ('ISLAND@ROUND', or several
      # comma-separated) has that island's process SIGKILL itself once at a
      # step of that round drawn from the seed; slow_island has it sleep
      # slow_seconds before that round's first step (a straggler).
      "testing": Section({"nan_island": "", "kill_island": "",
                          "slow_island": "", "slow_seconds": 10.0}),
      "log_every_seconds": 5.0,
  })


def _diloco() -> Section:
  """config.diloco: the islands, their rounds and how they synchronize."""
  return Section({
      "islands": 4,  # k; ddp uses them as data-parallel workers
      "inner_steps": 50,  # H
      # How pseudo-gradients cross the island link (algorithm/compression.py).
      # Dense: 'fp32' | 'bf16' | 'fp16' | 'int8' | 'int4' | 'fp4' (e2m1
      # 4-bit floats; blockwise codecs use one scale per block, an even
      # block_size). Per matrix: 'sign_prune' | 'topk' | 'lowrank' |
      # 'adaptive_lowrank', with vectors and small tensors sent by
      # fallback_codec.
      "codec": "fp32",
      "codec_block_size": 256,
      # Which islands take part in each round (algorithm/participation.py):
      # a schedule of active islands, 'A->B' (a linear ramp) or 'A<->B'
      # (alternating), e.g. '1->8'; each sync dropped with drop_probability;
      # an inactive island 'train's on and is not synced, or sits 'idle' and
      # rejoins from x with a fresh inner optimizer state.
      "island_schedule": "",
      "drop_probability": 0.0,
      "dropped_islands": "train",
      # 'none': islands wait for each round's collective; 'one_step_delay'
      # (DiLoCoX): round r's mean is applied at the end of round r + 1, so
      # its collective overlaps a round of local training, and round r + 1
      # starts from x_r; 'one_step_delay_rebase': the same timing, but each
      # island starts round r + 1 from x_r plus its own progress of round r
      # (whose mean is in flight), rebased again when the mean lands;
      # 'eager' (eager updates): the same timing, but each island steps its
      # own outer point at once on its whole fresh pseudo-gradient, which
      # the mean replaces when it lands; 'eager_share': the paper's rule,
      # on its share of the mean only, the others' part a round late
      # (algorithm/overlap.py). Each mode has its own outer-optimizer
      # defaults (config/overlap_defaults.py).
      "overlap": "none",
      # 'eager' only: the weight c an island gives its own fresh
      # pseudo-gradient d_m while the mean is in flight, in (0, 1]; unset:
      # 1, its whole round at once.
      "eager_own_weight": config_dict.placeholder(float),
      # 'eager' and 'eager_share' only: the run's first rounds wait for their
      # own mean as without overlap, and eager updates begin after them.
      # Unset: 2 under 'eager', 0 under 'eager_share' (overlap_defaults.py).
      "overlap_warmup_rounds": config_dict.placeholder(int),
      # Where x, the outer optimizer state and the cross-island collective
      # live (run/host_outer.py): 'device' with the islands; 'host' on one
      # other device per process (the host's CPU beside accelerators; a CPU
      # device set aside on CPU-only hosts), so the collective can run
      # beside the compute.
      "outer_placement": "device",
      # Streaming DiLoCo (algorithm/fragments.py): the params in `fragments`
      # groups of consecutive blocks, fragment p synced every inner_steps
      # steps at offset p * inner_steps / fragments; each sync's mean is
      # folded into the islands `fragment_delay` steps later (its collective
      # overlaps them) as fragment_alpha * local + (1 - fragment_alpha) *
      # global. 1, 0, 0 is plain DiLoCo.
      "fragments": 1,
      "fragment_delay": 0,
      "fragment_alpha": 0.0,
      "stochastic_rounding": False,  # unbiased rounding in int8/int4/fp4
      # Keep what the codec did not send, per island, and add it next round.
      "error_feedback": False,
      "fallback_codec": "int4",  # a dense codec
      "prune_rate": 0.5,  # sign_prune: fraction of each neuron dropped
      "topk_fraction": 0.01,  # topk: fraction of each matrix kept
      "lowrank": _lowrank(),
      "outer_optimizer": _outer_optimizer(),
      "sparseloco": _sparseloco(),
      # The islands' inner optimizer state across rounds: 'keep' (each
      # island carries its moments on from x) or 'reset' (fresh moments
      # every round, counted from the current step so the learning rate
      # schedule goes on).
      "inner_state": "keep",
  })


def _lowrank() -> Section:
  """config.diloco.lowrank: the low-rank codecs' ranks."""
  return Section({
      "rank": 4,  # lowrank (float32 factors)
      # adaptive_lowrank: per matrix and round, the smallest rank of the
      # ladder min_rank, 2 min_rank, ..., max_rank keeping
      # energy_fraction of the energy; factors sent through factor_codec
      # (a dense codec). The defaults are the best measured on
      # configs/default.py (docs/results.md).
      "min_rank": 16,
      "max_rank": 64,
      "energy_fraction": 0.9,
      "factor_codec": "int4",
  })


def _sparseloco() -> Section:
  """config.diloco.sparseloco: the outer mode of
  outer_optimizer.name='sparseloco' (algorithm/sparse_chunks_mean.py).

  Per island, error feedback is the only momentum: e <- beta e + d;
  s = Q(TopK(e)) chunk by chunk; e <- e - s; then x <- x - alpha mean(s).
  The codec is its own (config.diloco.codec stays 'fp32'); the outer
  optimizer's learning_rate and momentum are not used.
  """
  return Section({
      "beta": 0.95,  # the residual's decay: the momentum
      "alpha": 1.0,  # the outer learning rate
      "density": 0.02,  # fraction of each chunk kept
      "chunk_size": 4096,  # values per top-k chunk (a leaf's chunks split
                           # it evenly; smaller leaves are one chunk)
      "bits": 2,  # bits per kept value: sign + (bits - 1) of magnitude
  })


def _outer_optimizer() -> Section:
  """config.diloco.outer_optimizer: the step on x once per round."""
  return Section({
      "name": "nesterov",  # see OUTER_OPTIMIZERS
      # Unset (None): the overlap mode's default, filled in by validation
      # (config/overlap_defaults.py); a config file's choice holds for its
      # own overlap mode (config/outer_choice.py).
      "learning_rate": config_dict.placeholder(float),
      "momentum": config_dict.placeholder(float),  # nesterov / momentum
      "b1": 0.9,  # adam
      "b2": 0.999,  # adam
      # DiLoCo found outer Adam unstable unless eps is large (~0.1).
      "eps": 0.1,  # adam
  })


def _inner_optimizer() -> Section:
  """config.inner_optimizer: what each island runs for H steps."""
  return Section({
      # 'adamw', or 'muon' (MuLoCo): Muon on the blocks' matrices, AdamW
      # with the fields below on the embeddings, head and norms.
      "name": "adamw",
      "learning_rate": 4e-4,  # peak
      "warmup_steps": 20,
      "final_learning_rate_fraction": 0.1,  # cosine floor
      # Steps the warmup + cosine schedule spans (0: total_steps).
      "schedule_steps": 0,
      "weight_decay": 0.1,
      "b1": 0.9,
      "b2": 0.95,
      "eps": 1e-8,
      "grad_clip_norm": 1.0,  # 0 disables clipping
      # name='muon': Muon's momentum and Newton-Schulz steps; its updates
      # are scaled to AdamW's RMS (consistent_rms, Moonlight's 0.2), so it
      # runs on the learning rate schedule above.
      "muon": Section({
          "momentum": 0.95,
          "ns_steps": 5,
          "consistent_rms": 0.2,
      }),
  })


def _mesh() -> Section:
  """config.mesh: the axes inside an island.

  The 'island' axis needs no field: islands fold onto the devices there are
  (k / d per device slot, d the largest divisor of k that fits).
  """
  return Section({
      "data": 1,
      # Pipeline stages per island (config.pipeline): stage s holds a block
      # of consecutive layers and its optimizer states, inner and outer
      # (DiLoCoX's dual optimizer), so per-device memory falls ~1/stage.
      "stage": 1,
      # Shard params, gradients and inner optimizer states over the island's
      # 'data' devices (FSDP) instead of replicating them.
      "fsdp": False,
  })


def _pipeline() -> Section:
  """config.pipeline: how microbatches flow through an island's stages
  (parallel/pipeline.py; used when config.mesh.stage > 1)."""
  return Section({
      # Microbatches per inner step (per gradient-accumulation part): a
      # multiple of mesh.stage; 0: the largest count up to 2 x mesh.stage
      # that divides the batch (2 x stage, else stage). More shrink the
      # bubble (stage - 1) / (repeats x microbatches + stage - 1).
      "microbatches": 0,
      # 'gpipe': every forward, then every backward; 'circular': each
      # stage holds `repeats` chunks of layers and a microbatch goes round
      # the stages `repeats` times, dividing the bubble by about repeats.
      "schedule": "gpipe",
      "repeats": 1,  # circular: >= 2 (gpipe: 1)
  })


def _model() -> Section:
  """config.model: the decoder-only transformer (model/transformer.py)."""
  return Section({
      "vocab_size": 257,  # byte-level: 256 bytes + EOS
      "num_layers": 2,
      "d_model": 64,
      "num_heads": 4,
      "head_dim": 16,
      "mlp_dim": 256,
      "max_sequence_length": 128,
      "tie_embeddings": True,
      "dtype": "float32",
      "param_dtype": "float32",
      "rope_base": 10000.0,
      # jax.nn.dot_product_attention implementation: 'auto' (cuDNN flash
      # attention on NVIDIA GPUs for bf16, XLA elsewhere) | 'xla' | 'cudnn'.
      "attention": "auto",
      # Recompute each block's activations in the backward pass (less
      # memory, about a third more compute).
      "remat": False,
  })


def _data() -> Section:
  """config.data: the corpus, its tokens and each island's batches."""
  return Section({
      "corpus": "embedded",  # embedded|synthetic|text_files|c4|tokens
      # text_files: files/glob; c4: JSONL dir/glob, TFDS data_dir; tokens: dir
      "path": "",
      # Corpus 'c4' through TFDS, e.g. 'c4/en' (path = data_dir).
      "tfds_name": "",
      "tokenizer": "byte",  # 'byte' | 'sentencepiece'
      # SentencePiece .model (e.g. the T5 C4 vocabulary).
      "tokenizer_path": "",
      # 'iid' | 'clustered' | 'clustered_balanced': islands get distinct
      # k-means clusters of documents; balanced moves the clusters'
      # boundaries so each holds about 1 / islands of the tokens (plain
      # k-means on text tends to put most of a corpus in one cluster).
      "island_split": "iid",
      "sequence_length": 128,
      # Per island (per worker); ddp's global batch = islands x this.
      "batch_size": 16,
      # Gradient accumulation: each inner step runs the island's batch in
      # this many sequential parts (same update, less activation memory).
      "microbatches": 1,
      "validation_fraction": 0.05,
      "seed": 0,
      "synthetic": Section({
          "vocab_size": 64,
          "concentration": 0.1,
          "num_documents": 2048,
          "document_length": 256,
          "validation_documents": 128,
      }),
  })


def _eval() -> Section:
  """config.eval: the held-out set and when it is scored.

  ddp and single have no rounds; they evaluate every diloco.inner_steps
  steps so their curves line up with DiLoCo's rounds.
  """
  return Section({
      "batch_size": 16,
      "num_batches": 4,
      # DiLoCo: also score the islands' plain average at each round's end
      # (eval_loss_island_mean). Averaging is one fp32 all-reduce of the
      # params over the island link per round, beyond what the algorithm
      # sends, so it is off unless asked for.
      "island_mean": False,
      # Evaluate at the end of every N-th round and at the last step; 0: at
      # the last step only. Each evaluation waits for the devices it runs on
      # (and, for Streaming DiLoCo with outer_placement='host', for the
      # fragments in flight), so overlap benchmarks evaluate rarely.
      "every_rounds": 1,
  })


def _network() -> Section:
  """config.network: the slow link a run is reported against
  (analysis/network_model.py).

  summary.json gives the modeled round time, compute utilization and
  wall-clock of the run's schedule over it, at the step time the run
  measured, and the bandwidth 90% and 95% utilization would need. Reporting
  only.
  """
  return Section({
      "bandwidth_bits_per_s": 1e9, "latency_s": 0.01,
      # Pipelined islands (mesh.stage > 1): each stage's devices have a
      # link of the bandwidth above of their own (DiLoCoX's nodes), rather
      # than the island's stages sharing one.
      "link_per_stage": False,
  })


def _checkpoint() -> Section:
  """config.checkpoint: saves under workdir/checkpoints; rerunning the same
  command resumes."""
  return Section({
      "every_rounds": 1,  # save at the end of every N-th round (0: off)
      "every_steps": 0,  # also save every N inner steps (0: off)
      "max_to_keep": 3,
      "async_save": True,
  })


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
