"""Pipeline-parallel islands (config.mesh.stage > 1) and the dual optimizer.

An island of S stages computes what an island of one stage computes; only
the order of float additions changes. The pipelined loss averages the same
per-position losses per microbatch and per stage before the whole mean
(one stage's: all at once), and the gradients' sums over positions and
microbatches group the same terms otherwise, so losses and gradients agree
to float32 reassociation (measured: at most 3.4e-7 apart, for values of
order 1). AdamW divides by sqrt(nu), which turns such last-bit differences
of small gradients into ~1e-6 differences of the params after a few steps
(as FSDP's test measures for its own reassociation).
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import pipeline as pipeline_config
from configs import tiny
from diloco_jax.algorithm import compression as compression_lib
from diloco_jax.algorithm import inner_step as inner_step_lib
from diloco_jax.algorithm import outer_step as outer_step_lib
from diloco_jax.algorithm import state as state_lib
from diloco_jax.analysis import link_bytes
from diloco_jax.codecs import dense as codecs
from diloco_jax.compiled import model_loss
from diloco_jax.config import run_config
from diloco_jax.config import state_spec
from diloco_jax.config import validation
from diloco_jax.model import transformer as model_lib
from diloco_jax.parallel import mesh as mesh_lib
from diloco_jax.parallel.mesh import STAGE
from diloco_jax.parallel import pipeline
from diloco_jax.parallel import placement
from diloco_jax.parallel import stages as stages_lib
from diloco_jax.run import setup as setup_lib
from diloco_jax.run import start as start_lib
from diloco_jax.run import train
from diloco_jax.storage import checkpoints as checkpoints_lib
from tests import helpers
from tests import test_checkpoint

# Params after a few rounds: reassociation, grown by Adam (see above).
PARAMS_RTOL, PARAMS_ATOL = 1e-4, 1e-5
# Losses: the same mean in another order.
LOSS_RTOL = 1e-5


# The layout: logical <-> staged.


def _model_config(num_layers=8, tie=True):
  config = helpers.tiny_model_config()
  config.num_layers = num_layers
  config.tie_embeddings = tie
  return config


@pytest.mark.parametrize("stages,repeats", [(2, 1), (4, 1), (2, 2), (4, 2)])
def test_staging_is_data_movement_only(stages, repeats):
  """Logical -> staged -> logical gives back every bit, for params and an
  optimizer state's counts; each stage holds its chunks' layers."""
  model = _model_config(num_layers=8, tie=False)
  _, params = model_lib.init_params(model, 0)
  layout = stages_lib.StageLayout(stages, repeats, 8)
  tree = {"params": params, "count": jnp.int32(7)}
  staged = layout.split(tree)
  assert int(staged["count"].shape[0]) == stages
  back = layout.join(staged, tree)
  jax.tree.map(np.testing.assert_array_equal, back, tree)
  chunk = 8 // (stages * repeats)
  for stage in range(stages):
    assert layout.stage_layers(stage) == [
        (r * stages + stage) * chunk + i
        for r in range(repeats) for i in range(chunk)]
    first = layout.stage_layers(stage)[0]
    np.testing.assert_array_equal(
        staged["params"]["blocks"][0]["mlp"]["up"]["kernel"][stage],
        params["blocks"][first]["mlp"]["up"]["kernel"])
  # The embedding is cut into one piece per stage: one copy in all.
  embedding = staged["params"]["embed"]["embedding"]
  assert embedding.size == params["embed"]["embedding"].size
  assert embedding.shape[0] == stages


# The schedules: the same loss and gradients as one stage.


def _plain_loss_and_grads(model, params, sequences):
  loss_fn = functools.partial(model_lib.next_token_loss,
                              model_lib.graphdef(model))
  return jax.jit(jax.value_and_grad(loss_fn))(params, sequences)


def _pipelined_loss_and_grads(model, params, sequences, stages, repeats,
                              microbatches):
  config = tiny.get_config()
  config.model = model
  config.mesh.stage = stages
  config.pipeline.microbatches = microbatches
  config.pipeline.schedule = "circular" if repeats > 1 else "gpipe"
  config.pipeline.repeats = repeats
  mesh = mesh_lib.build_mesh(1, 1, stages)
  layout = stages_lib.StageLayout(stages, repeats, model.num_layers)
  loss_fn = model_loss.loss_function(config, mesh)
  staged = jax.device_put(layout.split_params(params),
                          NamedSharding(mesh, P(STAGE)))
  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(staged, sequences)
  return loss, layout.join_params(grads, params)


@pytest.mark.slow
@pytest.mark.parametrize("stages,repeats,microbatches,tie,remat", [
    (2, 1, 4, True, False), (2, 2, 2, False, False), (4, 1, 4, False, False),
    (4, 2, 4, True, True),
], ids=["gpipe-S2-M4-tied", "circular-S2-R2-M2", "gpipe-S4-M4",
        "circular-S4-R2-M4-tied-remat"])
def test_every_schedule_gives_the_gradients_of_one_stage(
    stages, repeats, microbatches, tie, remat):
  """Tied embeddings stay tied: one copy, cut over the stages; the lookup
  on the first stage and every stage's head add their gradients into it
  (the transpose of gathering its pieces), as one stage's autodiff does."""
  model = _model_config(num_layers=8, tie=tie)
  model.remat = remat
  _, params = model_lib.init_params(model, 0)
  sequences = jnp.asarray(np.random.default_rng(0).integers(
      0, model.vocab_size, (8, 9)), jnp.int32)
  loss, grads = _plain_loss_and_grads(model, params, sequences)
  staged_loss, staged_grads = _pipelined_loss_and_grads(
      model, params, sequences, stages, repeats, microbatches)
  assert float(staged_loss) == pytest.approx(float(loss), rel=LOSS_RTOL)
  helpers.assert_trees_close(staged_grads, grads, rtol=1e-5, atol=1e-6)


