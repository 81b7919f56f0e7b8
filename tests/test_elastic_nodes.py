"""Elastic islands on Ray nodes of their own, behind shaped links
(config.elastic.link_mbit, elastic/island_nodes.py): each island's node in
a network namespace of its own, joined to the coordinator's by a bridge,
every byte between them through a tbf-limited veth; everything made is
gone after the run, and after the coordinator's SIGKILL.

The runs start inside a loopback-only namespace of the test's own
(test_elastic.namespace), so the bridge and the island namespaces hang off
it and nothing reaches the machine's own network."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from diloco_jax.config import problems
from diloco_jax.elastic import driver
from diloco_jax.elastic import netns
from diloco_jax.elastic import settings as settings_lib
from tests import test_elastic

_config = test_elastic._config  # pylint: disable=protected-access
_run_config = test_elastic._run_config  # pylint: disable=protected-access
_records = test_elastic._records  # pylint: disable=protected-access
namespace = test_elastic.namespace

# A model whose sync (1.2 MB of fp32 each way per island) is many times
# tbf's 64 kB burst, so the link's rate shows in every round.
_MODEL = {"model.d_model": 128, "model.num_heads": 4, "model.head_dim": 32,
          "model.mlp_dim": 512, "model.num_layers": 2}
_MBIT = 10.0


def _namespaces() -> set[str]:
  return set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                            text=True).stdout.split())


def _flags(overrides: dict) -> list[str]:
  return [f"--config.{name}={value}" for name, value in overrides.items()]


@pytest.mark.slow
def test_islands_run_on_nodes_of_their_own_behind_shaped_links(
    namespace, tmp_path):
  """Two islands, each on a Ray node in its own namespace behind a 10
  Mbit/s link: each island's records name its own node and address on the
  bridge; no round is shorter than its bytes at the link's rate; nothing
  the run made is left."""
  workdir = tmp_path / "run"
  done = test_elastic._elastic(  # pylint: disable=protected-access
      namespace, workdir, *_flags({**_MODEL, "elastic.link_mbit": _MBIT}))
  # JAX's probe for platforms this machine lacks is not news
  # (quiet_logs.QuietLibraries).
  assert "libtpu" not in done.stderr + done.stdout
  records = _records(workdir)
  summary = json.loads((workdir / "summary.json").read_text())
  assert len(records) == 3 and summary["goodput"] == 1.0
  for record in records:
    processes = record["processes"]
    ips = [processes[str(i)]["ip"] for i in range(2)]
    nodes = {processes[str(i)]["node"] for i in range(2)}
    # Island i's node holds SUBNET.(i + 2); the head SUBNET.1.
    assert [ip.rsplit(".", 1)[1] for ip in ips] == ["2", "3"], ips
    assert ips[0].rsplit(".", 1)[0] == ips[1].rsplit(".", 1)[0]
    assert len(nodes) == 2
  # Each island's params went up its own link (tbf lets a 64 kB burst
  # through at once, then the rate): a round that took less than that
  # would mean the bytes did not cross the shaped link.
  up_bytes = summary["ray_bytes"] / (len(records) * 2)
  floor_s = (up_bytes - 64 * 1024) * 8 / (_MBIT * 1e6)
  assert floor_s > 0.5
  for record in records[1:]:  # the first round holds compiles as well
    assert record["round_seconds"] >= floor_s, (record, floor_s)
  # What the run made is gone (other tests' namespaces may come and go).
  made = summary["links"]
  assert made["mbit"] == _MBIT and len(made["namespaces"]) == 2
  assert not set(made["namespaces"]) & _namespaces()
  assert not os.path.exists(made["nodes_dir"])


# Two island nodes behind 10 Mbit/s links each make a 2.1 MB result at
# once; the script prints how much of each island's result had crossed its
# link when the first result was taken.
_PULLS = r"""
import json
import numpy as np
import ray
from diloco_jax.elastic import fetches as fetches_lib
from diloco_jax.elastic import island_nodes
from diloco_jax.elastic.fleet import island_resource

