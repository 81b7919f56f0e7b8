"""Analytic FLOP counts for the transformer, and devices' peak FLOP rates.

Used to report model FLOP utilization (MFU) and to extrapolate round times
to sizes we cannot run. Counts matmuls only (norms, softmax, RoPE and the
embedding gather are negligible at these sizes), as in Kaplan et al. and
Chinchilla.
"""
import ml_collections

# Dense (no sparsity) bf16/fp16 matmul peak per JAX device, in TFLOP/s, from
# the vendors' datasheets; matched in order against the lowercased
# device_kind, so more specific names come first. TPU v2/v3 devices are
# single cores (half a chip); v4 and later devices are whole chips.
_BF16_PEAK_TFLOPS = (
    ("h100 pcie", 756.0), ("h100", 989.4), ("h200", 989.4), ("h800", 989.4),
    ("b200", 2250.0), ("a100", 312.0), ("a800", 312.0), ("l40s", 362.1),
    ("l4", 121.0), ("tpu v6", 918.0), ("tpu v5 lite", 197.0),
    ("tpu v5e", 197.0), ("tpu v5", 459.0), ("tpu v4", 275.0),
    ("tpu v3", 61.5), ("tpu v2", 22.5),
)


def peak_flops_per_s(device_kind: str, dtype: str) -> float | None:
  """A device's peak matmul FLOP/s for the model's compute dtype, or None.

  Known for bfloat16 on the GPUs and TPUs of the table. None for float32
  (its matmul rate depends on the precision XLA picks: TF32 or bf16 passes)
  and for devices not in the table (CPUs): measure a matmul instead, as
  benchmarks/step_benchmark.py does.
  """
  if dtype != "bfloat16":
    return None
  kind = device_kind.lower()
  for name, tflops in _BF16_PEAK_TFLOPS:
    if name in kind:
      return tflops * 1e12
  return None


def matmul_flops(m: int, k: int, n: int) -> float:
  """FLOPs of an [m, k] @ [k, n] matmul: one multiply and one add per term."""
  return 2.0 * m * k * n


def training_flops_per_token(model_config: ml_collections.ConfigDict,
                             sequence_length: int) -> float:
  """FLOPs of one training step (forward + backward) per token.

  Training = 3 x forward (the backward pass costs two forward matmuls: one
  for activation gradients, one for weight gradients). Forward per token =
  2 x (matmul weights: attention q, k, v, o; MLP gate, up, down; output head
  vocab_size x d_model, counted whether tied or not since it is a matmul either
  way) + attention scores QK^T and the weighted sum over V:
  2 x 2 x num_layers x sequence_length x (num_heads x head_dim).

  Causal masking is counted as FULL attention (no halving): the XLA
  implementation of `jax.nn.dot_product_attention` computes the whole L x L
  score matrix and masks it, and Chinchilla's count does the same.
  """
  cfg = model_config
  inner = cfg.num_heads * cfg.head_dim
  attention_weights = 4 * cfg.d_model * inner  # q, k, v: d->inner; o: inner->d
  mlp_weights = 3 * cfg.d_model * cfg.mlp_dim  # gate, up, down
  head_weights = cfg.vocab_size * cfg.d_model
  matmul_weights = cfg.num_layers * (attention_weights + mlp_weights) + head_weights
  # Per query token and layer: q.k over sequence_length keys, then the
  # probability-weighted sum of sequence_length values, each inner-wide.
  attention = 2 * 2 * cfg.num_layers * sequence_length * inner
  forward = 2.0 * matmul_weights + attention
  return 3.0 * forward
