"""Linux network namespaces joined by a bridge, with shaped links (root).

For what crosses a network between processes on one machine: elastic runs
with config.elastic.link_mbit (island_nodes.py) and the benchmarks
(benchmarks/shaped_links.py). Each process runs in a namespace of its own,
and its link is rate-limited with the tbf qdisc. Only the namespaces,
links and /etc/netns entries made here are touched, and `Network.close`
removes them (and ends every process left in them).
"""

import os
import shutil
import socket
import subprocess
import sys


def _sh(*cmd: str, check: bool = True) -> str:
  r = subprocess.run(cmd, capture_output=True, text=True)
  if check and r.returncode:
    raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): "
                       f"{r.stderr.strip()}")
  return r.stdout


def _kill_all(namespace: str) -> None:
  """SIGKILLs every process in `namespace`."""
  for pid in _sh("ip", "netns", "pids", namespace, check=False).split():
    try:
      os.kill(int(pid), 9)
    except ProcessLookupError:
      pass


def netem_available() -> bool:
  """Whether this kernel adds delay with tc's netem (sch_netem), tried on
  the loopback of a namespace made for it and removed."""
  name = f"dj{os.getpid()}netem"
  _sh("ip", "netns", "add", name)
  try:
    return subprocess.run(
        ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo",
         "root", "netem", "delay", "1ms"], capture_output=True).returncode == 0
  finally:
    _sh("ip", "netns", "del", name, check=False)


