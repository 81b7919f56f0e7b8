"""What an elastic run reads and records: the members control file (never
stopping a run), an island restarted between rounds (its next call waits
for the restart), and which process each island is in each round's record.

The elastic run here starts its Ray cluster inside tests/test_elastic.py's
loopback-only network namespace (Ray binds to 127.0.0.1 there; the
fixture kills what is left in it and removes it).
"""
import json
import os
import socket

import pytest

from diloco_jax.config import problems
from diloco_jax.elastic import membership
from diloco_jax.elastic import settings as settings_lib
from tests.test_elastic import _config
from tests.test_elastic import _elastic
from tests.test_elastic import _records
from tests.test_elastic import _run_config
from tests.test_elastic import _summary
from tests.test_elastic import namespace  # pylint: disable=unused-import


# Control files the members command would never write: slots it refuses
# ('1.9', 'true', '2'), numbers past float's range, JSON's constants, a
# dict, a string, nothing, text that is not JSON or not UTF-8, nesting
# deeper than the parser's recursion.
_BAD_FILES = [
    b'{"islands": [1e999]}', b'{"islands": 1e999}', b"1e999",
    b'{"islands": [Infinity]}', b'{"islands": Infinity}', b"Infinity",
    b'{"islands": [NaN]}', b'{"islands": [1.9]}', b'{"islands": [1.0]}',
    b'{"islands": [true]}', b'{"islands": {"2": 0}}',
    b'{"islands": {"1": 0}}', b'{"islands": "1"}', b'{"islands": ["1"]}',
    b'{"islands": []}', b'{"islands": [2]}',
    b'{"islands": [-1]}', b'{"islands": [null]}', b"[1]", b'{"island": [1]}',
    b"", b"{", b"\xff\xfe", b'{"islands": [' + b"9" * 5000 + b"]}",
    b'{"islands": ' + b"[" * 100000 + b"]" * 100000 + b"}",
]


@pytest.mark.parametrize("content", _BAD_FILES,
                         ids=lambda content: repr(content[:24]))
def test_a_members_file_the_command_would_refuse_is_ignored(content,
                                                            tmp_path):
  """A control file that is not a list of slot numbers the members command
  accepts never stops a run: it is reported once (not every round) and
  ignored, the run going on with the members the file last gave; before
  any good file, with the schedule's. The command's check (parse) is the
  file's: it refuses the same slots."""
  path = tmp_path / membership.CONTROL_FILE
  reader = membership.Members(str(tmp_path), 2, "2->1", 3)
  path.write_bytes(content)
  members, problem = reader.of_round(2)
  assert members == [0] and "members.json ignored" in problem  # schedule's
  assert "\n" not in problem and len(problem) < 400
  membership.write(str(tmp_path), [1])
  assert reader.of_round(0) == ([1], None)
  path.write_bytes(content)
  members, problem = reader.of_round(0)
  assert members == [1] and "members.json ignored" in problem
  assert problem.endswith("the members it last gave, [1]")
  assert reader.of_round(1) == ([1], None)  # reported once
  assert reader.of_round(2) == ([1], None)


@pytest.mark.parametrize("islands", ["1.9", "true", "1e999", "inf", "1_0",
                                     "-1", "2", ""])
def test_the_members_command_refuses_what_the_file_refuses(islands):
  with pytest.raises(ValueError, match=r"^islands "):
    membership.parse(islands, 2)
  assert membership.parse(" 1, 0,1,", 2) == [0, 1]
  assert membership.parse([1, 0, 1], 2) == [0, 1]


