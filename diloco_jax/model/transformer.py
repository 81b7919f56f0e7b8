"""Decoder-only transformer language model (Flax NNX).

Pre-norm blocks of [RMSNorm -> causal self-attention with RoPE] and
[RMSNorm -> SwiGLU MLP], a final RMSNorm and a tied or untied output head.
No biases anywhere. Every matmul weight is a 2-D kernel, so codecs that work
per matrix (low-rank, per-neuron pruning) see plain matrices.

The rest of the project uses the model through pure functions over a params
pytree: `init_params` / `param_shapes` to build it, `apply` and
`next_token_loss` to run it (jit, vmap over islands, shard_map and grad all
work on these), and `count_params` for reporting.
"""
import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from diloco_jax.model import embedding

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DTYPES = tuple(_DTYPES)  # config.model.dtype and param_dtype
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn")

# GPT-2 / Chinchilla-style scale for embeddings (and the untied head).
_EMBED_STDDEV = 0.02


def _dtype(name: str):
  """Maps a config dtype name to a jnp dtype, rejecting unknown names early."""
  if name not in _DTYPES:
    raise ValueError(f"unknown dtype {name!r}; expected one of {list(_DTYPES)}")
  return _DTYPES[name]


def rotary_embedding(x: jax.Array, positions: jax.Array,
                     base: float = 10000.0) -> jax.Array:
  """Applies rotary position embeddings (RoPE) to queries or keys.

  Uses the "rotate half" layout: feature i is paired with feature i + D/2 and
  the pair is rotated by angle position * base^(-2i/D). Because rotations
  compose, <rope(q, i), rope(k, j)> depends on positions only through i - j.

  Args:
    x: [..., L, num_heads, head_dim] with an even head_dim.
    positions: [L] integer or float positions.
    base: RoPE wavelength base.

  Returns:
    Array of x's shape and dtype.
  """
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
  half = head_dim // 2
  # Angles in float32 even for bf16 activations: positions up to thousands
  # times small frequencies lose too many bits in bf16.
  inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [L, D/2]
  sin = jnp.sin(angles)[:, None, :]  # [L, 1, D/2]: broadcast over heads
  cos = jnp.cos(angles)[:, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)


def on_nvidia_gpu() -> bool:
  """Whether the default backend is an NVIDIA GPU (CUDA)."""
  if jax.default_backend() != "gpu":
    return False
  try:
    return "cuda" in jax.devices()[0].client.platform_version.lower()
  except AttributeError:  # an older client without platform_version
    return "nvidia" in jax.devices()[0].device_kind.lower()


def attention_implementation(model_config) -> str:
  """The `jax.nn.dot_product_attention` implementation the model uses.

  'auto' picks cuDNN's fused flash attention on NVIDIA GPUs when it applies
  (bf16 compute, head_dim a multiple of 8 up to 128) and XLA's otherwise;
  'xla' and 'cudnn' force one (validation checks that 'cudnn' applies).
  """
  name = model_config.attention
  if name != "auto":
    return name
  fits_cudnn = (model_config.dtype == "bfloat16"
                and model_config.head_dim % 8 == 0
                and model_config.head_dim <= 128)
  return "cudnn" if fits_cudnn and on_nvidia_gpu() else "xla"


def _linear(in_features: int, out_features: int, cfg, *, rngs: nnx.Rngs,
            init_scale: float = 1.0) -> nnx.Linear:
  """Bias-free Linear with truncated-normal fan-in init of variance scale/fan_in."""
  return nnx.Linear(
      in_features, out_features, use_bias=False,
      kernel_init=jax.nn.initializers.variance_scaling(
          init_scale, "fan_in", "truncated_normal"),
      dtype=_dtype(cfg.dtype), param_dtype=_dtype(cfg.param_dtype), rngs=rngs)


def _rms_norm(cfg, *, rngs: nnx.Rngs) -> nnx.RMSNorm:
  return nnx.RMSNorm(cfg.d_model, dtype=_dtype(cfg.dtype),
                     param_dtype=_dtype(cfg.param_dtype), rngs=rngs)


def _residual_init_scale(cfg) -> float:
  # GPT-2: each block adds two residual branches, so the residual stream's
  # variance grows with 2 * num_layers. Shrinking the variance of the output
  # projections by 1 / (2 * num_layers) (std by 1/sqrt) keeps the stream's
  # scale at init independent of depth.
  return 1.0 / (2 * cfg.num_layers)


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention with RoPE on queries and keys."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    inner = cfg.num_heads * cfg.head_dim
    self.num_heads = cfg.num_heads
    self.head_dim = cfg.head_dim
    self.rope_base = cfg.rope_base
    self.implementation = attention_implementation(cfg)
    self.q = _linear(cfg.d_model, inner, cfg, rngs=rngs)
    self.k = _linear(cfg.d_model, inner, cfg, rngs=rngs)
    self.v = _linear(cfg.d_model, inner, cfg, rngs=rngs)
    self.o = _linear(inner, cfg.d_model, cfg, rngs=rngs,
                     init_scale=_residual_init_scale(cfg))

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, _ = x.shape
    heads = lambda t: t.reshape(batch, length, self.num_heads, self.head_dim)
    positions = jnp.arange(length)
    q = rotary_embedding(heads(self.q(x)), positions, self.rope_base)
    k = rotary_embedding(heads(self.k(x)), positions, self.rope_base)
    v = heads(self.v(x))
    # Softmax runs in float32 inside dot_product_attention for bf16 inputs.
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                       implementation=self.implementation)
    return self.o(out.reshape(batch, length, self.num_heads * self.head_dim))


