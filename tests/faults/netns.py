"""Hosts in network namespaces, joined by veth pairs to a bridge, with real faults.

::

    with Network(3) as net:            # hosts h0, h1, h2 on 10.77.0.0/24
        t = net.target(1, regions)     # the kit's target engine, running inside h1
        d = net.driver(0)              # an initiator engine inside h0 (tests/faults/driver.py)
        net.netem(0, "delay 50ms")     # tc netem on h0's link (if the kernel has sch_netem)
        net.loss(0, 10)                # drop 10 % of h0's outgoing TCP packets (nftables)
        net.rate(0, "8mbit")           # a bandwidth cap (tc tbf): queueing delay
        net.link(0, up=False)          # pull h0's cable

Every namespace, link and rule lives inside namespaces this module creates:
no traffic reaches the machine's own network. Names carry this process's pid
and are removed on exit (and namespaces left by a dead earlier run are swept
at start). Needs root; :func:`unavailable` says why not, for ``pytest.skip``.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from mpcomm.testing import TargetProcess

PREFIX = "mpcf"
SUBNET = "10.77.0"
DRIVER = Path(__file__).with_name("driver.py")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


def _probe(*argv: str) -> str:
    try:
        r = _run(*argv, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return "" if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


_CACHE: dict[str, str] = {}


def unavailable() -> str:
    """Why namespaces cannot be used here ('' when they can)."""
    if "ns" not in _CACHE:
        if os.geteuid() != 0:
            _CACHE["ns"] = "needs root (network namespaces)"
        elif not shutil.which("ip"):
            _CACHE["ns"] = "needs iproute2 (ip)"
        else:
            name = f"{PREFIX}{os.getpid()}probe"
            why = _probe("ip", "netns", "add", name)
            _probe("ip", "netns", "del", name)
            _CACHE["ns"] = f"cannot create a network namespace: {why}" if why else ""
    return _CACHE["ns"]


def netem_unavailable() -> str:
    """Why ``tc netem`` cannot be used here ('' when it can)."""
    if "netem" not in _CACHE:
        why = unavailable()
        if not why:
            name = f"{PREFIX}{os.getpid()}nprobe"
            _probe("ip", "netns", "add", name)
            err = _probe("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
            _probe("ip", "netns", "del", name)
            why = f"tc netem unavailable: {err} (the kernel lacks sch_netem)" if err else ""
        _CACHE["netem"] = why
    return _CACHE["netem"]


def nft_unavailable() -> str:
    if "nft" not in _CACHE:
        why = unavailable() or ("" if shutil.which("nft") else "needs nftables (apt-get install nftables)")
        if not why:
            name = f"{PREFIX}{os.getpid()}fprobe"
            _probe("ip", "netns", "add", name)
            err = _probe("ip", "netns", "exec", name, "nft", "add", "table", "inet", "probe")
            _probe("ip", "netns", "del", name)
            why = f"nftables unusable: {err}" if err else ""
        _CACHE["nft"] = why
    return _CACHE["nft"]


def sweep_stale() -> None:
    """Remove namespaces an earlier, killed run of this module left behind (its pid is gone)."""
    r = _run("ip", "netns", "list", check=False)
    for line in r.stdout.splitlines():
        m = re.match(rf"({PREFIX}(\d+)\w*)", line.strip())
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            _run("ip", "netns", "del", m.group(1), check=False)


class Network:
    """``n`` hosts (namespaces h0..hn-1 at 10.77.0.1..n) on one bridge in a switch namespace."""

    def __init__(self, n: int = 2) -> None:
        self.n = n
        tag = f"{os.getpid()}{secrets.token_hex(2)}"
        self.switch = f"{PREFIX}{tag}s"
        self.hosts = [f"{PREFIX}{tag}h{i}" for i in range(n)]
        self.ifaces = [f"mp{tag[-6:]}{i}" for i in range(n)]  # <= 15 characters
        self.procs: list[Any] = []
        self._made: list[str] = []

    # -- topology ---------------------------------------------------------------------

    def __enter__(self) -> Network:
        why = unavailable()
        if why:
            raise RuntimeError(why)
        sweep_stale()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _ns(self, ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run("ip", "netns", "exec", ns, *argv, check=check)

    def _build(self) -> None:
        for ns in (self.switch, *self.hosts):
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            self._ns(ns, "ip", "link", "set", "lo", "up")
        self._ns(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        self._ns(self.switch, "ip", "link", "set", "br0", "up")
        for i, (ns, ifc) in enumerate(zip(self.hosts, self.ifaces)):
            # Create the pair inside the switch namespace, then move one end into the host:
            # nothing is ever created in the machine's own namespace.
            self._ns(self.switch, "ip", "link", "add", ifc, "type", "veth", "peer", "name", f"{ifc}p")
            self._ns(self.switch, "ip", "link", "set", ifc, "netns", ns)
            self._ns(self.switch, "ip", "link", "set", f"{ifc}p", "master", "br0")
            self._ns(self.switch, "ip", "link", "set", f"{ifc}p", "up")
            self._ns(ns, "ip", "addr", "add", f"{self.addr(i)}/24", "dev", ifc)
            self._ns(ns, "ip", "link", "set", ifc, "up")

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[i]]

    # -- engines ----------------------------------------------------------------------

    def target(self, i: int, regions: dict[str, list[Any]], transport: str = "tcp",
               config: dict[str, Any] | None = None) -> TargetProcess:
        """The conformance kit's target engine, inside host ``i``."""
        t = TargetProcess(transport, config=config, endpoint=f"{self.addr(i)}:0", regions=regions,
                          prefix=self.exec_prefix(i))
        self.procs.append(t)
        return t

    def driver(self, i: int, config: dict[str, Any] | None = None) -> Driver:
        d = Driver(self.exec_prefix(i), self.addr(i), config or {})
        self.procs.append(d)
        return d

    # -- faults -----------------------------------------------------------------------

    def netem(self, i: int, spec: str) -> None:
        """``tc qdisc replace ... netem <spec>`` on host ``i``'s link ("delay 50ms", "loss 10%", ...)."""
        why = netem_unavailable()
        if why:
            raise RuntimeError(why)
        self._ns(self.hosts[i], "tc", "qdisc", "replace", "dev", self.ifaces[i], "root", "netem", *spec.split())

    def rate(self, i: int, rate: str, latency: str = "200ms") -> None:
        """A bandwidth cap (tc tbf) on host ``i``'s outgoing link: queueing delay under load."""
        self._ns(self.hosts[i], "tc", "qdisc", "replace", "dev", self.ifaces[i], "root", "tbf", "rate", rate,
                 "burst", "32kbit", "latency", latency)

    def loss(self, i: int, percent: int) -> None:
        """Drop ``percent`` % of host ``i``'s outgoing TCP segments at random (nftables)."""
        why = nft_unavailable()
        if why:
            raise RuntimeError(why)
        ns = self.hosts[i]
        self._ns(ns, "nft", "delete", "table", "inet", "mpcf_loss", check=False)
        self._ns(ns, "nft", "add", "table", "inet", "mpcf_loss")
        self._ns(ns, "nft", "add", "chain", "inet", "mpcf_loss", "out",
                 "{ type filter hook output priority 0; }")
        self._ns(ns, "nft", "add", "rule", "inet", "mpcf_loss", "out", "meta", "l4proto", "tcp",
                 "numgen", "random", "mod", "100", "lt", str(percent), "counter", "drop")

    def dropped(self, i: int) -> int:
        """Packets host ``i``'s loss rule has dropped so far (0 without one): proof the fault was real."""
        r = self._ns(self.hosts[i], "nft", "list", "table", "inet", "mpcf_loss", check=False)
        m = re.search(r"counter packets (\d+)", r.stdout)
        return int(m.group(1)) if m else 0

    def clear(self, i: int) -> None:
        """Remove every fault from host ``i``: qdisc, loss rules, link back up."""
        self._ns(self.hosts[i], "tc", "qdisc", "del", "dev", self.ifaces[i], "root", check=False)
        self._ns(self.hosts[i], "nft", "delete", "table", "inet", "mpcf_loss", check=False)
        self.link(i, up=True)

    def link(self, i: int, up: bool) -> None:
        self._ns(self.hosts[i], "ip", "link", "set", self.ifaces[i], "up" if up else "down")

    # -- cleanup ----------------------------------------------------------------------

    def close(self) -> None:
        for p in reversed(self.procs):
            try:
                p.close()
            except Exception:  # noqa: BLE001
                try:
                    p.kill()
                except Exception:  # noqa: BLE001
                    pass
        self.procs.clear()
        for ns in reversed(self._made):
            _run("ip", "netns", "del", ns, check=False)
        self._made.clear()


class Driver:
    """An initiator engine in a host namespace, driven over stdin/stdout (see driver.py)."""

    def __init__(self, prefix: list[str], addr: str, config: dict[str, Any]) -> None:
        import json

        self.proc = subprocess.Popen([*prefix, sys.executable, str(DRIVER), json.dumps(
            {"endpoint": f"{addr}:0", "config": config})], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, bufsize=1)
        self.hello = self._read(30)

    def _read(self, timeout: float) -> dict[str, Any]:
        import json
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"driver did not answer within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"driver exited (code {self.proc.poll()})")
        return json.loads(line)

    def call(self, wait: float = 60, **cmd: Any) -> Any:
        import json

        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        reply = self._read(wait)
        if "fatal" in reply:
            raise RuntimeError(f"driver: {reply['fatal']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(wait=10, op="quit")
            except Exception:  # noqa: BLE001
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