SIZE = 2_120_000
nodes = island_nodes.IslandNodes(2, 10.0).create()
try:
  ray.init(address="local", include_dashboard=False, num_cpus=1,
           configure_logging=False, _node_ip_address=nodes.head_address)
  nodes.join(ray.get_runtime_context().gcs_address)

  @ray.remote(num_cpus=0)
  class Island:
    def result(self):
      return np.ones(SIZE // 4, np.float32)

  islands = [Island.options(resources={island_resource(i): 1}).remote()
             for i in range(2)]
  before = nodes.link_bytes()
  fetches = fetches_lib.Fetches()
  refs = [island.result.remote() for island in islands]
  for ref in refs:
    fetches.watch(ref)
  first = fetches.wait(refs)[0]
  fetches.take(first)
  at_first = nodes.link_bytes()
  for ref in refs:
    if ref != first:
      fetches.take(ref)
  print(json.dumps({i: (at_first[i]["up"] - before[i]["up"]) / SIZE
                    for i in before}))
finally:
  ray.shutdown()
  nodes.close()
"""


@pytest.mark.slow
def test_the_islands_results_cross_their_links_at_once(namespace):
  """Two islands' results, made at once, cross their own links at once:
  when the first is taken, the other has crossed most of its link too
  (fetches.py keeps one wait over both). Waited for one at a time
  (ray.wait for one, then ray.get), the other's link had carried 0.006 of
  it; measured now: all of it (1.03 of its bytes, Ray's and TCP's own
  included), 3 runs of 3."""
  done = subprocess.run(
      namespace.command(sys.executable, "-c", _PULLS),
      env={**os.environ, "PYTHONPATH": str(test_elastic.REPO)},
      capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
  crossed = json.loads(done.stdout.strip().splitlines()[-1])
  assert min(crossed.values()) > 0.5, crossed


@pytest.mark.slow
def test_a_killed_coordinator_takes_its_island_nodes_with_it(
    namespace, tmp_path):
  """SIGKILL the coordinator mid-run: its watch ends the island nodes'
  Ray processes and removes their namespaces (with their /etc/netns
  entries), the bridge and their Ray directory within seconds."""
  workdir = tmp_path / "run"
  run = test_elastic._elastic(  # pylint: disable=protected-access
      namespace, workdir, *_flags({**_MODEL, "elastic.link_mbit": _MBIT,
                                   "total_steps": 400}), wait=False)
  try:
    deadline = time.monotonic() + 300
    while not (workdir / "metrics.jsonl").exists():
      assert run.poll() is None, run.stdout.read()[-3000:]
      assert time.monotonic() < deadline
      time.sleep(0.5)
    # The run's island namespaces: named after its coordinator's pid.
    coordinator = _coordinator_pid(namespace)
    made = {f"dj{coordinator}n{i}" for i in range(2)}
    assert made <= _namespaces(), (made, _namespaces())
    os.kill(coordinator, signal.SIGKILL)
    deadline = time.monotonic() + 20
    nodes_dir = f"/tmp/dj{coordinator}nodes"
    bridge = f"dj{coordinator}br"

    def left():
      links = subprocess.run(["ip", "-n", namespace.name, "link", "show"],
                             capture_output=True, text=True).stdout
      return (_namespaces() & made, os.path.exists(nodes_dir),
              {ns for ns in made if os.path.exists(f"/etc/netns/{ns}")},
              bridge in links)

    while any(left()):
      assert time.monotonic() < deadline, left()
      time.sleep(0.2)
  finally:
    run.kill()
    run.wait()


def _coordinator_pid(namespace) -> int:
  """The elastic coordinator's process in the test's namespace."""
  for pid in subprocess.run(["ip", "netns", "pids", namespace.name],
                            capture_output=True, text=True).stdout.split():
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if b"diloco_jax.elastic\0" in f.read():
          return int(pid)
    except OSError:
      continue
  raise AssertionError("no coordinator process in the namespace")


def test_shaped_links_need_root_and_a_run_of_their_own(monkeypatch):
  """Each refusal is one line, before Ray or any write."""
  config = _config(**{"elastic.link_mbit": 10.0})
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  with pytest.raises(problems.ConfigError,
                     match=r"link_mbit=10 .* needs root") as error:
    settings_lib.check(_run_config(config))
  assert "\n" not in str(error.value)
  monkeypatch.undo()
  with pytest.raises(problems.ConfigError, match="leave --ray_address out"):
    driver.run(_run_config(config), "/nonexistent/never-written",
               ray_address="127.0.0.1:1")
  monkeypatch.setattr(netns, "netem_available", lambda: False)
  with pytest.raises(problems.ConfigError, match="needs tc's netem"):
    settings_lib.check(_run_config(_config(**{
        "elastic.link_mbit": 10.0, "elastic.link_delay_ms": 20.0})))
  for overrides, message in (
      ({"elastic.link_delay_ms": 20.0}, "needs a shaped link"),
      ({"elastic.link_mbit": -1.0}, "link_mbit=-1.0 must be a number"),
      ({"elastic.link_mbit": float("inf")}, "must be a number >= 0")):
    with pytest.raises(problems.ConfigError, match=message):
      settings_lib.check(_run_config(_config(**overrides)))
  settings = settings_lib.check(_run_config(config))
  assert settings.link_mbit == 10.0 and settings.pin_islands