def test_bubble_fraction_and_ticks():
  assert pipeline.bubble_fraction(4, 12) == pytest.approx(3 / 15)
  assert pipeline.bubble_fraction(4, 12, repeats=2) == pytest.approx(3 / 27)
  assert pipeline.num_ticks(4, 8, 2) == 19


def test_the_hand_off_is_one_ppermute_and_sends_only_neighbours():
  """The stages' values move by a collective-permute: no all-gather of the
  activations between stages."""
  mesh = mesh_lib.build_mesh(1, 1, 4)
  x = jax.device_put(jnp.arange(4.0 * 6).reshape(4, 6),
                     NamedSharding(mesh, P(STAGE)))
  hand_off = jax.jit(lambda v: stages_lib.hand_off(v, mesh))
  np.testing.assert_array_equal(hand_off(x), np.roll(np.asarray(x), 1, 0))
  hlo = hand_off.lower(x).compile().as_text()
  assert "collective-permute" in hlo and "all-gather" not in hlo


# Memory: each stage keeps its own layers and both optimizer states.


def _per_device_state_bytes(stages: int) -> int:
  config = tiny.get_config()
  config.model.update(num_layers=8, d_model=64, num_heads=4, head_dim=16,
                      mlp_dim=256)
  config.mesh.stage = stages
  spec = state_spec.for_config(config)
  abstract = jax.eval_shape(spec.staged, spec.abstract(config.model))
  mesh = mesh_lib.build_mesh(config.diloco.islands, 1, stages)
  placed = placement.with_shardings(
      abstract, state_lib.state_shardings(abstract, mesh))
  return stages_lib.bytes_per_device(
      [placed.global_params, placed.outer.outer_opt_state, placed.island_params,
       placed.inner_opt_state])


def test_four_stages_hold_under_a_third_of_the_state_per_device():
  """Params, inner and outer optimizer states per device, read from the
  arrays' shardings: x and the outer state too are split over the stages
  (DiLoCoX's dual optimizer), where one stage replicates x on every
  device."""
  one, four = _per_device_state_bytes(1), _per_device_state_bytes(4)
  assert four <= 0.3 * one, (four, one)


# Whole runs at S > 1 equal S = 1.


def _config(stages: int, **overrides):
  config = tiny.get_config()
  config.model.num_layers = 4
  config.data.batch_size = 8
  config.mesh.stage = stages
  return helpers.with_overrides(config, overrides)


