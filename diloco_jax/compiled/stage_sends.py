"""Streaming DiLoCo on pipelined islands in a run: fragment s is stage s.

Each stage's send and merge (algorithm/stage_fragments.py) are compiled on
that stage's own devices and run on its part of the staged state, taken
out and put back without copying (parallel/stage_parts.py): a stage's
collective involves the same stage of the other islands only, while every
other stage goes on training. With outer_placement='host' the send runs on
the stage's outer device instead (`StageFragmentOuter`), and its merge
takes the stage's x back from there.
"""

import functools

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from diloco_jax.algorithm import fragments as fragments_lib
from diloco_jax.algorithm import island_sync as island_sync_lib
from diloco_jax.algorithm import stage_fragments
from diloco_jax.algorithm import state as state_lib
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel.outer_devices import move
from diloco_jax.parallel.stage_parts import (put_stage_part, stage_mesh,
                                             stage_part, stage_sharding,
                                             take_stage_part, with_stage_part)
from diloco_jax.compiled.outer_side import OuterSide


_OUTER_PARTS = ("global_params", "outer_opt_state", "residuals",
                "codec_state")  # fragments.FragmentParts' fields in order


def _field(state: state_lib.TrainState, name: str):
  """x, or the outer state's field `name`."""
  if name == "global_params":
    return state.global_params
  return getattr(state.outer, name)


def _with_fields(state: state_lib.TrainState,
                 values: dict) -> state_lib.TrainState:
  """`state` with x and outer state fields named as in _OUTER_PARTS."""
  values = dict(values)
  x = values.pop("global_params", state.global_params)
  return state.replace(global_params=x, outer=state.outer.replace(**values))


def outer_parts(state: state_lib.TrainState,
                stage: int) -> fragments_lib.FragmentParts:
  """Stage `stage`'s part of x, the outer state, the residuals and the
  codec state of a staged `state` (arrays, or abstract with shardings)."""
  return fragments_lib.FragmentParts(*(
      stage_part(_field(state, field), stage) for field in _OUTER_PARTS))


def take_outer_parts(state: state_lib.TrainState, stage: int):
  """(outer_parts(state, stage), rest) for put_outer_parts, taken before a
  program donates the parts."""
  taken = [take_stage_part(_field(state, field), stage)
           for field in _OUTER_PARTS]
  return (fragments_lib.FragmentParts(*(part for part, _ in taken)),
          [rest for _, rest in taken])


def put_outer_parts(state: state_lib.TrainState, rest,
                    parts: fragments_lib.FragmentParts
                    ) -> state_lib.TrainState:
  """`state` with the stage's outer parts (take_outer_parts's `rest`)
  replaced by `parts`."""
  return _with_fields(state, {
      field: put_stage_part(field_rest, part)
      for field, field_rest, part in zip(_OUTER_PARTS, rest, parts)})


def _shardings(tree):
  return jax.tree.map(lambda a: a.sharding, tree)


def _stage_send(outer, mesh, stage: int, rounding_seed, stripes):
  """Stage `stage`'s send (stage_fragments.make_stage_send) with its
  collective on the stage's own devices of `mesh`."""
  return stage_fragments.make_stage_send(
      outer, island_sync_lib.make_island_sync(
          stage_mesh(mesh, stage), outer.codec, rounding_seed,
          stripes=stripes), mesh.shape[mesh_lib.STAGE], stage)


def compile_sends(mesh, state, weights, *, outer, rounding_seed,
                  stripes: int) -> tuple:
  """Per stage, send(state, weights) -> state on the compute devices of
  `mesh`, compiled from the (abstract) staged `state` and `weights`;
  `outer` is the run's outer object."""
  sends = []
  for s in range(mesh.shape[mesh_lib.STAGE]):
    parts = outer_parts(state, s)
    program = jax.jit(
        _stage_send(outer, mesh, s, rounding_seed, stripes),
        donate_argnums=0, out_shardings=_shardings(parts))
    sends.append(functools.partial(_send, program.lower(
        parts, stage_part(state.island_params, s), stage_part(weights, s),
        stage_part(state.step, s)).compile(), s))
  return tuple(sends)


def _send(program, stage: int, state: state_lib.TrainState, weights):
  parts, rest = take_outer_parts(state, stage)
  parts = program(parts, stage_part(state.island_params, stage),
                  stage_part(weights, stage), stage_part(state.step, stage))
  return put_outer_parts(state, rest, parts)


