"""Small shared builders for the tests."""

import fcntl
import functools
import os
import re
import struct
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax.algorithm import inner_step as inner_step_lib
from diloco_jax.algorithm import outer_settings
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.compiled import programs as programs_lib
from diloco_jax.config import schema as config_schema
from diloco_jax.model import transformer as model_lib
from diloco_jax.parallel import mesh as mesh_lib


def tiny_model_config(vocab_size: int = 33):
  config = config_schema.base_config().model
  config.vocab_size = vocab_size
  config.num_layers = 1
  config.d_model = 16
  config.num_heads = 2
  config.head_dim = 8
  config.mlp_dim = 32
  config.max_sequence_length = 16
  return config


def tiny_problem(seed: int = 0, vocab_size: int = 33):
  """(params, loss_fn) for a one-layer model; loss_fn(params, sequences)."""
  model_config = tiny_model_config(vocab_size)
  graphdef, params = model_lib.init_params(model_config, seed)
  return params, functools.partial(model_lib.next_token_loss, graphdef)


def random_batches(num_steps: int, islands: int, batch_size: int,
                   seq_len: int = 8, vocab_size: int = 33, seed: int = 0):
  """[num_steps, islands, batch, seq_len + 1] int32 token batches."""
  rng = np.random.default_rng(seed)
  return rng.integers(0, vocab_size,
                      (num_steps, islands, batch_size, seq_len + 1),
                      dtype=np.int32)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
  jax.tree.map(
      lambda x, y: np.testing.assert_allclose(
          np.asarray(x), np.asarray(y), rtol=rtol, atol=atol), a, b)


def assert_trees_close_but_few(a, b, atol, outlier_atol,
                               max_outlier_fraction=1e-3):
  """Every leaf within `atol`, except at most `max_outlier_fraction` of its
  elements, which must still be within `outlier_atol`.

  For runs of Adam whose gradients are summed in another order: where a
  gradient cancels to its rounding level, Adam's normalized step can turn
  a last-bit difference into a step of up to ~lr, even of the other sign,
  on those few parameters (how few depends on the CPU's vector width).
  """
  def check(x, y):
    x, y = np.asarray(x), np.asarray(y)
    np.testing.assert_allclose(x, y, rtol=0, atol=outlier_atol)
    far = np.abs(x - y) > atol
    assert far.mean() <= max_outlier_fraction, (
        f"{far.sum()} of {far.size} elements differ by more than {atol} "
        f"(max {np.abs(x - y).max():.3g})")
  jax.tree.map(check, a, b)


def small_data_config(**overrides):
  """config.data with the schema's fields and a tiny synthetic corpus."""
  config = config_schema.base_config().data
  config.corpus = "synthetic"
  config.sequence_length = 16
  config.synthetic.update(vocab_size=8, concentration=0.5, num_documents=64,
                          document_length=63, validation_documents=8)
  config.update(overrides)
  return config


def collective_types(hlo: str, ops: str = "all-to-all|all-gather|all-reduce"):
  """The result types of the cross-device collectives in HLO text, e.g.
  's8[1,24]' or, for a collective over several operands, '(u16[1,3],
  f32[1,3])'."""
  pattern = re.compile(r"=\s*(.*?)\s+(?:" + ops + r")(?:-start)?\(")
  return [match.group(1) for match in map(pattern.search, hlo.splitlines())
          if match]


def assert_compressed_one_program(hlo: str, wire_type: str = "s8[") -> None:
  """Checks a compiled outer step's HLO text: `wire_type` values cross the
  link, no large float32 collective does, and nothing leaves the program
  (no host callbacks, send/recv, infeed/outfeed)."""
  wire_types = " ".join(collective_types(hlo))
  assert wire_type in wire_types, wire_types
  assert not re.search(r"f32\[\d{3,}", wire_types), wire_types
  assert "callback" not in hlo
  assert "send(" not in hlo and "recv(" not in hlo
  assert "infeed" not in hlo and "outfeed" not in hlo


def state_after_one_inner_step(islands: int, compression=None,
                               error_feedback: bool = False):
  """The tiny problem on `islands` islands after one inner step (Adam 1e-2).

  Returns (state, outer_step, weights): the sharded state, the jitted outer
  step (outer SGD lr 1, through `compression`) and equal island weights.
  """
  params, loss_fn = tiny_problem()
  params = jax.tree.map(np.array, params)
  inner_opt, outer_opt = optax.adam(1e-2), optax.sgd(1.0)
  mesh = mesh_lib.build_mesh(islands)
  state = outer_settings.init_state(params, inner_opt, outer_opt, islands,
                                    error_feedback, compression)
  state = jax.device_put(state, state_lib.state_shardings(state, mesh))
  batch = jax.device_put(random_batches(1, islands, 2)[0],
                         NamedSharding(mesh, state_lib.BATCH_SPEC))
  state, _ = inner_step_lib.make_inner_step(loss_fn, inner_opt, mesh)(state, batch)
  weights = jax.device_put(jnp.ones(islands),
                           NamedSharding(mesh, P("island")))
  return state, outer_step_lib.make_outer_step(outer_opt, mesh, compression), weights


