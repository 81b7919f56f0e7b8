"""One elastic island: its own JAX program, training a round from the x it
is given on its own rows of the run's data.

An island keeps only its inner optimizer state (and with a dense codec
its error-feedback residual) between rounds. Everything
else it is handed each round by the coordinator: x, and where its data
stream stands (the position after the last round it contributed to), so a
restarted island, or one whose round was left out, trains on exactly the
batches it has not contributed yet. A restarted island's inner optimizer
state starts fresh, counted from the round's first step (the learning
rate schedule goes on where the run is): its process's memory is gone,
and a state from its own last checkpoint would be rounds older than the
x it rejoins at.

Under Streaming DiLoCo an island keeps its own params too: a round
(round_steps.py) ends at a fragment's send, the island sends that fragment
(its params, or its pseudo-gradient encoded with a dense codec that
compresses) and trains on from its own params, merging each fragment the
coordinator stepped with the outer object's merge at the step the run's
schedule puts it. An island whose last result did not reach x (late, or
a new process) starts from x, as a restarted one does.
"""

import dataclasses
import functools
import os
import json
import pathlib
import signal
import socket
import threading
import time

import jax
import numpy as np
import ray

from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.algorithm import inner_step as inner_step_lib
from diloco_jax.algorithm import island_sync
from diloco_jax.algorithm import optimizers
from diloco_jax.algorithm import state as state_lib
from diloco_jax.compiled import model_loss
from diloco_jax.config import run_config as run_config_lib
from diloco_jax.config import state_spec as state_spec_lib
from diloco_jax.data import sources
from diloco_jax.elastic import payloads
from diloco_jax.elastic import round_steps
from diloco_jax.elastic import speeds
from diloco_jax.model import transformer as model_lib
from diloco_jax.parallel import mesh as mesh_lib