_RUNS = {
    # DiLoCo with an island that diverges and syncs that are dropped (each
    # stage must leave the same islands out), under the overlap that keeps
    # each island's progress (an update in flight and anchors per stage).
    "diloco": {"testing.nan_island": "1@2", "diloco.drop_probability": 0.25,
               "diloco.overlap": "one_step_delay_rebase"},
    # Eager updates: each stage steps its islands' own outer points with
    # their own outer states, per stage (after a round of warm-up).
    # (One layer per stage: compiling grows with the layers, measured
    # 18.6 s a run with 2 against 31.5 s with 4.)
    "eager": {"testing.nan_island": "1@2", "diloco.drop_probability": 0.25,
              "diloco.overlap": "eager", "diloco.overlap_warmup_rounds": 1,
              "model.num_layers": 2},
    # From a pretrained worker: the warm start reads a logical checkpoint
    # into the stages.
    "ddp": {"mode": "ddp", "pretrain_steps": 4, "model.num_layers": 2},
}
_STAGED = {
    "S2": {},
    "S2-data2-fsdp": {"mesh.data": 2, "mesh.fsdp": True},
    "S4": {"pipeline.microbatches": 4},
}


@pytest.fixture(scope="module")
def runs():
  """Lazily run configs, once per test run (helpers.shared_run):
  runs(name, stages, staged_name) -> (workdir, summary)."""

  def run(name, stages, staged=None):
    config = _config(stages, **_RUNS[name], **_STAGED.get(staged, {}))
    return helpers.shared_run("_".join(map(str, ("pipeline", name, stages,
                                                 staged))), config)

  return run


# DiLoCo at S = 2 runs with FSDP islands (data 2): its stages and FSDP
# in one run; the other modes at S = 2 without FSDP. (S = 4: its loss and
# gradients above, its state read back below; the steps are the same
# per-stage code for any S.)
@pytest.mark.slow
@pytest.mark.parametrize("name,stages,staged", [
    ("diloco", 2, "S2-data2-fsdp"), ("eager", 2, "S2"), ("ddp", 2, "S2"),
])
def test_a_pipelined_run_equals_one_stage(runs, name, stages, staged):
  reference, reference_summary = runs(name, 1)
  workdir, summary = runs(name, stages, staged)
  helpers.assert_trees_close(test_checkpoint._final_state(workdir),
                             test_checkpoint._final_state(reference),
                             rtol=PARAMS_RTOL, atol=PARAMS_ATOL)
  records = test_checkpoint._metrics(workdir)
  reference_records = test_checkpoint._metrics(reference)
  # Both runs wrote every step once, and their evals at the same steps:
  # the pairwise comparison below then covers every record.
  steps = list(range(1, reference_summary["total_steps"] + 1))
  assert [r["step"] for r in reference_records] == steps
  assert [r["step"] for r in records] == steps
  for a, b in zip(records, reference_records, strict=True):
    assert a["train_loss"] == pytest.approx(b["train_loss"], rel=LOSS_RTOL)
    assert ("eval_loss" in a) == ("eval_loss" in b), a["step"]
    if "eval_loss" in b:
      assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=LOSS_RTOL)
  assert summary["total_steps"] == reference_summary["total_steps"]
  assert summary["final_eval_loss"] == pytest.approx(
      reference_summary["final_eval_loss"], rel=LOSS_RTOL)
  if name == "diloco":
    assert summary["rounds"] == reference_summary["rounds"]


@pytest.mark.parametrize("stages", [2, 4])
def test_per_stage_collectives_count_what_one_stage_sends(stages):
  """Each stage reduces its own layers across the islands; in float32
  together they send the bytes of one stage's collective, plus each
  stage's psum of the island weights (8 bytes a sync at k = 2). A dense
  codec's chunks are padded per stage: within 2% on this tiny model."""
  config = _config(stages, **{"diloco.codec": "int8"})
  shapes = model_lib.param_shapes(config.model)
  layout = state_spec.for_config(config).layout
  count = lambda codec, layout: link_bytes.LinkBytes(
      config, shapes, 2, compression_lib.as_compression(codec),
      layout).sync(None)
  fp32, int8 = None, codecs.DenseCodec("int8", 256)
  assert count(fp32, layout) == count(fp32, None) + 8 * (stages - 1)
  assert count(int8, layout) == pytest.approx(count(int8, None), rel=0.02)