class SwiGLU(nnx.Module):
  """Gated MLP: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.gate = _linear(cfg.d_model, cfg.mlp_dim, cfg, rngs=rngs)
    self.up = _linear(cfg.d_model, cfg.mlp_dim, cfg, rngs=rngs)
    self.down = _linear(cfg.mlp_dim, cfg.d_model, cfg, rngs=rngs,
                        init_scale=_residual_init_scale(cfg))

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.attn_norm = _rms_norm(cfg, rngs=rngs)
    self.attn = CausalSelfAttention(cfg, rngs=rngs)
    self.mlp_norm = _rms_norm(cfg, rngs=rngs)
    self.mlp = SwiGLU(cfg, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x))
    return x + self.mlp(self.mlp_norm(x))


class TransformerLM(nnx.Module):
  """Decoder-only LM mapping int32 tokens [B, L] to float32 logits [B, L, V]."""

  def __init__(self, model_config: ml_collections.ConfigDict, *,
               rngs: nnx.Rngs):
    cfg = model_config
    self.max_sequence_length = cfg.max_sequence_length
    self.tie_embeddings = cfg.tie_embeddings
    self.remat = cfg.remat
    self.embed = nnx.Embed(
        cfg.vocab_size, cfg.d_model,
        embedding_init=jax.nn.initializers.normal(_EMBED_STDDEV),
        dtype=_dtype(cfg.dtype), param_dtype=_dtype(cfg.param_dtype),
        rngs=rngs)
    # A plain list of layers (blocks/0, blocks/1, ...) keeps per-layer params
    # addressable, e.g. for Streaming DiLoCo's fragments of consecutive layers.
    self.blocks = nnx.List(
        [Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = _rms_norm(cfg, rngs=rngs)
    if not cfg.tie_embeddings:
      # Initialized like the embedding rather than fan-in: with unit-RMS inputs
      # a fan-in init gives logits of std ~1, i.e. ~0.5 nats above log(V) at
      # step 0; std 0.02 starts tied and untied models at the same near-uniform
      # prediction.
      self.head = nnx.Linear(
          cfg.d_model, cfg.vocab_size, use_bias=False,
          kernel_init=jax.nn.initializers.normal(_EMBED_STDDEV),
          dtype=_dtype(cfg.dtype), param_dtype=_dtype(cfg.param_dtype),
          rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    h = self.embed_tokens(tokens)
    for block in self.blocks:
      h = run_block(block, h, self.remat)
    return self.logits(h)

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """int32 tokens [B, L] -> the first block's input [B, L, d_model]."""
    if tokens.shape[-1] > self.max_sequence_length:
      raise ValueError(f"sequence length {tokens.shape[-1]} exceeds "
                       f"max_sequence_length {self.max_sequence_length}")
    # Not self.embed(tokens): its gradient is a scatter-add in the compute
    # dtype, whose cost grows with how often tokens repeat (embedding.py).
    embedding_table = self.embed.embedding[...]
    return embedding.take_rows(embedding_table, tokens,
                               self.embed.dtype or embedding_table.dtype)

  def logits(self, h: jax.Array) -> jax.Array:
    """The last block's output [B, L, d_model] -> float32 logits [B, L, V]."""
    h = self.final_norm(h)
    logits = self.embed.attend(h) if self.tie_embeddings else self.head(h)
    return logits.astype(jnp.float32)


def run_block(block: Block, h: jax.Array, remat: bool) -> jax.Array:
  """One block on `h`; with `remat`, only its input is kept for the
  backward pass and the rest is recomputed: activation memory of one block
  instead of all of them, for about a third more compute. A pure function
  of the block's params, so it composes with any enclosing transformation.
  """
  if not remat:
    return block(h)
  structure, params = nnx.split(block)
  return jax.checkpoint(
      lambda p, x: nnx.merge(structure, p)(x),
      policy=jax.checkpoint_policies.nothing_saveable)(params, h)


def graphdef(model_config: ml_collections.ConfigDict) -> nnx.GraphDef:
  """The model's structure (no arrays), for `apply` and `next_token_loss`."""
  return nnx.split(nnx.eval_shape(
      lambda: TransformerLM(model_config, rngs=nnx.Rngs(0))), nnx.Param)[0]