class Network:
  """`n` namespaces joined by veth pairs to a bridge of their own, holding
  SUBNET.2, SUBNET.3, ...; `shape` rate-limits each one's egress with tbf,
  `close` removes everything `create` made."""

  def __init__(self, n: int, subnet: str, host_address: bool = False):
    tag = f"dj{os.getpid()}"
    # With `host_address` the bridge holds SUBNET.1 in the namespace that
    # made it, so a process there reaches every namespace.
    self.host_address = f"{subnet}.1" if host_address else None
    self.bridge = f"{tag}br"
    self.ns = [f"{tag}n{i}" for i in range(n)]
    self.veth_ns = [f"{tag}v{i}" for i in range(n)]  # inside namespace i
    self.veth_host = [f"{tag}h{i}" for i in range(n)]  # on the bridge
    self.subnet = subnet
    self.addr = [f"{subnet}.{i + 2}" for i in range(n)]
    self._created: list[tuple[str, str]] = []  # (kind, name), in order
    self._made_etc_netns = False

  def create(self) -> None:
    if f"{self.subnet}." in _sh("ip", "-4", "route", "show", "table",
                                "all"):
      raise RuntimeError(f"subnet {self.subnet}.0/24 is routed already; "
                         f"pick another with --subnet")
    _sh("ip", "link", "add", self.bridge, "type", "bridge")
    self._created.append(("link", self.bridge))
    _sh("ip", "link", "set", self.bridge, "up")
    if self.host_address:
      _sh("ip", "addr", "add", f"{self.host_address}/24", "dev", self.bridge)
    if not os.path.isdir("/etc/netns"):
      os.makedirs("/etc/netns")
      self._made_etc_netns = True
    hostname = socket.gethostname()
    for ns, vn, vh, addr in zip(self.ns, self.veth_ns, self.veth_host,
                                self.addr):
      _sh("ip", "netns", "add", ns)
      self._created.append(("netns", ns))
      etc = f"/etc/netns/{ns}"
      os.makedirs(etc)
      self._created.append(("dir", etc))
      with open(f"{etc}/hosts", "w") as f:
        f.write(f"127.0.0.1 localhost\n::1 localhost\n{addr} {hostname}\n")
      _sh("ip", "link", "add", vh, "type", "veth", "peer", "name", vn)
      self._created.append(("link", vh))
      _sh("ip", "link", "set", vn, "netns", ns)
      _sh("ip", "link", "set", vh, "master", self.bridge)
      _sh("ip", "link", "set", vh, "up")
      self.exec(ns, "ip", "addr", "add", f"{addr}/24", "dev", vn)
      self.exec(ns, "ip", "link", "set", vn, "up")
      self.exec(ns, "ip", "link", "set", "lo", "up")

  def exec(self, ns: str, *cmd: str) -> str:
    return _sh("ip", "netns", "exec", ns, *cmd)

  def shape(self, mbit: float | None, delay_ms: float = 0.0,
            both_ways: bool = False) -> None:
    """Each namespace's egress at `mbit` (tbf; None: unshaped), with
    `delay_ms` of added delay (netem; netem_available says whether this
    kernel has it); `both_ways`: its ingress too (the bridge's end)."""
    for ns, vn, vh in zip(self.ns, self.veth_ns, self.veth_host):
      ends = [(("ip", "netns", "exec", ns, "tc", "qdisc"), vn)]
      if both_ways:  # the bridge's end, in the namespace that made it
        ends.append((("tc", "qdisc"), vh))
      for tc, dev in ends:
        if mbit is None:
          _sh(*tc, "del", "dev", dev, "root", check=False)
        elif delay_ms:
          _sh(*tc, "replace", "dev", dev, "root", "netem", "delay",
              f"{delay_ms}ms", "rate", f"{mbit}mbit")
        else:
          _sh(*tc, "replace", "dev", dev, "root", "tbf", "rate",
              f"{mbit}mbit", "burst", "64kb", "latency", "100ms")

  def counters(self) -> list[dict]:
    out = []
    for ns, vn in zip(self.ns, self.veth_ns):
      stats = f"/sys/class/net/{vn}/statistics"
      out.append({k: int(self.exec(ns, "cat", f"{stats}/{k}"))
                  for k in ("tx_bytes", "rx_bytes")})
    return out

  def kill_processes(self) -> None:
    """SIGKILLs every process in the namespaces."""
    for ns in self.ns:
      _kill_all(ns)

  def close(self) -> None:
    """Ends every process left in the namespaces, then removes what
    `create` made."""
    self.kill_processes()
    for kind, name in reversed(self._created):
      try:
        if kind == "netns":
          _sh("ip", "netns", "del", name, check=False)
        elif kind == "link":
          if os.path.exists(f"/sys/class/net/{name}"):
            _sh("ip", "link", "del", name, check=False)
        elif kind == "dir":
          shutil.rmtree(name, ignore_errors=True)
      except Exception as e:  # pylint: disable=broad-except
        print(f"cleanup of {kind} {name}: {e}", file=sys.stderr)
    self._created.clear()
    if self._made_etc_netns:
      try:
        os.rmdir("/etc/netns")
      except OSError:
        pass


class LoopbackNamespace:
  """One namespace with loopback only (a context manager): a server
  started in it (Ray) binds to its 127.0.0.1 and reaches nothing outside.
  On exit every process left in it is killed, and it is removed."""

  def __init__(self, name: str | None = None):
    self.name = name or f"dj{os.getpid()}lo"
    self._etc = f"/etc/netns/{self.name}"

  def __enter__(self) -> "LoopbackNamespace":
    _sh("ip", "netns", "add", self.name)
    try:
      _sh("ip", "-n", self.name, "link", "set", "lo", "up")
      os.makedirs(self._etc)
      # Ray resolves the hostname to find its node's address.
      with open(f"{self._etc}/hosts", "w") as f:
        f.write(f"127.0.0.1 localhost {socket.gethostname()}\n")
    except BaseException:
      self.__exit__(None, None, None)
      raise
    return self

  def command(self, *cmd: str) -> list[str]:
    """`cmd` run inside the namespace."""
    return ["ip", "netns", "exec", self.name, *cmd]

  def kill_everything(self) -> None:
    """SIGKILLs every process in the namespace."""
    _kill_all(self.name)

  def __exit__(self, *exc) -> None:
    self.kill_everything()
    _sh("ip", "netns", "del", self.name, check=False)
    shutil.rmtree(self._etc, ignore_errors=True)