def test_a_run_counts_every_stage_s_bytes(runs):
  """ddp all-reduces each stage's gradient every step after pretraining
  (one worker sends nothing): 8 bytes a step more than one stage, for the
  second stage's weight psum."""
  _, one = runs("ddp", 1)
  _, two = runs("ddp", 2, "S2")
  ddp_steps = one["total_steps"] - _RUNS["ddp"]["pretrain_steps"]
  assert two["comm_bytes"] == one["comm_bytes"] + ddp_steps * 8


def _replica_groups(line: str, num_devices: int) -> list[list[int]]:
  """The device groups of an HLO collective: listed ({{0,2},{1,3}}) or
  as an iota ([2,2]<=[4], with a transpose: [2,2]<=[2,2]T(1,0))."""
  listed = re.search(r"replica_groups=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}",
                     line)
  if listed:
    return [[int(d) for d in group.split(",")]
            for group in re.findall(r"\{([\d,]+)\}", listed.group(1))]
  iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\]"
                   r"(?:T\(([\d,]+)\))?", line)
  assert iota, line[-300:]
  shape = [int(d) for d in iota.group(1).split(",")]
  dims = [int(d) for d in iota.group(2).split(",")]
  ids = np.arange(num_devices).reshape(dims)
  if iota.group(3):
    ids = ids.transpose([int(d) for d in iota.group(3).split(",")])
  return ids.reshape(shape).tolist()


# int8: the dense codec's all-gathers of each stage's encoded chunks. Left
# to XLA's partitioner (the 'stage' axis auto inside the islands'
# shard_map), they were gathered over the stages first, and every device
# sent both stages' chunks over the island link (measured on shaped links:
# 2.1x the bytes counted).
@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_each_stage_reduces_only_among_the_devices_holding_it(codec):
  """Every collective of the outer step stays among the devices of one
  stage, and one that crosses islands takes one device per island
  (scalars aside: the islands' weights, whether any took part, whether
  every stage was finite)."""
  config = _config(2, **{"diloco.codec": codec})
  setup = setup_lib.build(validation.validate_config(config, 8),
                          jax.devices())
  outer = outer_step_lib.make_outer_step(setup.spec.outer_opt, setup.mesh,
                                         setup.spec.compression,
                                         inner_opt=setup.spec.inner_opt)
  hlo = outer.lower(setup.steps_state, setup.weights_shape).compile(
  ).as_text()
  where = {device.id: (index[0], index[2]) for index, device in
           np.ndenumerate(setup.mesh.devices)}  # (island, stage)
  crossing = 0
  for line in hlo.splitlines():
    collective = re.search(r"= (.*?) (all-reduce|all-gather|all-to-all|"
                           r"reduce-scatter)(-start)?\(", line)
    if not collective or max(  # its largest operand's elements
        np.prod([int(d) for d in dims.split(",") if d])
        for dims in re.findall(r"\[([\d,]*)\]", collective.group(1))) <= 1:
      continue
    for group in _replica_groups(line, setup.mesh.devices.size):
      assert len({where[d][1] for d in group}) == 1, line[-300:]
      if len({where[d][0] for d in group}) > 1:  # over the island link
        assert len(group) == config.diloco.islands, line[-300:]
        crossing += 1
  assert crossing


@pytest.mark.slow
def test_resume_with_another_stage_count_goes_on_as_the_run_would(
    runs, tmp_path):
  """Checkpoints hold the logical state: a run saved at S = 2 (with FSDP
  islands) resumes at S = 1 (with a mean in flight and the islands'
  anchors, without FSDP) and ends where the S = 2 run ended (to
  reassociation)."""
  whole, _ = runs("diloco", 2, "S2-data2-fsdp")
  resumed = str(tmp_path / "resumed")
  test_checkpoint.forget_after(whole, resumed, 4)
  summary = train.train_and_evaluate(_config(1, **_RUNS["diloco"]), resumed)
  assert summary["resumed_from_step"] == 4
  helpers.assert_trees_close(test_checkpoint._final_state(resumed),
                             test_checkpoint._final_state(whole),
                             rtol=PARAMS_RTOL, atol=PARAMS_ATOL)


