"""The model's loss as a run's layout computes it: on whole params, or
pipelined over the stages of staged params (config.mesh.stage > 1)."""

import functools

from diloco_jax.config import run_config as run_config_lib
from diloco_jax.model import transformer as model_lib
from diloco_jax.parallel import pipeline


def loss_function(config, mesh):
  """The model's mean next-token loss, loss(params, sequences [B, L + 1]):
  with config.mesh.stage > 1, of staged params, pipelined over the stages
  as config.pipeline says."""
  model = config.model
  layout = run_config_lib.stage_layout(config)
  if layout is None:
    return functools.partial(model_lib.next_token_loss,
                             model_lib.graphdef(model))
  ends = model_lib.graphdef(model_lib.without_layers(model))
  block = model_lib.block_graphdef(model)
  return pipeline.make_loss(
      layout, functools.partial(model_lib.embed_tokens, ends),
      functools.partial(model_lib.apply_block, block),
      functools.partial(model_lib.token_losses, ends),
      model_lib.param_shapes(model),
      run_config_lib.pipeline_microbatches(config), mesh, remat=model.remat)
