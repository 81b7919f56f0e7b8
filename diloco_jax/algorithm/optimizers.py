"""Inner and outer optimizers, built with optax from typed settings.

The inner optimizer is what each island runs for H steps (AdamW with warmup,
cosine decay and clipping); the outer optimizer consumes the averaged
pseudo-gradient once per round (Nesterov SGD by default, as in DiLoCo).
Both take frozen dataclasses (`InnerSettings`, `OuterSettings`), never a
config: config/run_config.py builds them from a run's config sections.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_jax.parallel.stages import LAYERS


@dataclasses.dataclass(frozen=True)
class MuonSettings:
  """Muon's own settings (MuLoCo): its momentum, the Newton-Schulz steps
  that orthogonalize an update, and the RMS its updates are scaled to
  (AdamW's, so both share one learning rate schedule)."""
  momentum: float
  ns_steps: int
  consistent_rms: float


@dataclasses.dataclass(frozen=True)
class InnerSettings:
  """The islands' optimizer.

  Attributes:
    name: 'adamw', or 'muon': Muon on the blocks' matrices, AdamW with the
      fields below on the rest (`muon_labels`).
    learning_rate: the peak of the warmup + cosine schedule.
    warmup_steps: linear warmup from 0 to the peak.
    final_learning_rate_fraction: the cosine's floor, as a part of the peak.
    schedule_steps: the steps the schedule spans (0: the run's total).
    weight_decay: decoupled weight decay, on matrices only.
    b1, b2, eps: AdamW's moments and epsilon.
    grad_clip_norm: clip the gradient's global norm to this (0: off).
    muon: Muon's settings (name 'muon' only).
  """
  name: str
  learning_rate: float
  warmup_steps: int
  final_learning_rate_fraction: float
  schedule_steps: int
  weight_decay: float
  b1: float
  b2: float
  eps: float
  grad_clip_norm: float
  muon: MuonSettings | None = None


@dataclasses.dataclass(frozen=True)
class OuterSettings:
  """The step on the global params once per round.

  Attributes:
    name: 'nesterov', 'sgd', 'momentum', 'adam' or 'sparseloco' (see
      `outer_optimizer`).
    learning_rate: the outer learning rate (SparseLoCo's alpha).
    momentum: 'nesterov' and 'momentum' only.
    b1, b2, eps: 'adam' only.
  """
  name: str
  learning_rate: float
  momentum: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 0.1


def _decay_mask(params):
  # Weight decay on matrices only: norms' scales have no reason to shrink
  # toward zero, and decaying them hurts small models noticeably.
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def schedule_length(inner: InnerSettings, total_steps: int) -> int:
  """The steps the learning rate schedule spans: schedule_steps, or
  total_steps when that is 0 (a run stopped early on a longer run's
  schedule sets it, e.g. the pretraining phase of the DiLoCo paper's
  protocol)."""
  return inner.schedule_steps or total_steps


def inner_learning_rate(inner: InnerSettings,
                        total_steps: int) -> optax.Schedule:
  """Linear warmup to the peak, then cosine decay to a floor at the end of
  the schedule (schedule_length), held after it."""
  peak = inner.learning_rate
  total_steps = schedule_length(inner, total_steps)
  warmup = min(inner.warmup_steps, max(total_steps - 1, 0))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=peak,
      warmup_steps=warmup,
      decay_steps=max(total_steps, warmup + 1),
      end_value=peak * inner.final_learning_rate_fraction,
  )


def learning_rate_table(inner: InnerSettings,
                        total_steps: int) -> np.ndarray:
  """The inner learning rate before each of steps 1..total_steps (host).

  Evaluated on the CPU device, so a GPU/TPU run compiles nothing for it.
  """
  schedule = jax.vmap(inner_learning_rate(inner, total_steps))
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


def _adamw(inner: InnerSettings,
           learning_rate) -> optax.GradientTransformation:
  return optax.adamw(
      learning_rate=learning_rate,
      b1=inner.b1,
      b2=inner.b2,
      eps=inner.eps,
      weight_decay=inner.weight_decay,
      mask=_decay_mask,
  )


def inner_optimizer(inner: InnerSettings, total_steps: int,
                    stage_axis: str | None = None
                    ) -> optax.GradientTransformation:
  """The islands' optimizer, with warmup + cosine schedule, weight decay
  and global-norm clipping: AdamW, or with name 'muon' Muon on the blocks'
  matrices and AdamW on the rest (`muon_labels`). Muon's updates are
  scaled to AdamW's RMS (inner.muon.consistent_rms), so both parts share
  the schedule. With `stage_axis` the optimizer runs once per pipeline
  stage (on that stage's layers), and the clipping norm spans the
  stages."""
  if inner.name not in ("adamw", "muon"):
    raise ValueError(f"inner optimizer name={inner.name!r} is not 'adamw' "
                     "or 'muon'")
  learning_rate = inner_learning_rate(inner, total_steps)
  optimizer = _adamw(inner, learning_rate)
  if inner.name == "muon":
    muon = inner.muon
    if muon is None:
      raise ValueError("inner optimizer 'muon' needs its MuonSettings")
    optimizer = optax.partition(
        {"muon": optax.contrib.muon(
            learning_rate=learning_rate,
            ns_steps=muon.ns_steps,
            beta=muon.momentum,
            weight_decay=inner.weight_decay,
            consistent_rms=muon.consistent_rms,
            muon_weight_dimension_numbers=_muon_matrices),
         "adamw": optimizer},
        muon_labels)
  if inner.grad_clip_norm > 0:
    return optax.chain(
        clip_by_global_norm(inner.grad_clip_norm, stage_axis), optimizer)
  return optimizer


def outer_optimizer(outer: OuterSettings) -> optax.GradientTransformation:
  """The optimizer applied to the averaged pseudo-gradient once per round.

  'nesterov' (DiLoCo's default), 'sgd' (FedAvg when the learning rate is 1),
  'momentum' (heavy ball), 'adam' (with its eps; DiLoCo needed eps ~ 0.1)
  or 'sparseloco': x - alpha * mean, the momentum being in the islands'
  error feedback (its learning rate is SparseLoCo's alpha).
  """
  name, lr = outer.name, outer.learning_rate
  if name == "nesterov":
    return optax.sgd(lr, momentum=outer.momentum, nesterov=True)
  if name == "momentum":
    return optax.sgd(lr, momentum=outer.momentum, nesterov=False)
  if name in ("sgd", "sparseloco"):
    return optax.sgd(lr)
  if name == "adam":
    return optax.adam(lr, b1=outer.b1, b2=outer.b2, eps=outer.eps)
  raise ValueError(f"outer optimizer name={name!r} is unknown")


def with_step_counts(opt_state, step):
  """`opt_state` with every optax `count` leaf set to `step`: a fresh state
  that goes on with the learning rate schedule where the run is."""
  def set_count(path, leaf):
    last = path[-1] if path else None
    if getattr(last, "name", None) == "count":
      return jnp.full_like(leaf, step)
    return leaf
  return jax.tree_util.tree_map_with_path(set_count, opt_state)