@contextlib.contextmanager
def fast_init_compile():
  """Compiles random initialization quickly on GPUs; wrap the jitted init.

  XLA unrolls every threefry call site into its own large fusion, and an
  init program holds one per weight: compiling the 150M model's took 57 s
  on an H100 (90 s with a constant seed). JAX's threefry GPU kernel draws
  the same bits (the implementations are bit-equivalent) from one
  precompiled kernel. Elsewhere this changes nothing.
  """
  name = "jax_threefry_gpu_kernel_lowering"
  previous = getattr(jax.config, name)
  jax.config.update(name, True)
  try:
    yield
  finally:
    jax.config.update(name, previous)


def without_layers(model_config: ml_collections.ConfigDict
                   ) -> ml_collections.ConfigDict:
  """The config of the same model with no blocks: its params are the
  embedding, the final norm and the head (pipeline stages hold the blocks)."""
  config = ml_collections.ConfigDict(model_config.to_dict())
  config.num_layers = 0
  return config


def block_graphdef(model_config: ml_collections.ConfigDict) -> nnx.GraphDef:
  """One block's structure, for `apply_block`."""
  return nnx.split(nnx.eval_shape(
      lambda: Block(model_config, rngs=nnx.Rngs(0))), nnx.Param)[0]


def apply_block(block_def: nnx.GraphDef, block_params, h: jax.Array,
                remat: bool = False) -> jax.Array:
  """Pure forward pass of one block (params from params['blocks'][i])."""
  return run_block(nnx.merge(block_def, block_params), h, remat)


def embed_tokens(ends_def: nnx.GraphDef, ends_params,
                 tokens: jax.Array) -> jax.Array:
  """The embedding look-up; `ends_def` is graphdef(without_layers(...)) and
  `ends_params` the params outside params['blocks']."""
  return nnx.merge(ends_def, ends_params).embed_tokens(tokens)


def token_losses(ends_def: nnx.GraphDef, ends_params, h: jax.Array,
                 targets: jax.Array) -> jax.Array:
  """Cross-entropy (nats) of every position: the final norm and head on the
  last block's output `h` [B, L, d], against int32 `targets` [B, L]."""
  logits = nnx.merge(ends_def, ends_params).logits(h)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def new_params(model_config: ml_collections.ConfigDict,
               seed: int | jax.Array) -> nnx.State:
  """Freshly initialized params from `seed`; call under `jax.jit`.

  Under jit with out_shardings, every parameter is created where it lives
  (already split over its devices): no host or single-device copy of the
  whole model. Pass the seed as a traced argument: with a constant seed the
  whole program is a constant, which XLA may try to fold at compile time.
  """
  return nnx.split(TransformerLM(model_config,
                                 rngs=nnx.Rngs(jax.random.key(seed))),
                   nnx.Param)[1]


def init_params(model_config: ml_collections.ConfigDict,
                seed: int) -> tuple[nnx.GraphDef, nnx.State]:
  """Builds the model from `seed` and splits it into (graphdef, params).

  The model holds only `nnx.Param` variables, so params is its whole state.
  Works under `jax.jit` / `jax.eval_shape` (see `param_shapes`).
  """
  # Initializing inside one jitted program compiles once; eager init would
  # compile a random kernel per weight shape (seconds on CPU).
  with fast_init_compile():
    params = jax.jit(functools.partial(new_params, model_config))(seed)
  return graphdef(model_config), params


def param_shapes(model_config: ml_collections.ConfigDict) -> nnx.State:
  """Abstract params (ShapeDtypeStruct leaves) without allocating memory."""
  abstract = nnx.eval_shape(
      lambda: TransformerLM(model_config, rngs=nnx.Rngs(0)))
  return nnx.split(abstract, nnx.Param)[1]


def apply(graphdef: nnx.GraphDef, params: nnx.State,
          tokens: jax.Array) -> jax.Array:
  """Pure forward pass: int32 tokens [B, L] -> float32 logits [B, L, V]."""
  return nnx.merge(graphdef, params)(tokens)


def next_token_loss(graphdef: nnx.GraphDef, params: nnx.State,
                    sequences: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy (nats) of int32 sequences [B, L + 1]."""
  inputs, targets = sequences[:, :-1], sequences[:, 1:]
  logits = apply(graphdef, params, inputs)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, targets).mean()


def count_params(params) -> int:
  """Number of scalars in a params pytree (concrete or abstract leaves)."""
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def count_non_embedding_params(params,
                               model_config: ml_collections.ConfigDict) -> int:
  """Parameters minus the vocab x d_model matrices (Kaplan et al. convention).

  Excludes the token embedding and, when untied, the output head too, so tied
  and untied models of the same shape report the same number.
  """
  vocab_matrices = 1 if model_config.tie_embeddings else 2
  return (count_params(params)
          - vocab_matrices * model_config.vocab_size * model_config.d_model)
