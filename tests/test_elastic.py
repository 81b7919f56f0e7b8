"""Elastic islands (diloco_jax/elastic): each island its own process under
Ray, synced through the coordinator; a dead island is left out of its
round and rejoins at the next.

Elastic runs start their Ray cluster inside a network namespace the test
makes (loopback only, so Ray binds to 127.0.0.1 there); the fixture kills
what is left in it and removes it.
"""
import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import tiny
from diloco_jax.algorithm import fragments
from diloco_jax.algorithm import library as diloco
from diloco_jax.codecs import dense as dense_codecs
from diloco_jax.config import problems
from diloco_jax.config import state_spec
from diloco_jax.config import validation
from diloco_jax.elastic import coordinator as coordinator_lib
from diloco_jax.elastic import island as island_lib
from diloco_jax.elastic import membership
from diloco_jax.elastic import payloads
from diloco_jax.elastic import round_steps
from diloco_jax.elastic import settings as settings_lib
from diloco_jax.model import transformer as model_lib
from diloco_jax.run import train
from benchmarks import netns
from tests import helpers
from tests import test_train


REPO = pathlib.Path(__file__).resolve().parents[1]
# Three rounds of two islands on the tiny config.
RUN = {"diloco.islands": 2, "total_steps": 12, "diloco.inner_steps": 4}


# Streaming DiLoCo on the tiny config: two fragments of one block each.
_STREAMING = {"diloco.fragments": 2, "model.num_layers": 2}


def _config(**overrides):
  return helpers.with_overrides(tiny.get_config(), {**RUN, **overrides})


def _run_config(config):
  return validation.validate_config(
      config, config.diloco.islands * config.mesh.data, elastic=True)


@pytest.mark.parametrize("overrides,message", [
    ({"elastic.min_islands": 3}, "config.elastic.min_islands=3 must be 0"),
    ({"elastic.grace_seconds": -1.0}, "grace_seconds=-1.0 must be a number"),
    ({"elastic.max_restarts": -2}, "max_restarts=-2 must be a whole"),
    ({**_STREAMING, "mesh.stage": 2, "data.batch_size": 8},
     "config.mesh.stage=2 with python -m diloco_jax.elastic: Streaming"),
    ({**_STREAMING, "elastic.stale_rounds": 1},
     "config.elastic.stale_rounds=1 with python -m diloco_jax.elastic"),
    ({**_STREAMING, "diloco.island_schedule": "1->2"},
     "config.diloco.island_schedule='1->2' with python -m diloco_jax.elastic"),
    ({"diloco.island_schedule": "1->2"},
     "config.diloco.dropped_islands='train': an elastic island out of"),
    ({"testing.kill_island": "1@2,5@1"},
     "config.testing.kill_island: '5@1'"),
])
def test_bad_elastic_settings_are_one_line(overrides, message):
  with pytest.raises(problems.ConfigError, match=message) as error:
    settings_lib.check(_run_config(_config(**overrides)))
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("hook,value", [("kill_island", "1@2"),
                                        ("slow_island", "0@1")])
def test_spmd_runs_refuse_the_elastic_failure_hooks(hook, value):
  """An SPMD run's islands are one program: a hook that would kill or slow
  one island alone is refused in one line, not silently ignored."""
  config = _config(**{f"testing.{hook}": value})
  with pytest.raises(problems.ConfigError,
                     match=f"config.testing.{hook}='{value}' is for elastic"
                     ) as error:
    validation.validate_config(config, config.diloco.islands)
  assert "\n" not in str(error.value)


@pytest.fixture(scope="module")
def namespace():
  """A network namespace of this test's own with loopback only: the Ray
  cluster an elastic run starts in it binds to its 127.0.0.1 and reaches
  nothing else. Every process left in it is killed at the end, and it is
  removed."""
  with netns.LoopbackNamespace(f"djel{os.getpid()}") as made:
    yield made