def run_rounds(state, inner_step, outer_step, weights, batches, mesh,
               inner_steps: int):
  """Runs len(batches) inner steps, an outer step after every inner_steps
  (none when outer_step is None).

  Returns:
    (state, losses [steps, islands], grad_norms [steps, islands]).
  """
  losses, grad_norms = [], []
  for step, batch in enumerate(batches, start=1):
    batch = jax.device_put(batch, NamedSharding(mesh, state_lib.BATCH_SPEC))
    state, metrics = inner_step(state, batch)
    losses.append(np.asarray(metrics["loss"]))
    grad_norms.append(np.asarray(metrics["grad_norm"]))
    if outer_step is not None and step % inner_steps == 0:
      state = outer_step(state, weights)
  return state, np.array(losses), np.array(grad_norms)


def shared_run(name: str, config) -> tuple[str, dict]:
  """Trains `config` once per test run, in the run's shared folder
  (conftest.py), as (workdir, summary): pytest-xdist's processes share
  it. The first to ask trains it under a file lock, the others wait and
  read its summary (a finished run's workdir returns it at once)."""
  from diloco_jax.run import train  # pylint: disable=g-import-not-at-top
  shared = os.path.join(os.environ["DILOCO_JAX_TEST_SHARED"], "runs")
  os.makedirs(shared, exist_ok=True)
  workdir = os.path.join(shared, name)
  with open(f"{workdir}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    return workdir, train.train_and_evaluate(config, workdir)


def with_overrides(config, overrides: dict):
  """Sets `config`'s dotted fields, e.g. {'diloco.islands': 4}; returns it."""
  return config_schema.override(config, overrides)


def wrap_inner_step(monkeypatch, wrapper):
  """Runs every compiled inner step of the runs that follow as
  wrapper(inner_step, state, batch), e.g. to inject a fault or a signal at
  a given call."""
  real = programs_lib.compile_programs

  def compile_programs(*args, **kwargs):
    programs = real(*args, **kwargs)
    return programs._replace(inner_step=functools.partial(
        wrapper, programs.inner_step))

  monkeypatch.setattr(programs_lib, "compile_programs", compile_programs)


def check_islands_leave_the_outer_step_at_x(codec, half_step: float,
                                            islands: int = 4):
  """One outer step through `codec` (outer SGD lr 1: x becomes the mean):
  every island ends at the new x, bit for bit, and x lies within the
  codec's rounding of the islands' exact average. `half_step` is the
  codec's largest rounding error as a fraction of its block's absmax
  (int8: 1/254); each island's weighted pseudo-gradient is rounded once
  and their sum once more, each block's absmax at most the largest value
  sent. Returns the compiled step's HLO text (to check what crossed the
  link)."""
  state, outer, weights = state_after_one_inner_step(islands, codec)
  hlo = outer.lower(state, weights).compile().as_text()
  x_before = jax.device_get(state.global_params)
  y = jax.device_get(state.island_params)
  state = outer(state, weights)
  new_y = jax.device_get(state.island_params)
  x = jax.device_get(state.global_params)
  for i in range(islands):
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[i], b),
                 new_y, x)
  exact = jax.tree.map(lambda a: a.mean(axis=0), y)
  largest = lambda tree: max(float(np.abs(leaf).max())
                             for leaf in jax.tree.leaves(tree))
  sent = sum(largest(jax.tree.map(lambda b, a: (b - a[i]) / islands,
                                  x_before, y)) for i in range(islands))
  first = half_step * sent
  mean = largest(jax.tree.map(np.subtract, x_before, exact))
  # x = x_before - mean rounds to x's float32 spacing.
  bound = first + half_step * (mean + first) + float(
      np.spacing(np.float32(largest(x))))
  assert_trees_close(x, exact, rtol=0, atol=bound)
  return hlo


def wait_for(predicate, process, timeout=240):
  """Polls `predicate` until it holds; AssertionError (with the process's
  stderr tail) if `process` ends or `timeout` passes first."""
  deadline = time.time() + timeout
  while time.time() < deadline and process.poll() is None:
    if predicate():
      return
    time.sleep(0.01)
  raise AssertionError("the run ended or timed out first: "
                       + process.communicate()[1][-2000:])


def tensorboard_points(workdir: str, tag: str) -> dict:
  """{step: value} as TensorBoard shows `tag` in workdir/tensorboard: a
  SessionLog START at step s (a resumed run's purge) hides the points at s
  and after that were written before it."""
  # pylint: disable-next=g-import-not-at-top
  from tensorboardX.proto import event_pb2
  points = {}
  directory = os.path.join(workdir, "tensorboard")
  for name in sorted(os.listdir(directory)):  # TensorBoard's order
    with open(os.path.join(directory, name), "rb") as f:
      data = f.read()
    offset = 0
    while offset < len(data):
      (length,) = struct.unpack("<Q", data[offset:offset + 8])
      event = event_pb2.Event.FromString(
          data[offset + 12:offset + 12 + length])
      offset += 12 + length + 4
      if event.session_log.status == event_pb2.SessionLog.START:
        points = {s: v for s, v in points.items() if s < event.step}
      for value in event.summary.value:
        if value.tag == tag:
          points[event.step] = value.simple_value
  return points