class IslandProgram:
  """Island `island` of an elastic run (a Ray actor's body).

  Args:
    run_config: the run's validated config (all islands).
    island: this island's index.
    workdir: the run's directory (for the kill markers of tests).
    kill_steps: {1-based round: inner step}: this island's process kills
      itself before that step of that round, once per run (tests and
      benchmarks of failures).
    slow_rounds: {1-based round: seconds}: this island sleeps that long
      before that round's first step (a straggler).
    speed: this island's inner steps take 1/speed as long (speeds.py's
      SpeedKnob: islands of unequal speeds, in tests and benchmarks).
    kill_after: rounds (1-based) right after whose result this island's
      process kills itself, once per run (tests of a restart between
      rounds).
  """

  def __init__(self, run_config: run_config_lib.RunConfig, island: int,
               workdir: str, kill_steps: dict[int, int] | None = None,
               slow_rounds: dict[int, float] | None = None,
               speed: float = 1.0, kill_after: tuple[int, ...] = ()):
    config = run_config.config
    self.island = island
    self._knob = speeds.SpeedKnob(speed)
    self._kill_steps = kill_steps or {}
    self._slow_rounds = slow_rounds or {}
    self._kill_after = set(kill_after)
    self._workdir = pathlib.Path(workdir)
    # One island's state: no codec state or residuals (the coordinator
    # keeps those), the run's mesh inside the island (data devices, FSDP,
    # pipeline stages), and the inner optimizer the SPMD runs build.
    run_spec = state_spec_lib.for_run(run_config)
    self._spec = dataclasses.replace(run_spec, islands=1, compression=None,
                                     error_feedback=False)
    self._build_fragments(run_config, run_spec)
    self._build_sender(run_config, run_spec)
    mesh = config.mesh
    self._mesh = mesh_lib.build_mesh(
        1, mesh.data, mesh.stage, jax.devices()[:mesh.data * mesh.stage])
    self._inner_step = inner_step_lib.make_inner_step(
        model_loss.loss_function(config, self._mesh), self._spec.inner_opt,
        self._mesh, microbatches=config.data.microbatches, fsdp=mesh.fsdp)
    self._build_conversions(config)
    self._batches = sources.make_batch_source(
        run_config.data, run_config.islands, config.data.batch_size,
        seed=config.data.seed, islands=range(island, island + 1))
    self._batch_sharding = jax.sharding.NamedSharding(self._mesh,
                                                      state_lib.BATCH_SPEC)
    self._state = None  # built at the first round, from that round's x
    self._inner_steps = run_config.diloco.inner_steps
    self._schedule = run_config.schedule
    self.tokens_per_step = (config.data.batch_size
                            * config.data.sequence_length)
    # This island's share of the corpus (times k: 1 for iid islands).
    weights = self._batches.island_token_weights()
    self.share = float(weights[island] * len(weights))

  def pid(self) -> int:
    """This island's process id (tests kill it)."""
    return os.getpid()

  def train_round(self, x, round_number: int, data_state: dict | None,
                  steps: int, last_applied: bool = False,
                  first_step: int | None = None,
                  schedule_at_run_step: bool = False) -> dict:
    """`steps` inner steps from x, on the batches after `data_state` (None:
    the stream's start). `last_applied`: whether this island's previous
    result reached x (its error-feedback residual then moves on; under
    streaming it trains on from its own params). `first_step`: the run's
    steps before the round (default: round_number - 1 rounds of H).
    `schedule_at_run_step`: the learning rate schedule counted from
    `first_step`, not from this island's own steps (a time-budgeted
    round's slower islands take fewer, speeds.py).

    Returns what the island sends (its params y, or with a dense codec
    that compresses, its encoded pseudo-gradient: host arrays; under
    streaming those of the fragments sent at the round's end), the
    stream position after the steps, the train losses, the tokens trained
    and the island's share of the corpus."""
    started_at = time.time()
    if first_step is None:
      first_step = (round_number - 1) * self._inner_steps
    if self._pending_residual is not None:
      if last_applied:
        self._residual = self._pending_residual
      self._pending_residual = None
    if data_state is not None:
      self._batches.restore(data_state)
    if self._state is None:
      self._state = self._fresh_state(x, first_step)
    elif self._streaming and last_applied:  # on from its own params
      self._merge(x, round_steps.merges_after_sends(self._schedule,
                                                    first_step))
    else:
      self._state = self._state.replace(island_params=self._island_params(x))
    if schedule_at_run_step:
      self._state = self._state.replace(inner_opt_state=(
          optimizers.with_step_counts(self._state.inner_opt_state,
                                      first_step)))
    time.sleep(self._slow_rounds.get(round_number, 0))
    losses, step_seconds = [], []
    for step in range(steps):
      if min(self._kill_steps.get(round_number, -1), steps - 1) == step:
        marker = (self._workdir
                  / f"killed_island_{self.island}_round_{round_number}")
        if not marker.exists():  # once: not again after the restart
          marker.touch()
          os.kill(os.getpid(), signal.SIGKILL)
      step_started = time.monotonic()
      batch = jax.device_put(self._batches.next_batch(), self._batch_sharding)
      self._state, metrics = self._inner_step(self._state, batch)
      # Waited for, so that the step's time is its own.
      losses.append(jax.block_until_ready(metrics["loss"]))
      if self._streaming:
        self._merge(x, round_steps.merges_before_sends(
            self._schedule, first_step + step + 1))
      self._knob.after_step(time.monotonic() - step_started)
      step_seconds.append(time.monotonic() - step_started)
    trained_at = time.time()
    if round_number in self._kill_after:
      self._kill_when_recorded(round_number)
    return {
        "island": self.island, "round": round_number,
        **self._sent(x, self._params(self._state.island_params),
                     round_number, first_step + steps),
        "data_state": self._batches.state(),
        "losses": [float(np.asarray(loss)[0]) for loss in losses],
        "tokens": steps * self.tokens_per_step, "share": self.share,
        "step_seconds": speeds.typical_step_seconds(step_seconds),
        # When the call began (wall clock: pipelined rounds begin before
        # the round before them closes).
        "started_at": started_at, "trained_at": trained_at,
        # Which process this is (its pid, host, IP and Ray node).
        "process": _process(),
        # The Ray node it runs on (None outside Ray: tests call it).
        "node": (ray.get_runtime_context().get_node_id()
                 if ray.is_initialized() else None)}

  def _kill_when_recorded(self, round_number: int) -> None:
    """Tests: SIGKILLs this process once per run, right after its result
    of `round_number` reached the coordinator (once the round's record is
    in WORKDIR/metrics.jsonl, on the coordinator's host) and before the
    coordinator sends its next call."""
    marker = (self._workdir
              / f"killed_island_{self.island}_after_round_{round_number}")
    if marker.exists():  # once: not again after the restart
      return
    marker.touch()
    metrics = self._workdir / "metrics.jsonl"

    def kill():
      deadline = time.monotonic() + 600
      while (time.monotonic() < deadline
             and not _recorded(metrics, round_number)):
        time.sleep(0.005)
      os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()

  def measure_step_seconds(self, x, steps: int = 3) -> float | None:
    """This island's seconds per inner step (its speed knob included),
    timed on a throwaway state from x and the stream's next batch, which
    stays next: what a time-budgeted run's first round is sized by. The
    first step compiles the inner step, which the rounds then reuse."""
    position = self._batches.state()
    batch = jax.device_put(self._batches.next_batch(), self._batch_sharding)
    self._batches.restore(position)
    state = self._fresh_state(x, 0)
    times = []
    for _ in range(steps):
      started = time.monotonic()
      state, metrics = self._inner_step(state, batch)
      jax.block_until_ready(metrics["loss"])
      self._knob.after_step(time.monotonic() - started)
      times.append(time.monotonic() - started)
    return speeds.typical_step_seconds(times[1:])  # the first compiles

  def _merge(self, x, fragments) -> None:
    """The outer object's merge of each of `fragments` from x into this
    island's params (streaming)."""
    for p in fragments:
      self._state = self._state.replace(
          island_params=self._merges[p](x, self._state.island_params))

  def _build_fragments(self, run_config, run_spec) -> None:
    """Streaming: the run's outer object and its state for one island,
    abstract (a merge reads its recipe, each leaf's fragment, only)."""
    self._streaming = run_config.streaming
    if self._streaming:
      self._outer = run_spec.outer
      self._outer_state = jax.eval_shape(
          lambda params: self._outer.init(params, 1),
          model_lib.param_shapes(run_config.config.model))
      self._assignment = self._outer_state.recipe.assignment

  def _build_sender(self, run_config, run_spec) -> None:
    """What the island sends: its params, or its pseudo-gradient encoded
    here with a dense codec that compresses (payloads.py), keeping its
    error-feedback residual (zero at a fresh start: a restarted island's
    residual is gone with its process)."""
    compression = run_spec.compression
    self._encodes = payloads.encoded_on_island(run_spec.outer)
    self._residual = self._pending_residual = None
    self._rounding_seed = run_config.diloco.rounding_seed
    shapes = model_lib.param_shapes(run_config.config.model)
    if not self._encodes:
      return
    if run_spec.error_feedback:
      # One flat residual of all params, or one per fragment.
      parts = ([shapes] if not self._streaming else
               [fragments_lib.select(shapes, self._assignment, p)
                for p in range(self._outer.overlap.num_fragments)])
      residuals = [np.zeros(sum(leaf.size for leaf in jax.tree.leaves(part)),
                            np.float32) for part in parts]
      self._residual = residuals if self._streaming else residuals[0]
    self._send = jax.jit(functools.partial(
        payloads.island_payload, codec=compression.dense,
        feedback_decay=compression.feedback_decay))

  def _sent(self, x, y, round_number: int, step: int) -> dict:
    """The result's payload part: {"params": y} or {"payload": ...}, and
    its bytes; under streaming each a dict, fragment -> that fragment's
    (the fragments the schedule sends after `step`)."""
    if self._streaming:
      return self._sent_fragments(x, y, round_number, step)
    if not self._encodes:
      params = jax.device_get(y)
      return {"params": params, "sent_bytes": payloads.nbytes(params)}
    payload, residual = self._send(x, y, self._residual,
                                   key=self._key(round_number))
    # Kept until the coordinator says whether this result reached x.
    self._pending_residual = (None if residual is None
                              else jax.device_get(residual))
    payload = jax.device_get(payload)
    return {"payload": payload, "sent_bytes": payloads.nbytes(payload)}

  def _sent_fragments(self, x, y, round_number: int, step: int) -> dict:
    """Streaming's payload part: per fragment sent after `step`, its
    leaves of y, or its pseudo-gradient encoded with its own residual."""
    select = lambda tree, p: fragments_lib.select(tree, self._assignment, p)
    sent = {}
    residuals = None if self._residual is None else list(self._residual)
    for p in round_steps.sends(self._schedule, step):
      if not self._encodes:
        sent[p] = jax.device_get(select(y, p))
        continue
      key = self._key(round_number)
      sent[p], residual = self._send(
          select(x, p), select(y, p),
          None if residuals is None else residuals[p],
          key=None if key is None else jax.random.fold_in(key, p))
      if residual is not None:
        residuals[p] = jax.device_get(residual)
    # Kept until the coordinator says whether this result reached x.
    self._pending_residual = residuals
    sent = jax.device_get(sent)
    return {"payload" if self._encodes else "params": sent,
            "sent_bytes": payloads.nbytes(sent)}

  def _key(self, round_number: int):
    """This island's stochastic rounding key for the round, or None."""
    return island_sync.rounding_key(self._rounding_seed, round_number,
                                    self.island)

  def _build_conversions(self, config) -> None:
    """The compiled moves between the coordinator's x (logical, host) and
    the island's state (staged over its stages, placed on its mesh)."""
    spec, layout = self._spec, self._spec.layout
    logical = spec.abstract(config.model)
    shardings = state_lib.state_shardings(
        jax.eval_shape(spec.staged, logical), self._mesh, config.mesh.fsdp)
    # A fresh state at x, a restarted or joining island's: its optimizer
    # counted from the round's first step, so the learning rate schedule
    # goes on where the run is (as the SPMD runs restart an island).
    def fresh_state(x, step):
      state = spec.staged(spec.init(x))
      return state.replace(inner_opt_state=optimizers.with_step_counts(
          state.inner_opt_state, step))

    self._fresh_state = jax.jit(fresh_state, out_shardings=shardings)

    def island_params(x):
      stacked = state_lib.stack_islands(x, 1)
      return stacked if layout is None else jax.vmap(layout.split)(stacked)

    def params(staged):
      one = jax.tree.map(lambda a: a[0], staged)
      return one if layout is None else layout.join(one,
                                                    logical.global_params)

    self._island_params = jax.jit(island_params,
                                  out_shardings=shardings.island_params)
    if self._streaming:  # per fragment, the outer object's merge
      outer, outer_state = self._outer, self._outer_state
      self._merges = [jax.jit(
          lambda x, islands, p=p: outer.merge(x, islands, outer_state,
                                              fragment=p),
          out_shardings=shardings.island_params)
                      for p in range(outer.overlap.num_fragments)]
    self._params = jax.jit(params)


def _process() -> dict:
  """Which process this is: its pid, host name, and under Ray its node's
  IP and id (None outside Ray: tests call islands directly)."""
  under_ray = ray.is_initialized()
  return {"pid": os.getpid(), "host": socket.gethostname(),
          "ip": ray.util.get_node_ip_address() if under_ray else None,
          "node": (ray.get_runtime_context().get_node_id() if under_ray
                   else None)}


def _recorded(metrics: pathlib.Path, round_number: int) -> bool:
  """Whether the run's metrics.jsonl has the record of `round_number`."""
  try:
    lines = metrics.read_text().splitlines()
  except OSError:
    return False
  for line in lines:
    try:
      if json.loads(line).get("round") == round_number:
        return True
    except (ValueError, AttributeError):  # a line being written
      pass
  return False