@pytest.mark.slow
def test_a_checkpoint_reads_back_exactly_at_another_stage_count(runs):
  """The S = 2 run's last checkpoint (FSDP islands), restored for S = 4,
  laid out for that run's steps and back: every bit of what was saved."""
  whole, _ = runs("diloco", 2, "S2-data2-fsdp")
  config = _config(4, **_RUNS["diloco"], **_STAGED["S4"])
  setup = setup_lib.build(validation.validate_config(config, 8),
                          jax.devices())
  checkpointer = checkpoints_lib.Checkpointer(whole, read_only=True)
  start = start_lib.restore(setup, checkpointer, compare_config=False)
  checkpointer.close()
  round_trip = setup.whole(setup.islands_side(start.state))
  saved = test_checkpoint._final_state(whole)
  fields = [(name, getattr(round_trip, name), value)
            for name, value in saved.items() if name != "outer"]
  fields += [(f"outer.{name}", getattr(round_trip.outer, name), value)
             for name, value in saved["outer"].items()]
  for name, tree, value in fields:
    # The checkpoint reads back as dicts: compare leaf by leaf, in order.
    ours, theirs = jax.tree.leaves(tree), jax.tree.leaves(value)
    assert len(ours) == len(theirs), name
    for a, b in zip(ours, theirs):
      np.testing.assert_array_equal(np.asarray(a), b, err_msg=name)


def _factored_steps(workdir, config):
  """What one round moved each factored matrix by (x after it minus x at
  initialization), [stages, rows, cols] in the codec state's order (the
  leaves of a stage's params of rank >= 2, as init_codec_state orders
  them), and the bases the checkpoint keeps for them, [stages, cols, r]."""
  saved = test_checkpoint._final_state(workdir)
  initial = jax.jit(lambda seed: model_lib.new_params(config.model, seed))(
      config.seed)
  moved = jax.tree.unflatten(jax.tree.structure(initial), [
      np.asarray(after) - np.asarray(before) for after, before in zip(
          jax.tree.leaves(saved["global_params"]),
          jax.tree.leaves(initial), strict=True)])
  layout = run_config.stage_layout(config)
  if layout is None:
    steps = [m[None] for m in jax.tree.leaves(moved) if m.ndim >= 2]
  else:
    steps = [np.asarray(m) for m in jax.tree.leaves(
        layout.split_params(moved)) if m.ndim >= 3]
  bases = [np.asarray(entry["basis"]).reshape(
      (len(steps[0]),) + entry["basis"].shape[-2:])
           for entry in saved["outer"]["codec_state"]]
  assert len(steps) == len(bases)
  return saved, steps, bases


