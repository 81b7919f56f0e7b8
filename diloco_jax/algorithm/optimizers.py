"""Inner and outer optimizers, built from the config with optax.

The inner optimizer is what each island runs for H steps (AdamW with warmup,
cosine decay and clipping); the outer optimizer consumes the averaged
pseudo-gradient once per round (Nesterov SGD by default, as in DiLoCo).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_jax.parallel.stages import LAYERS


def _decay_mask(params):
  # Weight decay on matrices only: norms' scales have no reason to shrink
  # toward zero, and decaying them hurts small models noticeably.
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def schedule_length(inner_config, total_steps: int) -> int:
  """The steps the learning rate schedule spans: schedule_steps, or
  total_steps when that is 0 (a run stopped early on a longer run's
  schedule sets it, e.g. the pretraining phase of config.pretrain_steps)."""
  return inner_config.get("schedule_steps", 0) or total_steps


def inner_learning_rate(inner_config, total_steps: int) -> optax.Schedule:
  """Linear warmup to the peak, then cosine decay to a floor at the end of
  the schedule (schedule_length), held after it."""
  peak = inner_config.learning_rate
  total_steps = schedule_length(inner_config, total_steps)
  warmup = min(inner_config.warmup_steps, max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=peak,
      warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1),
      end_value=peak * inner_config.final_learning_rate_fraction,
  )


def learning_rate_table(inner_config, total_steps: int) -> np.ndarray:
  """The inner learning rate before each of steps 1..total_steps (host).

  Evaluated on the CPU device, so a GPU/TPU run compiles nothing for it.
  """
  schedule = jax.vmap(inner_learning_rate(inner_config, total_steps))
  try:
    device = jax.local_devices(backend="cpu")[0]
  except RuntimeError:  # no CPU backend (JAX_PLATFORMS excludes it)
    device = jax.local_devices()[0]
  with jax.default_device(device):
    return np.asarray(schedule(np.arange(total_steps)))


def clip_by_global_norm(max_norm: float, axis_name: str | None = None
                        ) -> optax.GradientTransformation:
  """optax.clip_by_global_norm, over pieces of one gradient.

  With `axis_name`, each member of that named axis (a pipeline stage)
  holds a piece of the gradient, and the norm is the whole gradient's:
  the squares are summed over the axis before the root. Its state is
  optax's (empty), so checkpoints do not change.
  """
  if axis_name is None:
    return optax.clip_by_global_norm(max_norm)

  def update(updates, state, params=None):
    del params
    squares = sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                  for x in jax.tree.leaves(updates))
    norm = jnp.sqrt(jax.lax.psum(squares, axis_name))
    keep = norm < max_norm
    return jax.tree.map(
        lambda t: jnp.where(keep, t, (t / norm.astype(t.dtype)) * max_norm),
        updates), state

  return optax.GradientTransformation(optax.init_empty_state, update)


def muon_labels(params):
  """Which optimizer each leaf of `params` takes under Muon (MuLoCo):
  'muon' for the matrices inside the transformer's blocks (attention and
  MLP kernels, whose updates Muon orthogonalizes), 'adamw' for the rest:
  embeddings and head (a lookup table and a classifier, not maps between
  hidden states) and the norms' vectors."""
  def label(path, leaf):
    in_blocks = any(getattr(key, "key", None) == LAYERS for key in path)
    return "muon" if in_blocks and leaf.ndim >= 2 else "adamw"
  return jax.tree_util.tree_map_with_path(label, params)


def _muon_matrices(params):
  # A kernel maps its second-to-last axis to its last (x @ W); any axes
  # before them (layers stacked by a pipeline stage) are batch axes.
  return jax.tree.map(
      lambda p: optax.contrib.MuonDimensionNumbers(p.ndim - 2, p.ndim - 1),
      params)


def _adamw(inner_config, learning_rate) -> optax.GradientTransformation:
  return optax.adamw(
      learning_rate=learning_rate,
      b1=inner_config.b1,
      b2=inner_config.b2,
      eps=inner_config.eps,
      weight_decay=inner_config.weight_decay,
      mask=_decay_mask,
  )


def inner_optimizer(inner_config, total_steps: int,
                    stage_axis: str | None = None
                    ) -> optax.GradientTransformation:
  """The islands' optimizer, with warmup + cosine schedule, weight decay
  and global-norm clipping: AdamW, or with name 'muon' Muon on the blocks'
  matrices and AdamW on the rest (`muon_labels`). Muon's updates are
  scaled to AdamW's RMS (inner_config.muon.consistent_rms), so both parts
  share the schedule. With `stage_axis` the optimizer runs once per
  pipeline stage (on that stage's layers), and the clipping norm spans the
  stages."""
  learning_rate = inner_learning_rate(inner_config, total_steps)
  optimizer = _adamw(inner_config, learning_rate)
  if inner_config.name == "muon":
    muon = inner_config.muon
    optimizer = optax.partition(
        {"muon": optax.contrib.muon(
            learning_rate=learning_rate,
            ns_steps=muon.ns_steps,
            beta=muon.momentum,
            weight_decay=inner_config.weight_decay,
            consistent_rms=muon.consistent_rms,
            muon_weight_dimension_numbers=_muon_matrices),
         "adamw": optimizer},
        muon_labels)
  elif inner_config.name != "adamw":
    raise ValueError(
        f"config.inner_optimizer.name={inner_config.name!r} is unknown")
  if inner_config.grad_clip_norm > 0:
    return optax.chain(
        clip_by_global_norm(inner_config.grad_clip_norm, stage_axis),
        optimizer)
  return optimizer


def outer_optimizer(outer_config) -> optax.GradientTransformation:
  """The optimizer applied to the averaged pseudo-gradient once per round.

  'nesterov' (DiLoCo's default), 'sgd' (FedAvg when the learning rate is 1),
  'momentum' (heavy ball), 'adam' (with its eps; DiLoCo needed eps ~ 0.1)
  or 'sparseloco': x - alpha * mean, the momentum being in the islands'
  error feedback (its learning rate is config.diloco.sparseloco.alpha,
  set by overlap_defaults.resolve).
  """
  name = outer_config.name
  lr = outer_config.learning_rate
  if name == "nesterov":
    return optax.sgd(lr, momentum=outer_config.momentum, nesterov=True)
  if name == "momentum":
    return optax.sgd(lr, momentum=outer_config.momentum, nesterov=False)
  if name in ("sgd", "sparseloco"):
    return optax.sgd(lr)
  if name == "adam":
    return optax.adam(lr, b1=outer_config.b1, b2=outer_config.b2,
                      eps=outer_config.eps)
  raise ValueError(f"config.diloco.outer_optimizer.name={name!r} is unknown")


def with_step_counts(opt_state, step):
  """`opt_state` with every optax `count` leaf set to `step`: a fresh state
  that goes on with the learning rate schedule where the run is."""
  def set_count(path, leaf):
    last = path[-1] if path else None
    if getattr(last, "name", None) == "count":
      return jnp.full_like(leaf, step)
    return leaf
  return jax.tree_util.tree_map_with_path(set_count, opt_state)
