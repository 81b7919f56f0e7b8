"""The non-finite guard: what counts as diverged, and saying so in one line.

The training loop fetches each step's per-island loss and gradient norm one
step late (so the host never waits on the device) and hands them here; a NaN
or inf in any island is found at the step it is fetched. What the run does
then is `config.nonfinite`: 'stop' (the default) raises NonFiniteError,
'rollback' restores the last good checkpoint and skips the batches taken
since, at most `config.max_rollbacks` times. On the device, `all_finite`
and `islands_finite` tell the outer step which islands' pseudo-gradients it
must leave out.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

POLICIES = ("stop", "rollback")


class NonFiniteError(RuntimeError):
  """A step produced NaN or inf; the message names the step and island."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


def step_problem(step: int, losses, grad_norms) -> NonFiniteError | None:
  """The error for a step whose per-island loss or grad norm is not finite.

  Args:
    step: the inner step the values belong to.
    losses, grad_norms: one value per island (or a scalar).

  Returns:
    A NonFiniteError naming the step and the first such island, or None.
  """
  losses, grad_norms = np.atleast_1d(losses), np.atleast_1d(grad_norms)
  bad = ~(np.isfinite(losses) & np.isfinite(grad_norms))
  if not bad.any():
    return None
  island = int(np.argmax(bad))
  islands = "" if bad.sum() == 1 else f" (and {int(bad.sum()) - 1} more)"
  return NonFiniteError(
      f"step {step}: island {island}{islands} has loss {losses[island]} and "
      f"gradient norm {grad_norms[island]}", step)


def eval_problem(step: int, eval_loss: float) -> NonFiniteError | None:
  """The error for a non-finite eval loss of the global params, or None."""
  if math.isfinite(eval_loss):
    return None
  return NonFiniteError(
      f"step {step}: the eval loss of the global params is {eval_loss} "
      "(the outer step diverged)", step)


def state_problem(step: int, nonfinite_leaves: list[str]
                  ) -> NonFiniteError | None:
  """The error for a state about to be saved with non-finite leaves."""
  if not nonfinite_leaves:
    return None
  more = (f" and {len(nonfinite_leaves) - 1} more"
          if len(nonfinite_leaves) > 1 else "")
  return NonFiniteError(
      f"step {step}: the state holds NaN or inf in {nonfinite_leaves[0]}"
      f"{more}; it was not saved", step)


def all_finite(tree) -> jax.Array:
  """Whether every value of `tree` is finite (a scalar bool; traceable)."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf))
                            for leaf in jax.tree.leaves(tree)]))


def islands_finite(state) -> jax.Array:
  """[islands] bool: whether each island's params in a TrainState are all
  finite (the islands the outer step will include, weights permitting)."""
  return jax.vmap(all_finite)(state.island_params)