@pytest.mark.slow
def test_a_codec_with_state_keeps_one_per_stage(tmp_path):
  """Adaptive low rank with error feedback, one round on two stages. Every
  stage factors its own matrices, with its own bases and ranks in the
  checkpoint (stacked by stage): each matrix's outer step, whose rows are
  spanned by the round's coefficients, lies in the span of the next basis
  its own stage kept (lowrank.next_basis); another stage's basis leaves
  most of it outside. The residuals are the params' shape, and the run
  sends what a low-rank codec sends. (The same codec on one stage, and
  its bytes, are tests/test_structured_codecs.py's.)"""
  overrides = {"diloco.codec": "adaptive_lowrank",
               "diloco.lowrank.min_rank": 2, "diloco.lowrank.max_rank": 8,
               "diloco.error_feedback": True, "total_steps": 4,
               "model.num_layers": 2}
  stages = 2
  config = _config(stages, **overrides)
  workdir = str(tmp_path / "lowrank")
  summary = train.train_and_evaluate(config, workdir)
  state, steps, bases = _factored_steps(workdir, config)
  for step, basis in zip(steps, bases, strict=True):
    assert basis.shape[0] == stages
    for stage in range(stages):
      rows = step[stage].reshape(-1, basis.shape[1])
      # The part of the step outside a basis's span, relative to it.
      outside = lambda b, rows=rows: float(
          np.abs(rows - rows @ b @ b.T).max() / np.abs(rows).max())
      # x's float32 rounding (6e-8 at |x| ~ 1) is ~5e-5 of a step of
      # ~1e-3 (measured); a basis of another matrix leaves 60-130% out.
      assert outside(basis[stage]) <= 1e-3, (stage, outside(basis[stage]))
      other = outside(basis[1 - stage])
      assert other > 0.1, ("the other stage's basis holds it", other)
  assert all(np.size(entry["rank_index"]) == stages
             for entry in state["outer"]["codec_state"])
  residuals = jax.tree.leaves(state["outer"]["residuals"])
  assert ([r.shape for r in residuals]
          == [y.shape for y in jax.tree.leaves(state["island_params"])])
  # Error feedback keeps what a rank-2..8 factoring left out of each
  # matrix for the next round: never all zero after a round.
  assert all(np.abs(r).max() > 0 for r in residuals if np.ndim(r) >= 3)
  assert summary["compression_vs_fp32"] > 4


@pytest.mark.parametrize("overrides,message", [
    ({"model.num_layers": 3}, "does not split into config.mesh.stage"),
    ({"model.d_model": 33}, "model.d_model=33 is not divisible"),
    ({"pipeline.microbatches": 3}, "not a multiple of config.mesh.stage"),
    ({"pipeline.repeats": 2}, "is the circular schedule's"),
    ({"pipeline.schedule": "circular"}, "needs pipeline.repeats >= 2"),
    ({"pipeline.schedule": "1f1b"}, "pipeline.schedule='1f1b' is not one"),
    # No count of microbatches (a multiple of 2) divides 7 sequences.
    ({"data.batch_size": 7}, "no count of pipeline microbatches divides"),
    ({"diloco.fragments": 4, "model.num_layers": 4},
     "each stage is one Streaming DiLoCo fragment"),
    ({"mesh.stage": 1, "pipeline.repeats": 2},
     "applies to islands of several pipeline stages"),
])
def test_what_stages_cannot_do_is_one_line_naming_both_settings(
    overrides, message):
  config = _config(2, **overrides)
  with pytest.raises(validation.ConfigError, match=re.escape(message)) as e:
    validation.validate_config(config, 8)
  assert "\n" not in str(e.value)


@pytest.mark.slow
def test_the_example_config_runs_two_stages():
  """configs/pipeline.py's first inner step, as its run builds and takes it
  (4 islands x 2 stages on 8 devices, the embedded corpus, the default
  pipeline microbatches): each island's loss and gradient norm are those
  of the plain model (one stage) on that island's first batch, to the
  reassociation of the module docstring."""
  setup = setup_lib.build(
      validation.validate_config(pipeline_config.get_config(), 8),
      jax.devices())
  config = setup.config
  assert setup.mesh.shape[STAGE] == 2 and setup.islands == 4
  state = start_lib.first_start(setup, None).state
  params = jax.device_get(state.global_params)  # logical: one stage's
  batch = setup.data.batches.next_batch()
  inner_step = inner_step_lib.make_inner_step(
      setup.loss_fn, setup.spec.inner_opt, setup.mesh,
      microbatches=config.data.microbatches, fsdp=config.mesh.fsdp)
  _, metrics = inner_step(setup.islands_side(state), setup.place_batch(batch))
  loss_fn = functools.partial(model_lib.next_token_loss,
                              model_lib.graphdef(config.model))
  losses, grads = jax.jit(jax.vmap(jax.value_and_grad(loss_fn),
                                   in_axes=(None, 0)))(params, batch)
  norms = jax.vmap(optax.tree.norm)(grads)
  np.testing.assert_allclose(metrics["loss"], losses, rtol=LOSS_RTOL)
  np.testing.assert_allclose(metrics["grad_norm"], norms, rtol=1e-5)
