"""Tests for the transformer LM and its FLOP count.

Mostly identities (causality, RoPE's relative-position property, vmap over
stacked models equals per-model calls, hand-derived parameter and FLOP counts)
on a tiny config so the whole file runs in seconds on 2 CPU cores.
"""
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from diloco_jax.analysis import flops
from diloco_jax.config import schema as config_schema
from diloco_jax.model import transformer as model
from tests import helpers

# inner width HEADS * HEAD_DIM = 64 differs from D_MODEL = 32 on purpose, and
# equals MLP so that initialization compiles only two kernel shapes.
VOCAB, LAYERS, D_MODEL, HEADS, HEAD_DIM, MLP, SEQ = 256, 2, 32, 4, 16, 64, 16
BATCH = 2

# XLA compiles slowly on the 2-core CPU machines (about 1-5 s per program
# here), so the tests share a few jitted functions and one batch shape.
_apply = jax.jit(model.apply, static_argnums=0)
_loss = jax.jit(model.next_token_loss, static_argnums=0)


def tiny_config(**overrides) -> ml_collections.ConfigDict:
  cfg = config_schema.base_config().model
  cfg.update(dict(
      vocab_size=VOCAB, num_layers=LAYERS, d_model=D_MODEL, num_heads=HEADS,
      head_dim=HEAD_DIM, mlp_dim=MLP, max_sequence_length=SEQ,
      tie_embeddings=True, dtype="float32", param_dtype="float32",
      rope_base=10000.0))
  cfg.update(overrides)
  return cfg


def diloco_config(num_layers, d_model, num_heads, head_dim, mlp_dim,
                  tie_embeddings) -> ml_collections.ConfigDict:
  return tiny_config(vocab_size=32000, num_layers=num_layers, d_model=d_model,
                     num_heads=num_heads, head_dim=head_dim, mlp_dim=mlp_dim,
                     max_sequence_length=1024, tie_embeddings=tie_embeddings)


def random_tokens(seed, shape, vocab=VOCAB):
  return np.random.default_rng(seed).integers(0, vocab, shape, dtype=np.int32)


def cross_entropy(logits, targets):
  """Reference mean cross-entropy in numpy (float64)."""
  logits = np.asarray(logits, np.float64)
  log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
  log_z += logits.max(-1)
  picked = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return float((log_z - picked).mean())


@pytest.fixture(scope="module")
def tiny():
  cfg = tiny_config()
  graphdef, params = model.init_params(cfg, seed=0)
  return cfg, graphdef, params


def hand_param_count(cfg) -> int:
  inner = cfg.num_heads * cfg.head_dim
  per_layer = (4 * cfg.d_model * inner        # q, k, v, o
               + 3 * cfg.d_model * cfg.mlp_dim  # gate, up, down
               + 2 * cfg.d_model)             # two RMSNorm scales
  embeddings = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_embeddings else 2)
  return embeddings + cfg.num_layers * per_layer + cfg.d_model  # + final norm


def test_logits_shape_and_dtype(tiny):
  _, graphdef, params = tiny
  logits = _apply(graphdef, params, random_tokens(0, (BATCH, SEQ)))
  assert logits.shape == (BATCH, SEQ, VOCAB)
  assert logits.dtype == jnp.float32
  assert np.all(np.isfinite(logits))


def test_bfloat16_compute_keeps_float32_params_and_logits(tiny):
  _, graphdef, params = tiny
  bf16_graphdef, bf16_params = model.init_params(
      tiny_config(dtype="bfloat16"), seed=0)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(bf16_params))
  tokens = random_tokens(1, (BATCH, SEQ))
  logits_bf16 = _apply(bf16_graphdef, bf16_params, tokens)
  assert logits_bf16.dtype == jnp.float32
  # Same seed, same weights: bf16 compute only perturbs the result slightly.
  np.testing.assert_allclose(logits_bf16, _apply(graphdef, params, tokens),
                             atol=0.05)


def test_causality(tiny):
  _, graphdef, params = tiny
  tokens = random_tokens(2, (BATCH, SEQ))
  t = SEQ // 2
  changed = tokens.copy()
  changed[:, t] = (tokens[:, t] + 1) % VOCAB
  before = _apply(graphdef, params, tokens)
  after = _apply(graphdef, params, changed)
  np.testing.assert_allclose(before[:, :t], after[:, :t], atol=1e-6)
  # And the change is visible from position t on (the test is not vacuous).
  assert np.abs(before[:, t:] - after[:, t:]).max(axis=-1).min() > 1e-4


