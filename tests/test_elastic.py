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
import numpy as np
import pytest

from configs import tiny
from diloco_jax.config import problems
from diloco_jax.config import validation
from diloco_jax.elastic import coordinator as coordinator_lib
from diloco_jax.elastic import membership
from diloco_jax.elastic import settings as settings_lib
from diloco_jax.run import train
from benchmarks import netns
from tests import helpers
from tests import test_train


REPO = pathlib.Path(__file__).resolve().parents[1]
# Three rounds of two islands on the tiny config.
RUN = {"diloco.islands": 2, "total_steps": 12, "diloco.inner_steps": 4}


def _config(**overrides):
  return helpers.with_overrides(tiny.get_config(), {**RUN, **overrides})


def _run_config(config):
  return validation.validate_config(
      config, config.diloco.islands * config.mesh.data, elastic=True)


@pytest.mark.parametrize("overrides,message", [
    ({"elastic.min_islands": 3}, "config.elastic.min_islands=3 must be 0"),
    ({"elastic.grace_seconds": -1.0}, "grace_seconds=-1.0 must be a number"),
    ({"elastic.max_restarts": -2}, "max_restarts=-2 must be a whole"),
    ({"diloco.overlap": "eager"},
     "config.diloco.overlap='eager' with python -m diloco_jax.elastic"),
    ({"diloco.fragments": 2, "model.num_layers": 2},
     "config.diloco.fragments=2 with python -m diloco_jax.elastic"),
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


def _elastic(namespace, workdir, *flags, wait=True):
  """`python -m diloco_jax.elastic` on the tiny config in the namespace, as
  the docs run it; the finished process, or the running one."""
  command = namespace.command(
      sys.executable, "-m", "diloco_jax.elastic",
      f"--config={REPO / 'configs/tiny.py'}", f"--workdir={workdir}",
      *_flags(), *flags)
  env = {**os.environ, "PYTHONPATH": str(REPO)}
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


@pytest.fixture(scope="module")
def failure_free(namespace, tmp_path_factory):
  """The workdir of an elastic run without failures."""
  workdir = str(tmp_path_factory.mktemp("elastic") / "failure_free")
  _elastic(namespace, workdir)
  return workdir


@pytest.mark.parametrize("outer", ["nesterov", "sparseloco"])
def test_an_elastic_run_equals_the_spmd_run(outer, namespace, failure_free,
                                            tmp_path):
  """Without failures the islands' programs and the coordinator compute
  what one SPMD program does: the same batches per island, the same inner
  steps, the same outer step (with SparseLoCo: its chunked 2-bit top-k and
  the islands' error feedback, kept at the coordinator), and count the
  same bytes. Different XLA programs (one island's step against all
  islands' at once) round differently: evals to 1e-5."""
  overrides = ({} if outer == "nesterov"
               else {"diloco.outer_optimizer.name": outer})
  elastic = failure_free
  if overrides:
    elastic = str(tmp_path / "elastic")
    _elastic(namespace, elastic, *[f"--config.{name}={value}"
                                   for name, value in overrides.items()])
  spmd = train.train_and_evaluate(_config(**overrides),
                                  str(tmp_path / "spmd"))
  summary = _summary(elastic)
  assert summary["goodput"] == 1.0
  assert summary["comm_bytes"] == spmd["comm_bytes"]
  assert summary["final_eval_loss"] == pytest.approx(
      spmd["final_eval_loss"], rel=1e-5)
  spmd_evals = [r["eval_loss"] for r in _records(str(tmp_path / "spmd"))
                if "eval_loss" in r]
  assert [r["eval_loss"] for r in _records(elastic)] == pytest.approx(
      spmd_evals, rel=1e-5)


# An island with the SPMD runs' mesh inside it: two pipeline stages, each
# FSDP-sharded over two devices (four devices per island).
_STAGED_FSDP = {"model.num_layers": 2, "data.batch_size": 8,
                "mesh.stage": 2, "mesh.data": 2, "mesh.fsdp": True}


def test_islands_with_stages_and_fsdp_equal_the_spmd_run(namespace,
                                                         tmp_path):
  """Each elastic island runs the SPMD runs' layout inside its own process
  (its state staged over 2 pipeline stages and split over 2 FSDP devices
  per stage); the coordinator takes its params back whole. Evals equal the
  SPMD run's to 1e-5 (different XLA programs: the islands' steps one
  island at a time, and the mean as a sum in another order)."""
  elastic = str(tmp_path / "elastic")
  _elastic(namespace, elastic, *[f"--config.{name}={value}"
                                 for name, value in _STAGED_FSDP.items()])
  spmd = train.train_and_evaluate(_config(**_STAGED_FSDP),
                                  str(tmp_path / "spmd"))
  assert _summary(elastic)["final_eval_loss"] == pytest.approx(
      spmd["final_eval_loss"], rel=1e-5)
  spmd_evals = [r["eval_loss"] for r in _records(str(tmp_path / "spmd"))
                if "eval_loss" in r]
  assert [r["eval_loss"] for r in _records(elastic)] == pytest.approx(
      spmd_evals, rel=1e-5)


def test_a_killed_island_is_left_out_and_rejoins(namespace, failure_free,
                                                 tmp_path):
  """Island 1's process SIGKILLs itself during round 2: the round
  closes with island 0 alone, Ray restarts island 1, which trains round 3
  from the x it is handed on the batches it had not contributed (its
  stream stands 2 rounds in at the end, island 0's 3), with a fresh inner
  optimizer state. The final eval loss stays within 1% of the run without
  the failure: one island-round of six is lost, on a model 12 steps in."""
  workdir = str(tmp_path / "killed")
  _elastic(namespace, workdir, "--config.testing.kill_island=1@2")
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


def test_a_killed_coordinator_resumes_from_its_last_round(namespace,
                                                          tmp_path):
  """Every process of the run (the coordinator's, Ray's, the islands')
  SIGKILLed once the first round is checkpointed; the same command again
  resumes from the coordinator's last round and finishes the run."""
  workdir = tmp_path / "resumed"
  first = _elastic(namespace, workdir, wait=False)
  saved = workdir / "coordinator" / "1"
  deadline = time.monotonic() + 300
  while not saved.exists() and first.poll() is None:
    assert time.monotonic() < deadline, "no round was checkpointed"
    time.sleep(0.05)
  namespace.kill_everything()
  first.wait(timeout=60)
  assert first.returncode != 0  # killed, not finished
  rounds_before = len(_records(workdir))
  _elastic(namespace, workdir)
  summary = _summary(workdir)
  assert summary["resumed"] and summary["rounds"] == 3
  rounds = [r["round"] for r in _records(workdir)]
  # The killed run recorded rounds 1..m and checkpointed m or m + 1 (a
  # checkpoint is written before its round's record); the rerun goes on
  # after the checkpoint, never from round 1.
  m = rounds_before
  assert rounds[:m] == list(range(1, m + 1))
  assert rounds[m] in (m + 1, m + 2) and rounds[m] >= 2
  assert rounds[m:] == list(range(rounds[m], 4))


def test_a_straggler_is_left_out_of_its_round(namespace, tmp_path):
  """Island 1 sleeps 20 s into round 2; with a quorum of one island and a
  1 s grace window the round closes without it. Whatever rounds it makes
  later, its data position counts exactly the rounds it was part of."""
  workdir = str(tmp_path / "straggler")
  _elastic(namespace, workdir, "--config.elastic.min_islands=1",
           "--config.elastic.grace_seconds=1",
           "--config.testing.slow_island=1@2",
           "--config.testing.slow_seconds=20")
  records = _records(workdir)
  assert records[1]["late"] == [1] and records[1]["included"] == [1, 0]
  assert not records[1]["failed"]
  steps = RUN["diloco.inner_steps"]
  contributed = [sum(r["included"][i] for r in records) for i in range(2)]
  assert _summary(workdir)["data_states"] == [
      {"step": n * steps} for n in contributed]
  assert contributed[0] == 3


def test_islands_join_and_leave_between_rounds(namespace, tmp_path):
  """With island_schedule '1<->2' slot 1 is a member of round 2 only: its
  process starts for round 2 (a fresh inner optimizer state, from round
  2's x, on its slot's first batches), contributes, and is ended before
  round 3. Every member contributes every round it is a member of, so
  goodput is 1; each slot's stream stands after exactly its rounds."""
  workdir = str(tmp_path / "members")
  _elastic(namespace, workdir, "--config.diloco.island_schedule=1<->2",
           "--config.diloco.dropped_islands=idle")
  records = _records(workdir)
  assert [r["members"] for r in records] == [[0], [0, 1], [0]]
  assert [r["joined"] for r in records] == [[0], [1], []]
  assert [r["left"] for r in records] == [[], [], [1]]
  assert [r["included"] for r in records] == [[1, 0], [1, 1], [1, 0]]
  summary = _summary(workdir)
  assert summary["goodput"] == 1.0
  steps = RUN["diloco.inner_steps"]
  assert summary["data_states"] == [{"step": 3 * steps}, {"step": steps}]


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


def test_a_stale_result_counts_its_own_update_at_reduced_weight(tmp_path):
  """The coordinator's staleness rule on its own: with outer SGD at lr 1
  (x moves to the weighted mean of the pseudo-gradients) a result two
  rounds old moves x by its own update, y - x_then, at weight w / 3
  beside a fresh island's at w. fp32 sums in another order: 1e-6."""
  config = _config(**{"diloco.outer_optimizer.name": "sgd",
                      "diloco.outer_optimizer.learning_rate": 1.0,
                      "elastic.stale_rounds": 2})
  coordinator = coordinator_lib.Coordinator(_run_config(config),
                                            str(tmp_path))
  rng = np.random.default_rng(0)

  def trained(x, round_number):
    return {"params": jax.tree.map(
        lambda a: a + rng.normal(0, 0.01, a.shape).astype(a.dtype), x),
            "round": round_number, "share": 1.0, "tokens": 100,
            "data_state": {"step": round_number}}

  x_1 = coordinator.x
  late = trained(x_1, 1)
  coordinator.close_round({0: trained(x_1, 1)}, 1)
  coordinator.close_round({0: trained(coordinator.x, 2)}, 2)
  x_3 = coordinator.x
  fresh = trained(x_3, 3)
  included = coordinator.close_round({0: fresh, 1: late}, 3)
  assert included.tolist() == [True, True]
  expected = jax.tree.map(
      lambda x, y0, x1, y1: x + (1.0 * (y0 - x) + (y1 - x1) / 3) / (4 / 3),
      x_3, fresh["params"], x_1, late["params"])
  for got, want in zip(jax.tree.leaves(coordinator.x),
                       jax.tree.leaves(expected)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  assert coordinator.data_states == [{"step": 3}, {"step": 1}]
  coordinator.close()