def _elastic(namespace, workdir, *flags, wait=True, env=None):
  """`python -m diloco_jax.elastic` on the tiny config in the namespace, as
  the docs run it (`env`: more environment); the finished process, or the
  running one."""
  command = namespace.command(
      sys.executable, "-m", "diloco_jax.elastic",
      f"--config={REPO / 'configs/tiny.py'}", f"--workdir={workdir}",
      *_flags(), *flags)
  env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
  if not wait:
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
  done = subprocess.run(command, env=env, capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return done


def _flags():
  return [f"--config.{name}={value}" for name, value in RUN.items()]


_records = test_train._read_metrics  # pylint: disable=protected-access
_summary = test_train._read_summary  # pylint: disable=protected-access


# Islands with the SPMD runs' layout inside them: two pipeline stages,
# each FSDP-sharded over two devices (four devices per island).
_STAGED_FSDP = {"model.num_layers": 2, "data.batch_size": 8,
                "mesh.stage": 2, "mesh.data": 2, "mesh.fsdp": True}
_STAGED_FSDP_FLAGS = [f"--config.{name}={value}"
                      for name, value in _STAGED_FSDP.items()]


@pytest.fixture(scope="module")
def failure_free(namespace, tmp_path_factory):
  """The workdir of an elastic run without failures, its islands staged
  and FSDP-sharded."""
  workdir = str(tmp_path_factory.mktemp("elastic") / "failure_free")
  _elastic(namespace, workdir, *_STAGED_FSDP_FLAGS)
  return workdir


@pytest.mark.slow
@pytest.mark.parametrize("outer", ["nesterov", "sparseloco"])
def test_an_elastic_run_equals_the_spmd_run(outer, namespace, failure_free,
                                            tmp_path):
  """Without failures the islands' programs and the coordinator compute
  what one SPMD program does: the same batches per island, the same inner
  steps, the same outer step. With Nesterov the
  islands run the SPMD runs' layout inside their processes (the state
  staged over 2 pipeline stages, each split over 2 FSDP devices; x and
  the params cross Ray whole); with SparseLoCo (plain islands: FSDP takes
  dense codecs) its chunked 2-bit top-k and the islands' error feedback
  run at the coordinator, and the bytes counted are the SPMD run's.
  Different XLA programs (one island's step against all islands' at
  once) round differently: evals to 1e-5."""
  if outer == "nesterov":
    elastic, overrides = failure_free, _STAGED_FSDP
  else:
    overrides = {"diloco.outer_optimizer.name": outer}
    elastic = str(tmp_path / "elastic")
    _elastic(namespace, elastic, *[f"--config.{name}={value}"
                                   for name, value in overrides.items()])
  spmd = train.train_and_evaluate(_config(**overrides),
                                  str(tmp_path / "spmd"))
  summary = _summary(elastic)
  assert summary["goodput"] == 1.0
  if outer != "nesterov":
    # FSDP islands count every device's send of a leaf it holds whole (the
    # SPMD run's devices each all-reduce their copy); an elastic island
    # sends its params once.
    assert summary["comm_bytes"] == spmd["comm_bytes"]
  assert summary["final_eval_loss"] == pytest.approx(
      spmd["final_eval_loss"], rel=1e-5)
  spmd_evals = [r["eval_loss"] for r in _records(str(tmp_path / "spmd"))
                if "eval_loss" in r]
  assert [r["eval_loss"] for r in _records(elastic)] == pytest.approx(
      spmd_evals, rel=1e-5)


@pytest.mark.slow
def test_a_killed_island_is_left_out_and_rejoins(namespace, failure_free,
                                                 tmp_path):
  """Island 1's process SIGKILLs itself during round 2: the round
  closes with island 0 alone, Ray restarts island 1, which trains round 3
  from the x it is handed on the batches it had not contributed (its
  stream stands 2 rounds in at the end, island 0's 3), with a fresh inner
  optimizer state counted from the round's first step, its stages and
  FSDP shards rebuilt in the new process. The final eval loss stays
  within 1% of the run without the failure: one island-round of six is
  lost, on a model 12 steps in."""
  workdir = str(tmp_path / "killed")
  _elastic(namespace, workdir, *_STAGED_FSDP_FLAGS,
           "--config.testing.kill_island=1@2")
  records = _records(workdir)
  assert [r["included"] for r in records] == [[1, 1], [1, 0], [1, 1]]
  assert list(records[1]["failed"]) == ["1"]  # JSON keys are strings
  summary = _summary(workdir)
  assert summary["goodput"] == pytest.approx(5 / 6)
  steps = RUN["diloco.inner_steps"]
  assert summary["data_states"] == [{"step": 3 * steps},
                                    {"step": 2 * steps}]
  assert summary["final_eval_loss"] == pytest.approx(
      _summary(failure_free)["final_eval_loss"], rel=0.01)


# Each overlap with a codec, and the tolerance its run equals the SPMD
# run's to. Different XLA programs (one island's step against all
# islands' at once) round differently: 1e-5. The delay's islands encode
# their own pseudo-gradients with a dense codec (the coordinator steps on
# the decoded mean); where each island keeps its own point they send their
# params and the codec's collective runs at the coordinator. Streaming
# DiLoCo's islands send the round's fragment, the delayed run's int8 with
# error feedback encoded on each island: one quantization of its
# pseudo-gradient where the SPMD ring quantizes twice (each island's
# chunks, then each reduced chunk), so close, not equal: 1e-4 (measured
# 2.5e-6).
_OVERLAP_RUNS = {
    "one_step_delay": ({"diloco.overlap": "one_step_delay",
                        "diloco.codec": "fp32"}, 1e-5),
    # Pipelined rounds (each island's next call sent ahead) with int8
    # and error feedback encoded on each island (one quantization where
    # the SPMD ring quantizes twice, as for streaming_delayed below).
    "one_step_delay_int8": ({"diloco.overlap": "one_step_delay",
                             "diloco.codec": "int8",
                             "diloco.error_feedback": True}, 1e-4),
    "one_step_delay_rebase": ({"diloco.overlap": "one_step_delay_rebase",
                               "diloco.codec": "int8",
                               "diloco.error_feedback": True}, 1e-5),
    "eager": ({"diloco.overlap": "eager", "diloco.codec": "fp32"}, 1e-5),
    "eager_share": ({"diloco.overlap": "eager_share",
                     "diloco.codec": "int8"}, 1e-5),
    "streaming": ({**_STREAMING, "diloco.codec": "fp32"}, 1e-5),
    "streaming_delayed": ({**_STREAMING, "diloco.fragment_delay": 1,
                           "diloco.fragment_alpha": 0.5,
                           "diloco.codec": "int8",
                           "diloco.error_feedback": True}, 1e-4),
}


@pytest.mark.slow
@pytest.mark.parametrize("overlap", list(_OVERLAP_RUNS))
def test_every_overlap_runs_elastic_and_survives_a_kill(overlap, namespace,
                                                        tmp_path):
  """Elastic islands run every overlap of the SPMD runs through the same
  outer object: without failures the run equals the SPMD run with that
  overlap (evals and the final loss, after the last mean lands, to the
  table's tolerance), and one island sends what the SPMD run counts.
  Under streaming a round ends at each fragment's send (every 2 steps:
  6 rounds), the islands merge the new fragment themselves (at once, or
  a step later with alpha 0.5) and the evals fall at the SPMD run's
  round ends. With island 1 SIGKILLed in round 2 the round closes
  without it, Ray restarts it, and it rejoins from the point the overlap
  gives it (x, or its own): every record is kept and the final loss stays
  within 2% of the failure-free run's."""
  overrides, rel = _OVERLAP_RUNS[overlap]
  flags = [f"--config.{name}={value}" for name, value in overrides.items()]
  clean = str(tmp_path / "clean")
  _elastic(namespace, clean, *flags)
  spmd = train.train_and_evaluate(_config(**overrides),
                                  str(tmp_path / "spmd"))
  summary = _summary(clean)
  assert summary["goodput"] == 1.0
  if not overlap.startswith("eager"):  # eager's settle is one more send
    assert summary["comm_bytes"] == spmd["comm_bytes"]
  assert summary["final_eval_loss"] == pytest.approx(
      spmd["final_eval_loss"], rel=rel)
  spmd_evals = [r["eval_loss"] for r in _records(str(tmp_path / "spmd"))
                if "eval_loss" in r]
  assert [r["eval_loss"] for r in _records(clean)
          if "eval_loss" in r] == pytest.approx(spmd_evals, rel=rel)

  killed = str(tmp_path / "killed")
  _elastic(namespace, killed, *flags, "--config.testing.kill_island=1@2")
  rounds = len(_records(clean))
  assert rounds == (6 if overlap.startswith("streaming") else 3)
  assert [r["included"] for r in _records(killed)] == (
      [[1, 1], [1, 0]] + [[1, 1]] * (rounds - 2))
  assert _summary(killed)["final_eval_loss"] == pytest.approx(
      summary["final_eval_loss"], rel=0.02)


@pytest.mark.slow
def test_delayed_rounds_overlap_the_round_before_them(namespace, tmp_path):
  """Under the one-step delay each island's next call is sent while its
  round runs (config.elastic.overlap_rounds, on by default): island 0,
  done with rounds 1 and 2 a second before island 1 (slowed by the
  straggler hook), begins the next round while the round it finished is
  still open, where with the setting off it begins after the round
  closed (every island does: its call is sent then). Both compute the
  same run: x's start of a round is known a round early (outer.land), so
  only the time moves."""
  flags = ["--config.diloco.overlap=one_step_delay",
           "--config.testing.slow_island=1@1,1@2",
           "--config.testing.slow_seconds=1.0"]
  ahead, blocked = str(tmp_path / "ahead"), str(tmp_path / "blocked")
  _elastic(namespace, ahead, *flags)
  _elastic(namespace, blocked, *flags, "--config.elastic.overlap_rounds=false")
  for workdir, overlapped in ((ahead, True), (blocked, False)):
    records = _records(workdir)
    assert [r["pipelined"] for r in records] == [overlapped] * 3
    assert [r["included"] for r in records] == [[1, 1]] * 3
    for last, this in zip(records, records[1:]):
      assert len(this["started_at"]) == 2
      started = this["started_at"]["0"]
      assert (started < last["closed_at"]) == overlapped, (last, this)
      if not overlapped:
        assert min(this["started_at"].values()) > last["closed_at"]
  # The same outer steps in programs jitted apart (land alone, and within
  # the whole update): equal up to float32 rounding of x.
  assert [r.get("eval_loss") for r in _records(ahead)] == pytest.approx(
      [r.get("eval_loss") for r in _records(blocked)], rel=1e-6)


def test_an_address_that_does_not_answer_is_one_line(tmp_path):
  with socket.socket() as unused:
    unused.bind(("127.0.0.1", 0))
    port = unused.getsockname()[1]
  workdir = tmp_path / "never"
  done = subprocess.run(
      [sys.executable, "-m", "diloco_jax.elastic",
       f"--config={REPO / 'configs/tiny.py'}", f"--workdir={workdir}",
       f"--ray_address=127.0.0.1:{port}"],
      env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
      text=True, timeout=120)
  assert done.returncode != 0
  assert f"error: --ray_address='127.0.0.1:{port}' does not answer" in (
      done.stderr.strip().splitlines()[-1])
  assert not workdir.exists()


@pytest.mark.slow
@pytest.mark.parametrize("flags", [(), ("--config.elastic.asynchronous=true",)],
                         ids=["rounds", "asynchronous"])
def test_a_killed_coordinator_resumes_from_its_last_round(flags, namespace,
                                                          tmp_path):
  """Every process of the run (the coordinator's, Ray's, the islands')
  SIGKILLed once the first round is checkpointed; the same command again
  resumes from the coordinator's last round and finishes the run. Under
  asynchronous rounds the first window is checkpointed on a thread of its
  own while the islands train on; the calls in flight at the kill are
  lost, and the rerun trains their batches again."""
  workdir = tmp_path / "resumed"
  first = _elastic(namespace, workdir, *flags, wait=False)
  saved = workdir / "coordinator" / "1"
  deadline = time.monotonic() + 300
  while not saved.exists() and first.poll() is None:
    assert time.monotonic() < deadline, "no round was checkpointed"
    time.sleep(0.05)
  namespace.kill_everything()
  first.wait(timeout=60)
  assert first.returncode != 0  # killed, not finished
  first_record = (workdir / "metrics.jsonl").read_text().splitlines()[0]
  _elastic(namespace, workdir, *flags)
  summary = _summary(workdir)
  assert summary["resumed"] and summary["rounds"] == 3
  # A round's record is written before its checkpoint; the rerun drops
  # the records of rounds it did not checkpoint and trains them again:
  # one record per round, round 1's the killed run's (never retrained).
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  assert [r["round"] for r in _records(workdir)] == [1, 2, 3]
  assert lines[0] == first_record
  if flags:  # each stream after exactly the applied results' batches
    applied = [0, 0]
    for record in _records(workdir):
      for arrival in record["arrivals"]:
        applied[arrival["island"]] += arrival["steps"] * arrival["applied"]
    assert summary["data_states"] == [{"step": n} for n in applied]


@pytest.mark.slow
def test_a_straggler_is_left_out_of_its_round(namespace, tmp_path):
  """Island 1 sleeps 8 s into round 2; with a quorum of one island and a
  1 s grace window the round closes without it. Whatever rounds it makes
  later, its data position counts exactly the rounds it was part of."""
  workdir = str(tmp_path / "straggler")
  _elastic(namespace, workdir, "--config.elastic.min_islands=1",
           "--config.elastic.grace_seconds=1",
           "--config.testing.slow_island=1@2",
           "--config.testing.slow_seconds=8")
  records = _records(workdir)
  assert records[1]["late"] == [1] and records[1]["included"] == [1, 0]
  assert not records[1]["failed"]
  steps = RUN["diloco.inner_steps"]
  contributed = [sum(r["included"][i] for r in records) for i in range(2)]
  summary = _summary(workdir)
  assert summary["data_states"] == [
      {"step": n * steps} for n in contributed]
  assert contributed[0] == 3
  assert set(summary["island_nodes"]) == {"0", "1"}  # where each ran


@pytest.mark.slow
def test_islands_join_and_leave_between_rounds(namespace, tmp_path):
  """With island_schedule '1<->2' slot 1 is a member of round 2 only: its
  process starts for round 2 (a fresh inner optimizer state, from round
  2's x, on its slot's first batches), contributes, and is ended before
  round 3. Every member contributes every round it is a member of, so
  goodput is 1; each slot's stream stands after exactly its rounds. The
  run's codec is int8 with error feedback, which islands encode
  themselves (a joining island with a zero residual)."""
  workdir = str(tmp_path / "members")
  _elastic(namespace, workdir, "--config.diloco.island_schedule=1<->2",
           "--config.diloco.dropped_islands=idle",
           "--config.diloco.codec=int8", "--config.diloco.error_feedback=True")
  records = _records(workdir)
  assert [r["members"] for r in records] == [[0], [0, 1], [0]]
  assert [r["joined"] for r in records] == [[0], [1], []]
  assert [r["left"] for r in records] == [[], [], [1]]
  assert [r["included"] for r in records] == [[1, 0], [1, 1], [1, 0]]
  summary = _summary(workdir)
  assert summary["goodput"] == 1.0
  steps = RUN["diloco.inner_steps"]
  assert summary["data_states"] == [{"step": 3 * steps}, {"step": steps}]
  # With int8 each member encodes its own pseudo-gradient (one flat
  # vector, padded to whole blocks): only payloads crossed Ray, 4 of them.
  config = _config()
  size = sum(leaf.size for leaf in jax.tree.leaves(
      model_lib.param_shapes(config.model)))
  block = config.diloco.codec_block_size
  payload = dense_codecs.make_codec("int8", block).payload_bytes(
      -(-size // block) * block)
  assert summary["ray_bytes"] == 4 * payload
  assert payload < 0.27 * 4 * size  # fp32 params: 4 bytes a value


def test_the_members_file_sets_the_next_rounds_members(tmp_path):
  """`python -m diloco_jax.elastic.members` writes the control file the
  coordinator reads before each round; a bad file is reported and the
  schedule holds; bad input to the command is one line."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text(
      _config().to_json_best_effort())

  def command(*flags):
    return subprocess.run(
        [sys.executable, "-m", "diloco_jax.elastic.members",
         f"--workdir={workdir}", *flags],
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
        text=True, timeout=120)

  assert membership.members(str(workdir), 2, "", 0, 3) == ([0, 1], None)
  done = command("--islands=1")
  assert done.returncode == 0, done.stderr
  assert membership.members(str(workdir), 2, "", 0, 3) == ([1], None)
  for bad in ("--islands=2", "--islands=a"):
    done = command(bad)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith(
        "error: --islands: islands")
  assert membership.members(str(workdir), 2, "", 0, 3) == ([1], None)
  (workdir / membership.CONTROL_FILE).write_text('{"islands": [5]}')
  members, problem = membership.members(str(workdir), 2, "2->1", 2, 3)
  assert members == [0] and "members.json ignored" in problem
  assert command("--islands=schedule").returncode == 0
  assert membership.members(str(workdir), 2, "", 0, 3) == ([0, 1], None)
  done = subprocess.run(
      [sys.executable, "-m", "diloco_jax.elastic.members",
       f"--workdir={tmp_path / 'nothing'}", "--islands=0"],
      env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
      text=True, timeout=120)
  assert "is not an elastic run's directory" in done.stderr


@pytest.mark.slow
def test_a_late_result_is_applied_by_the_staleness_rule(namespace,
                                                        tmp_path):
  """With stale_rounds=1 a straggler's round-2 result, too late for round
  2 (island 1 sleeps 12 s; the round closes 8 s after island 0's answer),
  is applied in round 3 against the x it started from, at half weight.
  Island 1 gets no round-3 call while it finishes round 2, so no work is
  lost: goodput 1, and its stream stands after the 3 rounds it trained."""
  workdir = str(tmp_path / "stale")
  _elastic(namespace, workdir, "--config.total_steps=16",
           "--config.elastic.min_islands=1",
           "--config.elastic.grace_seconds=8",
           "--config.elastic.stale_rounds=1",
           "--config.testing.slow_island=1@2",
           "--config.testing.slow_seconds=12")
  records = _records(workdir)
  assert [r["included"] for r in records] == [[1, 1], [1, 0], [1, 1],
                                              [1, 1]]
  assert records[1]["late"] == [1]
  assert [r["stale"] for r in records] == [{}, {}, {"1": 1}, {}]
  summary = _summary(workdir)
  assert summary["goodput"] == 1.0
  steps = RUN["diloco.inner_steps"]
  assert summary["data_states"] == [{"step": 4 * steps},
                                    {"step": 3 * steps}]


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_a_stale_result_counts_its_own_update_at_reduced_weight(codec,
                                                                tmp_path):
  """The coordinator's staleness rule on its own: with outer SGD at lr 1
  (x moves to the weighted mean of the pseudo-gradients) a result two
  rounds old moves x by its own update, y - x_then, at weight w / 3
  beside a fresh island's at w: sent as params (fp32: rebased onto x), or
  as the pseudo-gradient the island encoded (int8: against the x it
  started from already; the expected mean decodes the same payloads).
  fp32 sums in another order: 1e-6."""
  config = _config(**{"diloco.outer_optimizer.name": "sgd",
                      "diloco.outer_optimizer.learning_rate": 1.0,
                      "diloco.codec": codec, "elastic.stale_rounds": 2})
  coordinator = coordinator_lib.Coordinator(_run_config(config),
                                            str(tmp_path))
  dense = dense_codecs.make_codec(codec, config.diloco.codec_block_size)
  rng = np.random.default_rng(0)
  size = sum(leaf.size for leaf in jax.tree.leaves(coordinator.x))

  def trained(x, round_number):
    y = jax.tree.map(
        lambda a: a + rng.normal(0, 0.01, a.shape).astype(a.dtype), x)
    result = {"round": round_number, "share": 1.0, "tokens": 100,
              "data_state": {"step": round_number}}
    if codec == "fp32":
      return {**result, "params": y}, y
    payload, _ = payloads.island_payload(x, y, None, dense)
    # What the coordinator will move x by: the decoded update, -(x - y).
    update = payloads.unflatten(
        -payloads.decode(payload, dense, size), x)
    return {**result, "payload": jax.device_get(payload)}, update

  def update_of(y, x):  # the params form: y - x
    return jax.tree.map(np.subtract, y, x) if codec == "fp32" else y

  x_1 = coordinator.x
  late, late_y = trained(x_1, 1)
  coordinator.close_round({0: trained(x_1, 1)[0]}, 1)
  coordinator.close_round({0: trained(coordinator.x, 2)[0]}, 2)
  x_3 = coordinator.x
  fresh, fresh_y = trained(x_3, 3)
  included = coordinator.close_round({0: fresh, 1: late}, 3)
  assert included.tolist() == [True, True]
  expected = jax.tree.map(
      lambda x, u0, u1: x + (1.0 * u0 + u1 / 3) / (4 / 3),
      x_3, update_of(fresh_y, x_3), update_of(late_y, x_1))
  for got, want in zip(jax.tree.leaves(coordinator.x),
                       jax.tree.leaves(expected)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert coordinator.data_states == [{"step": 3}, {"step": 1}]
  coordinator.close()


@pytest.mark.parametrize("overlap", ["one_step_delay_rebase", "eager",
                                     "streaming_delayed"])
def test_a_coordinator_resumes_an_overlap_exactly(overlap, tmp_path):
  """A coordinator killed after a round's checkpoint resumes with the
  overlap's whole state: the mean in flight, each island's point and its
  own outer state; under streaming each fragment's outer state. Restored,
  it closes the next round on the same results to the same x, the same
  starts and the same state, bit for bit. (Streaming's islands send the
  round's fragment as their int8 pseudo-gradient, encoded here as an
  island encodes it.)"""
  run_config = _run_config(_config(**_OVERLAP_RUNS[overlap][0]))
  rng = np.random.default_rng(0)
  int8 = dense_codecs.make_codec("int8",
                                 run_config.config.diloco.codec_block_size)

  def sent(start, y, round_number, coordinator):
    if not run_config.streaming:
      return {"params": y}
    assignment = fragments.leaf_fragments(start, 2)
    select = lambda tree, p: fragments.select(tree, assignment, p)
    return {"payload": {p: jax.device_get(payloads.island_payload(
        select(start, p), select(y, p), None, int8)[0])
                        for p in round_steps.sends(
                            run_config.schedule,
                            coordinator.round_ends[round_number - 1])}}

  def results(coordinator, round_number):
    moved = {i: jax.tree.map(
        lambda a: a + rng.normal(0, 0.01, a.shape).astype(a.dtype),
        coordinator.start(i)) for i in range(2)}
    return {i: {"round": round_number, "share": 1.0, "tokens": 100,
                "data_state": {"step": round_number},
                **sent(coordinator.start(i), moved[i], round_number,
                       coordinator)}
            for i in range(2)}

  first = coordinator_lib.Coordinator(run_config, str(tmp_path))
  for r in (1, 2):
    first.close_round(results(first, r), r)
  first.save()
  resumed = coordinator_lib.Coordinator(run_config, str(tmp_path))
  assert resumed.restore() and resumed.rounds_done == 2
  third = results(first, 3)
  first.close_round(third, 3)
  resumed.close_round(third, 3)
  for i in range(2):
    jax.tree.map(np.testing.assert_array_equal, resumed.start(i),
                 first.start(i))
  jax.tree.map(np.testing.assert_array_equal, resumed.model(), first.model())
  jax.tree.map(np.testing.assert_array_equal,
               resumed._state, first._state)  # pylint: disable=protected-access
  first.close()
  resumed.close()


def test_a_coordinator_checkpoint_from_before_the_outer_object_resumes(
    tmp_path):
  """A coordinator checkpoint as the coordinator wrote it before the outer
  object (its outer state the library's DiLoCoState) is read and
  converted: x, the outer optimizer's momentum, the error-feedback
  residuals, the round and the data positions come back as written."""
  config = _config(**{"diloco.codec": "topk", "diloco.error_feedback": True,
                      "diloco.outer_optimizer.momentum": 0.0})
  run_config = _run_config(config)
  coordinator = coordinator_lib.Coordinator(run_config, str(tmp_path))
  x = coordinator.x
  rng = np.random.default_rng(0)
  moved = lambda tree: jax.tree.map(
      lambda a: (a + rng.normal(0, 0.1, a.shape)).astype(a.dtype)
      if np.issubdtype(a.dtype, np.floating) else a, tree)
  spec = state_spec.for_run(run_config)
  old = diloco.init(x, spec.outer_opt, 2, compression=spec.compression,
                    error_feedback=True)
  old = jax.device_get(old.replace(
      outer_opt_state=moved(old.outer_opt_state),
      residuals=moved(old.residuals), round=np.int32(3)))
  data_states = [{"step": 12}, {"step": 8}]
  with ocp.CheckpointManager(tmp_path / "coordinator") as manager:
    manager.save(3, args=ocp.args.Composite(
        x=ocp.args.StandardSave(x), outer=ocp.args.StandardSave(old),
        progress=ocp.args.JsonSave({"rounds_done": 3,
                                    "data_states": data_states})))
  coordinator.close()

  resumed = coordinator_lib.Coordinator(run_config, str(tmp_path))
  assert resumed.restore()
  state = resumed._state  # pylint: disable=protected-access
  assert resumed.rounds_done == 3 and int(state.round) == 3
  assert resumed.data_states == data_states
  for got, want in ((state.outer_opt_state, old.outer_opt_state),
                    (state.residuals, old.residuals), (resumed.x, x)):
    jax.tree.map(np.testing.assert_array_equal, got, want)
  resumed.close_round({}, 4)  # and it steps on (nobody: x stays)
  jax.tree.map(np.testing.assert_array_equal, resumed.x, x)
  resumed.close()


def test_an_island_payload_carries_its_pseudo_gradient_through_the_codec():
  """What an island encodes itself (int8, blocks of 256 over one flat
  vector of every leaf, zero-padded): the payload takes ~1/4 of fp32's
  bytes, decodes to x - y + the decayed residual within half a
  quantization step per value, and the new residual is exactly what
  decoding left out (float32: to one rounding)."""
  codec = dense_codecs.make_codec("int8", 256)
  rng = np.random.default_rng(0)
  x = {"w": rng.normal(size=(130, 64)).astype(np.float32),
       "b": rng.normal(size=(5,)).astype(np.float32)}
  y = jax.tree.map(lambda a: a + rng.normal(0, 0.01, a.shape).astype(
      np.float32), x)
  residual = rng.normal(0, 1e-3, 130 * 64 + 5).astype(np.float32)
  payload, new_residual = payloads.island_payload(x, y, residual, codec,
                                                  feedback_decay=0.5)
  values = payloads.flatten(x) - payloads.flatten(y) + 0.5 * residual
  decoded = payloads.decode(payload, codec, values.size)
  padded = jnp.pad(values, (0, -values.size % 256))
  assert np.all(np.abs(decoded - values)
                <= codec.max_abs_error(padded)[:values.size] * (1 + 1e-6))
  np.testing.assert_allclose(decoded + new_residual, values, rtol=0,
                             atol=1e-7)
  assert payloads.nbytes(payload) < 0.27 * 4 * values.size
  tree = payloads.unflatten(decoded, x)
  assert jax.tree.map(np.shape, tree) == jax.tree.map(np.shape, x)
  assert payloads.island_payload(x, y, None, codec)[1] is None


def test_the_coordinator_s_mean_leaves_out_silent_and_diverged_islands():
  decoded = jnp.array([[1.0, 2.0], [3.0, 4.0], [np.nan, 0.0], [9.0, 9.0]])
  weights = jnp.array([1.0, 3.0, 1.0, 0.0])
  mean, included, anyone = payloads.weighted_mean(decoded, weights)
  np.testing.assert_allclose(mean, [2.5, 3.5])
  assert included.tolist() == [True, True, False, False] and bool(anyone)
  _, included, anyone = payloads.weighted_mean(decoded, jnp.zeros(4))
  assert not bool(anyone) and not included.any()


def test_a_fresh_island_goes_on_with_the_learning_rate_schedule(tmp_path):
  """An island whose process starts in round 3 (restarted, or joining)
  counts its fresh inner optimizer from the round's first step, as the
  SPMD runs restart an island: after one step every optax count is
  2 H + 1, so its learning rate is the run's at that step, not warmup's
  first."""
  run_config = _run_config(_config())
  program = island_lib.IslandProgram(run_config, 0, str(tmp_path))
  x = coordinator_lib.Coordinator(run_config, str(tmp_path)).x
  program.train_round(x, 3, None, 1)
  counts = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(
      program._state.inner_opt_state)  # pylint: disable=protected-access
            if getattr(path[-1], "name", None) == "count"]
  assert counts and all(
      np.all(np.asarray(c) == 2 * RUN["diloco.inner_steps"] + 1)
      for c in counts)