def test_a_members_file_that_is_not_a_file_is_ignored(tmp_path):
  """A directory, a pipe (whose read would wait for a writer) or a file
  too large for a control file is ignored as a bad file is; each distinct
  problem is reported once."""
  path = tmp_path / membership.CONTROL_FILE
  reader = membership.Members(str(tmp_path), 3, "", 4)
  membership.write(str(tmp_path), [0, 2])
  assert reader.of_round(0) == ([0, 2], None)
  membership.write(str(tmp_path), None)  # back to the schedule's
  assert reader.of_round(1) == ([0, 1, 2], None)
  path.mkdir()  # bad: still the schedule's
  members, problem = reader.of_round(1)
  assert members == [0, 1, 2] and "not a regular file" in problem
  assert reader.of_round(2) == ([0, 1, 2], None)
  path.rmdir()
  os.mkfifo(path)
  assert reader.of_round(2) == ([0, 1, 2], None)  # the same problem
  os.remove(path)
  path.write_bytes(b'{"islands": [1]}' + b" " * (2 << 20))
  members, problem = reader.of_round(3)
  assert members == [0, 1, 2] and "larger than" in problem
  # Another bad content after a good one is reported again.
  membership.write(str(tmp_path), [1])
  assert reader.of_round(3) == ([1], None)
  path.write_text('{"islands": [3]}')
  assert "ignored" in reader.of_round(3)[1]
  path.write_text('{"islands": [7]}')
  assert "ignored" in reader.of_round(3)[1]
  assert reader.of_round(3) == ([1], None)


def test_a_kill_after_an_island_s_result_is_a_testing_hook():
  """config.testing.kill_island 'ISLAND@ROUND:after' kills the island's
  process right after its result of that round reached the coordinator;
  another suffix is one line."""
  settings = settings_lib.check(_run_config(_config(
      **{"testing.kill_island": "0@2, 1@1:after"})))
  assert settings.kill_islands == ((0, 2),)
  assert settings.kill_after == ((1, 1),)
  with pytest.raises(problems.ConfigError,
                     match="config.testing.kill_island: '1@1:later' is not"
                     ) as error:
    settings_lib.check(_run_config(_config(
        **{"testing.kill_island": "1@1:later"})))
  assert "\n" not in str(error.value)


@pytest.mark.slow
def test_an_island_killed_after_its_result_trains_the_next_round(namespace,
                                                                 tmp_path):
  """Island 1's process is SIGKILLed right after its round-1 result
  reached the coordinator (config.testing.kill_island='1@1:after'): its
  round-2 call waits for Ray's restart instead of failing at once, so every
  island takes part in every round (goodput 1). Each round's record says
  which process each island is: island 1's pid changes after the kill and
  its restarts count up, island 0's stay. The run starts with a control
  file holding 1e999, which is reported once and ignored (every slot
  trains): it does not stop the run."""
  workdir = tmp_path / "kill_after"
  workdir.mkdir()
  (workdir / membership.CONTROL_FILE).write_text('{"islands": [1e999]}')
  done = _elastic(namespace, str(workdir),
                  "--config.testing.kill_island=1@1:after")
  assert (done.stdout + done.stderr).count("members.json ignored") == 1
  assert (workdir / "killed_island_1_after_round_1").exists()
  records = _records(str(workdir))
  assert [r["members"] for r in records] == [[0, 1]] * 3
  assert [r["included"] for r in records] == [[1, 1]] * 3
  assert not any(r["failed"] for r in records)
  summary = _summary(str(workdir))
  assert summary["goodput"] == 1.0
  processes = [r["processes"] for r in records]
  pids = [[p[i]["pid"] for p in processes] for i in ("0", "1")]
  assert pids[0][0] == pids[0][1] == pids[0][2]
  assert pids[1][0] != pids[1][1] == pids[1][2]
  assert [[p[i]["restarts"] for p in processes] for i in ("0", "1")] == [
      [0, 0, 0], [0, 1, 1]]
  for p in processes:
    for i in ("0", "1"):
      assert p[i]["host"] == socket.gethostname()
      assert p[i]["ip"] == "127.0.0.1"  # the namespace's loopback
      assert p[i]["node"] == summary["island_nodes"][i]
  assert json.dumps(processes)  # plain JSON values
