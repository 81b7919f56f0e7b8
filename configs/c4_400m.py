"""DiLoCo paper's 400M model on C4: 12 layers, d_model 1536, 12 heads x 128.

388.9M parameters with tied embeddings and a SwiGLU width of 8/3 x d_model
(rounded to 128). Needs --config.data.path pointing at C4.
"""

from configs import c4_common


def get_config():
  return c4_common.c4_config(num_layers=12, d_model=1536, num_heads=12,
                             head_dim=128, mlp_dim=4096)
