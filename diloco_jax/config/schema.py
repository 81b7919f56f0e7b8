"""The full set of config fields, with their defaults and what they mean.

Every file under configs/ starts from `base_config()` and overrides what it
needs, so a field exists in every config and `--config.x.y=...` overrides work
everywhere. Field names here are the project's vocabulary (`config.mode`,
`config.diloco.islands`, `config.diloco.inner_steps`, `config.total_steps`).
Each section is built by its own function below; validation.py checks them.
"""

import ml_collections

from diloco_jax.config import schema_diloco

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
      "diloco": schema_diloco.diloco(),
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
      # process is restarted up to max_restarts times. A late island's
      # result is applied if it arrives within stale_rounds rounds (its
      # pseudo-gradient against the x it started from, its weight divided
      # by 1 + its staleness), else dropped (0: always dropped).
      # round_budget 'steps': every island takes H inner steps a round;
      # 'time': a round lasts the fastest island's H steps and each island
      # takes as many as fit, weighted by the tokens it trained
      # (elastic/speeds.py).
      "elastic": Section({
          "min_islands": 0,
          "grace_seconds": 0.0,
          "max_restarts": 3,
          "stale_rounds": 0,
          "round_budget": "steps",
          # True: no island waits for a round. The coordinator applies each
          # result as it arrives (its pseudo-gradient times its share of a
          # round's tokens, down-weighted when overtaken) and the island
          # goes on at once from the x it made; a round is a window of as
          # many results as members (elastic/arrivals.py).
          "asynchronous": False,
          # True: island i runs only on a Ray node started with
          # --resources='{"diloco_island_i": 1}' (docs/elastic.md).
          "pin_islands": False,
          # > 0 (as root): each island its own Ray node in a network
          # namespace of its own on this machine, its link to the
          # coordinator shaped to link_mbit Mbit/s each way (tc tbf) with
          # link_delay_ms of delay each way (tc netem, where the kernel has
          # it): the run as it would go over such a link
          # (elastic/island_nodes.py, docs/elastic.md).
          "link_mbit": 0.0,
          "link_delay_ms": 0.0,
          # Under the one-step delay (config.diloco.overlap=
          # 'one_step_delay'), send each round's calls while the round
          # before it runs, so the islands train on while the mean is on
          # its way (False: each round waits for the last to close).
          "overlap_rounds": True,
      }),
      # For tests: 'ISLAND@ROUND' sets that island's params to NaN at the
      # start of that (1-based) round, to exercise the exclusion of diverged
      # islands. Elastic islands: kill_island ('ISLAND@ROUND', or several
      # comma-separated) has that island's process SIGKILL itself once at a
      # step of that round drawn from the seed ('ISLAND@ROUND:after': right
      # after its result of that round reached the coordinator, on the
      # coordinator's host); slow_island (the same form)
      # has it sleep slow_seconds before that round's first step;
      # island_speeds ('1,1,0.5,0.25': one per island, each in (0, 1])
      # makes each island's every inner step take 1/speed as long.
      "testing": Section({"nan_island": "", "kill_island": "",
                          "slow_island": "", "slow_seconds": 10.0,
                          "island_speeds": ""}),
      "log_every_seconds": 5.0,
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
      # c4 shards with none named '*validation*': hold out
      # validation_fraction of the train shards (by a hash of their names,
      # at least one) to evaluate on. False: such shards are refused, since
      # islands would silently get fewer shards than were given.
      "hold_out_shards": False,
      "seed": 0,
      # A streamed or prepared corpus that gives no batch for this long
      # (a stalled file system, a FIFO) ends the run in one line naming
      # the files it reads; a stop signal ends the wait at once.
      "read_timeout_s": 300.0,
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
