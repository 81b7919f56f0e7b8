"""Each elastic island on a Ray node of its own, behind a link of its own,
all on this machine (config.elastic.link_mbit, as root).

Island i's node runs in a network namespace of its own (netns.py), joined
to a bridge by a veth pair whose two ends are rate-limited with tc's tbf
(and delayed with netem, where the kernel has it), so everything between
the island and the coordinator (its params out, x back, Ray's own calls)
crosses a shaped link both ways. The coordinator's process starts Ray's
head on the bridge's address (SUBNET.1) in its own namespace; each island
node offers one unit of diloco_island_i, so island i runs there and only
there (config.elastic.pin_islands). Only the namespaces, links and
/etc/netns entries made here are touched; `close` ends the nodes and
removes them, and the coordinator's watch (ray_watch.py) ends the nodes'
processes with the rest of the run's Ray if the coordinator dies.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import ray

from diloco_jax.elastic.fleet import island_resource
from diloco_jax.elastic import netns

# How long the island nodes may take to join the head (each starts a
# raylet and its agents: seconds on an idle machine).
_JOIN_TIMEOUT_S = 120.0


class IslandNodes:
  """`islands` namespaces behind links of `mbit` Mbit/s each way (and
  `delay_ms`), made by `create`; `join` starts a Ray node in each, joined
  to the head at the bridge's address; `close` ends and removes
  everything."""

  def __init__(self, islands: int, mbit: float, delay_ms: float = 0.0):
    self.islands, self.mbit, self.delay_ms = islands, mbit, delay_ms
    self.network: netns.Network | None = None
    self._nodes: list[subprocess.Popen] = []
    # Where the nodes keep their Ray sessions (ray_watch.py ends the
    # processes that write there).
    self.nodes_dir = f"/tmp/dj{os.getpid()}nodes"

  @property
  def head_address(self) -> str:
    """The bridge's address in this process's namespace: where Ray's head
    listens for the island nodes."""
    return self.network.host_address

  @property
  def addresses(self) -> list[str]:
    """Island i's node's address."""
    return list(self.network.addr)

  def create(self) -> "IslandNodes":
    """The namespaces, the bridge (SUBNET.1 here) and the shaped links, on
    a /24 of 10.0.0.0/8 that nothing routes yet."""
    for attempt in range(20):
      pid = os.getpid() + attempt
      network = netns.Network(self.islands,
                              f"10.{150 + pid % 100}.{pid // 100 % 250}",
                              host_address=True)
      try:
        network.create()
      except RuntimeError as error:
        network.close()
        if "is routed already" in str(error):
          continue
        raise
      self.network = network
      break
    else:
      raise RuntimeError("no free /24 in 10.150-249.x.0 for the island "
                         "nodes' network")
    self.network.shape(self.mbit, self.delay_ms, both_ways=True)
    return self

  def join(self, gcs_address: str, num_cpus: int = 1) -> None:
    """Starts island i's Ray node in namespace i, joined to the head at
    `gcs_address` (HOST:PORT on the bridge), offering
    island_resource(i); returns once every node is in the cluster."""
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    for i, (namespace, address) in enumerate(zip(self.network.ns,
                                                 self.addresses)):
      self._nodes.append(subprocess.Popen(
          ["ip", "netns", "exec", namespace, ray_cli, "start",
           f"--address={gcs_address}", f"--node-ip-address={address}",
           f"--num-cpus={num_cpus}", "--block", "--disable-usage-stats",
           f"--resources={json.dumps({island_resource(i): 1})}",
           # Nodes on one machine in one Ray temp dir would share the
           # session's sockets: a node's object store then fails to bind
           # (Address already in use) and the node dies. Each its own
           # (short: a socket's path is at most 107 bytes).
           f"--temp-dir={os.path.join(self.nodes_dir, str(i))}"],
          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
          start_new_session=True))
    deadline = time.monotonic() + _JOIN_TIMEOUT_S
    while True:
      offered = ray.cluster_resources()
      missing = [i for i in range(self.islands)
                 if not offered.get(island_resource(i))]
      if not missing:
        return
      ended = [i for i, node in enumerate(self._nodes)
               if node.poll() is not None]
      if ended or time.monotonic() > deadline:
        why = ("its `ray start` ended: "
               + self._nodes[ended[0]].stderr.read().decode()[-500:]
               if ended else f"not within {_JOIN_TIMEOUT_S:.0f} s")
        raise RuntimeError(f"island {(ended or missing)[0]}'s Ray node did "
                           f"not join the head at {gcs_address}: {why}")
      time.sleep(0.5)

  def link_bytes(self) -> dict[str, dict[str, int]]:
    """island -> the bytes its link carried so far, "up" (from its node)
    and "down" (to it): read off the bridge's end of its veth, in this
    process's namespace."""
    out = {}
    for i, veth in enumerate(self.network.veth_host):
      stats = f"/sys/class/net/{veth}/statistics"
      with open(f"{stats}/rx_bytes") as up, open(f"{stats}/tx_bytes") as down:
        out[str(i)] = {"up": int(up.read()), "down": int(down.read())}
    return out

  def close(self) -> None:
    """Ends the nodes and removes the namespaces, links and bridge."""
    for node in self._nodes:
      if node.poll() is None:
        node.kill()
    if self.network is not None:
      self.network.close()
    for node in self._nodes:
      node.wait()
    self._nodes.clear()
    shutil.rmtree(self.nodes_dir, ignore_errors=True)