def compile_merges(mesh, state, *, alpha: float,
                   inner_opt: optax.GradientTransformation) -> tuple:
  """Per stage, merge(state, x=None) -> state on the compute devices,
  compiled from the (abstract) staged `state`; `x`: the stage's part of x
  from the outer devices (outer_placement='host'), which replaces the
  state's first."""
  merges = []
  for s in range(mesh.shape[mesh_lib.STAGE]):
    islands = (stage_part(state.island_params, s),
               stage_part(state.inner_opt_state, s))
    program = jax.jit(stage_fragments.make_stage_merge(alpha, inner_opt),
                      donate_argnums=(1, 2), out_shardings=_shardings(islands))
    merges.append(functools.partial(_merge, program.lower(
        stage_part(state.global_params, s), *islands,
        stage_part(state.step, s)).compile(), s))
  return tuple(merges)


def _merge(program, stage: int, state: state_lib.TrainState, x=None):
  if x is not None:
    state = state.replace(
        global_params=with_stage_part(state.global_params, x, stage))
  island_params, island_rest = take_stage_part(state.island_params, stage)
  inner_opt_state, inner_rest = take_stage_part(state.inner_opt_state, stage)
  island_params, inner_opt_state = program(
      stage_part(state.global_params, stage), island_params, inner_opt_state,
      stage_part(state.step, stage))
  return state.replace(
      island_params=put_stage_part(island_rest, island_params),
      inner_opt_state=put_stage_part(inner_rest, inner_opt_state))


class StageFragmentOuter(OuterSide):
  """Streaming DiLoCo's sends on the outer devices, one fragment per stage:
  stage s's island params go to stage s's outer device, its collective and
  outer step run there while the islands train, and its merge takes the
  stage's x back (`fragment_x`). No outer device holds more than one
  stage."""

  def __init__(self, mesh, islands: int, compute_mesh, *, outer,
               rounding_seed: int | None, stripes: int, fsdp: bool):
    super().__init__(mesh, islands, compute_mesh, fsdp)
    self._stages = mesh.shape[mesh_lib.STAGE]
    self._programs = [_stage_send(outer, mesh, s, rounding_seed, stripes)
                      for s in range(self._stages)]
    self._compiled = None

  def _on_stage(self, stage: int, spec=P()) -> NamedSharding:
    return NamedSharding(stage_mesh(self.mesh, stage), spec)

  def _compile_all(self, outer, islands_state, weights) -> dict:
    compiled = []
    for s, program in enumerate(self._programs):
      parts = outer_parts(outer, s)
      compiled.append(jax.jit(
          program, out_shardings=_shardings(parts)).lower(
              # The islands' params arrive per stage (_island_trees).
              parts, stage_part(islands_state.island_params, s),
              jax.ShapeDtypeStruct(weights.shape, weights.dtype,
                                   sharding=self._on_stage(
                                       s, P(mesh_lib.ISLAND))),
              jax.ShapeDtypeStruct(islands_state.step.shape,
                                   islands_state.step.dtype,
                                   sharding=self._on_stage(s))).compile())
    return {"_compiled": compiled}

  @property
  def sends(self) -> tuple:
    """Per stage, send(state, weights) -> state: the stage's island params
    go out and its collective and outer step are queued on its outer
    device; the islands' side comes back unchanged."""
    return tuple(functools.partial(self._send_stage, s)
                 for s in range(self._stages))

  def _send_stage(self, stage: int, state: state_lib.TrainState,
                  weights: jax.Array) -> state_lib.TrainState:
    self._use_compiled()
    parts, rest = take_outer_parts(self._outer, stage)
    parts = self._compiled[stage](
        parts,
        move(stage_part(state.island_params, stage),
             self._on_stage(stage, P(mesh_lib.ISLAND, mesh_lib.STAGE))),
        move(weights, self._on_stage(stage, P(mesh_lib.ISLAND))),
        move(state.step, self._on_stage(stage)))
    self._outer = put_outer_parts(self._outer, rest, parts)
    return state

  def fragment_x(self, stage: int):
    """The stage's part of x on its compute devices, for its merge (it
    arrives once the stage's send is done)."""
    return move(stage_part(self._outer.global_params, stage),
                jax.tree.map(lambda s: stage_sharding(s, stage),
                             self._x_shardings))

  def current(self, state: state_lib.TrainState) -> state_lib.TrainState:
    """The islands' side with the outer side's x (waits for the sends in
    flight)."""
    return state.replace(global_params=self._x_on_compute())