def test_rope_is_a_rotation_whose_scores_depend_only_on_offset():
  head_dim = 16
  rng = np.random.default_rng(0)
  q, k = rng.normal(size=(2, head_dim)).astype(np.float32)

  @jax.jit
  def rotate_and_score(i, j):
    """rope(q, i_n), rope(k, j_n) and their dot products; one head."""
    rq = model.rotary_embedding(jnp.broadcast_to(q, (len(i), 1, head_dim)), i)
    rk = model.rotary_embedding(jnp.broadcast_to(k, (len(j), 1, head_dim)), j)
    return rq[:, 0], rk[:, 0], (rq * rk).sum(axis=(-2, -1))

  pairs = np.array([(5, 2), (2, 5), (7, 7), (100, 37), (0, 0), (3, 0), (0, 3)])
  rq, rk, scores = rotate_and_score(pairs[:, 0], pairs[:, 1])
  for shift in (1, 13, 900):
    shifted = rotate_and_score(pairs[:, 0] + shift, pairs[:, 1] + shift)[2]
    np.testing.assert_allclose(shifted, scores, rtol=1e-4, atol=1e-4)
  assert scores[4] == pytest.approx(float(q @ k), rel=1e-5)  # identity at 0
  assert abs(scores[5] - scores[6]) > 1e-3  # depends on the sign of i - j too
  # A rotation: norms are kept at every position.
  np.testing.assert_allclose(np.linalg.norm(rq, axis=-1), np.linalg.norm(q),
                             rtol=1e-5)
  np.testing.assert_allclose(np.linalg.norm(rk, axis=-1), np.linalg.norm(k),
                             rtol=1e-5)


def test_count_params_matches_hand_computation(tiny):
  cfg, _, params = tiny
  assert model.count_params(params) == hand_param_count(cfg)
  assert model.count_non_embedding_params(params, cfg) == (
      hand_param_count(cfg) - VOCAB * D_MODEL)


def test_init_scales(tiny):
  _, _, params = tiny
  block = params["blocks"][0]
  variance_times_fan_in = lambda w: np.var(np.asarray(w)) * w.shape[0]
  # Fan-in init (variance 1 / fan_in) for inputs to a residual branch...
  for kernel in (block["attn"]["q"]["kernel"], block["mlp"]["gate"]["kernel"]):
    assert variance_times_fan_in(kernel) == pytest.approx(1.0, rel=0.15)
  # ...and 1 / (2 * num_layers) of that for the branch outputs.
  for kernel in (block["attn"]["o"]["kernel"], block["mlp"]["down"]["kernel"]):
    assert variance_times_fan_in(kernel) == pytest.approx(1 / (2 * LAYERS),
                                                          rel=0.15)
  assert np.std(np.asarray(params["embed"]["embedding"])) == pytest.approx(
      0.02, rel=0.1)


def test_untied_head_adds_one_vocab_matrix(tiny):
  cfg, _, tied_params = tiny
  untied_cfg = tiny_config(tie_embeddings=False)
  untied_params = model.param_shapes(untied_cfg)
  assert (model.count_params(untied_params) - model.count_params(tied_params)
          == VOCAB * D_MODEL)
  assert model.count_params(untied_params) == hand_param_count(untied_cfg)
  assert (model.count_non_embedding_params(untied_params, untied_cfg)
          == model.count_non_embedding_params(tied_params, cfg))


def test_next_token_loss_is_shifted_cross_entropy(tiny):
  _, graphdef, params = tiny
  sequences = random_tokens(4, (BATCH, SEQ + 1))
  logits = _apply(graphdef, params, sequences[:, :-1])
  loss = _loss(graphdef, params, sequences)
  assert loss.shape == () and loss.dtype == jnp.float32
  assert float(loss) == pytest.approx(
      cross_entropy(logits, sequences[:, 1:]), rel=1e-5)


@pytest.mark.parametrize("tie", [True, False])
def test_initial_loss_is_near_uniform(tie):
  graphdef, params = model.init_params(tiny_config(tie_embeddings=tie), seed=0)
  loss = _loss(graphdef, params, random_tokens(3, (BATCH, SEQ + 1)))
  assert abs(float(loss) - math.log(VOCAB)) < 0.25


def test_adamw_under_jit_and_vmap_over_stacked_models(tiny):
  """Two models stacked on a leading axis, each trained on its own batch.

  This is how the training loop runs islands: params with a leading model
  axis, one jit(vmap(...)) program. At step 0 each model's loss must equal
  its un-vmapped loss; after a few AdamW steps each overfits its fixed batch.
  """
  _, graphdef, params0 = tiny
  _, params1 = model.init_params(tiny_config(), seed=1)
  stacked = jax.tree.map(lambda a, b: np.stack([a, b]), params0, params1)
  batches = random_tokens(5, (2, BATCH, SEQ + 1))
  optimizer = optax.adamw(3e-3, weight_decay=0.1)
  num_steps = 30

  def train_one_model(params, batch):
    def step(carry, _):
      params, opt_state = carry
      loss, grads = jax.value_and_grad(model.next_token_loss, argnums=1)(
          graphdef, params, batch)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    carry = (params, optimizer.init(params))
    return jax.lax.scan(step, carry, length=num_steps)[1]

  losses = np.asarray(jax.jit(jax.vmap(train_one_model))(stacked, batches))
  assert losses.shape == (2, num_steps)
  for i, params in enumerate([params0, params1]):
    assert losses[i, 0] == pytest.approx(
        float(_loss(graphdef, params, batches[i])), rel=1e-5)
  assert np.all(losses[:, -1] < losses[:, 0] - 1.0), losses


