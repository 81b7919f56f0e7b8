"""config.diloco: the islands, their rounds and how they synchronize (the
codec, its structured codecs' settings, the overlap, the outer optimizer).
schema.base_config() puts it in every config."""

import ml_collections
from ml_collections import config_dict

Section = ml_collections.ConfigDict


def diloco() -> Section:
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
      # live (compiled/host_outer.py): 'device' with the islands; 'host' on one
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
      "name": "nesterov",  # see schema.OUTER_OPTIMIZERS
      # Unset (None): the overlap mode's default, filled in by validation
      # (config/overlap_defaults.py). A value set is used under every
      # overlap mode, whether a config file or a flag set it.
      "learning_rate": config_dict.placeholder(float),
      "momentum": config_dict.placeholder(float),  # nesterov / momentum
      "b1": 0.9,  # adam
      "b2": 0.999,  # adam
      # DiLoCo found outer Adam unstable unless eps is large (~0.1).
      "eps": 0.1,  # adam
  })
