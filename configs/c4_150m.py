"""DiLoCo paper's 150M model on C4: 12 layers, d_model 896, 16 heads x 64.

151.2M parameters with tied embeddings and a SwiGLU width of 8/3 x d_model
(rounded to 128). Needs --config.data.path pointing at C4.
"""

from configs import c4_common


def get_config():
  return c4_common.c4_config(num_layers=12, d_model=896, num_heads=16,
                             head_dim=64, mlp_dim=2432)