def test_param_shapes_match_init_without_allocating(tiny):
  cfg, _, params = tiny
  abstract = model.param_shapes(cfg)
  assert all(isinstance(x, jax.ShapeDtypeStruct)
             for x in jax.tree.leaves(abstract))
  shape_dtype = lambda x: (x.shape, x.dtype)
  assert (jax.tree.map(shape_dtype, abstract)
          == jax.tree.map(shape_dtype, params))
  # init_params itself traces abstractly too.
  traced = jax.eval_shape(lambda: model.init_params(cfg, seed=0)[1])
  assert jax.tree.map(shape_dtype, traced) == jax.tree.map(shape_dtype, params)


def test_training_flops_match_hand_computation():
  cfg = tiny_config()
  inner = HEADS * HEAD_DIM
  weights = LAYERS * (4 * D_MODEL * inner + 3 * D_MODEL * MLP) + VOCAB * D_MODEL
  forward = 2 * weights + 4 * LAYERS * SEQ * inner
  assert flops.training_flops_per_token(cfg, SEQ) == 3 * forward
  # The head is a matmul whether or not it shares the embedding's weights.
  assert flops.training_flops_per_token(
      tiny_config(tie_embeddings=False), SEQ) == 3 * forward
  assert flops.matmul_flops(3, 5, 7) == 2 * 3 * 5 * 7


def test_sequence_longer_than_max_is_rejected(tiny):
  _, graphdef, params = tiny
  with pytest.raises(ValueError, match="max_sequence_length"):
    _apply(graphdef, params, random_tokens(8, (BATCH, SEQ + 1)))


# DiLoCo paper sizes (vocabulary 32,000, sequence 1024) with the recommended
# SwiGLU width mlp_dim = 8/3 d_model rounded to a multiple of 128 and tied
# embeddings; built abstractly only, nothing is allocated.
@pytest.mark.parametrize("nominal, layers, d_model, heads, head_dim, mlp_dim", [
    (60e6, 3, 896, 16, 64, 2432),
    (150e6, 12, 896, 16, 64, 2432),
    (400e6, 12, 1536, 12, 128, 4096),
])
def test_diloco_paper_sizes(nominal, layers, d_model, heads, head_dim, mlp_dim):
  cfg = diloco_config(layers, d_model, heads, head_dim, mlp_dim,
                      tie_embeddings=True)
  abstract = model.param_shapes(cfg)
  assert all(isinstance(x, jax.ShapeDtypeStruct)
             for x in jax.tree.leaves(abstract))
  count = model.count_params(abstract)
  assert count == hand_param_count(cfg)
  assert 0.75 * nominal <= count <= 1.25 * nominal, count


def test_remat_changes_memory_not_the_gradient(tiny):
  cfg, graphdef, params = tiny
  remat_graphdef = model.graphdef(tiny_config(remat=True))
  tokens = random_tokens(5, (BATCH, SEQ + 1))
  grad = jax.jit(jax.grad(model.next_token_loss, argnums=1),
                 static_argnums=0)
  helpers.assert_trees_close(grad(remat_graphdef, params, tokens),
                             grad(graphdef, params, tokens),
                             rtol=1e-5, atol=1e-7)


def test_attention_implementation_choice():
  # On CPU 'auto' is XLA's attention, also for a bf16 model.
  assert model.attention_implementation(tiny_config()) == "xla"
  assert model.attention_implementation(tiny_config(dtype="bfloat16")) == (
      "xla")
  assert model.attention_implementation(tiny_config(attention="xla")) == "xla"


def test_peak_flops_table():
  assert flops.peak_flops_per_s("NVIDIA H100 80GB HBM3", "bfloat16") == (
      989.4e12)
  assert flops.peak_flops_per_s("NVIDIA H100 PCIe", "bfloat16") == 756e12
  assert flops.peak_flops_per_s("TPU v5 lite", "bfloat16") == 197e12
  assert flops.peak_flops_per_s("TPU v5p", "bfloat16") == 459e12
  # Never an f32 peak (XLA picks the matmul precision), never a CPU one.
  assert flops.peak_flops_per_s("NVIDIA H100 80GB HBM3", "float32") is None
  assert flops.peak_flops_per_s("cpu", "bfloat16") is None
