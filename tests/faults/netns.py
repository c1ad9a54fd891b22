"""Hosts in network namespaces, joined by veth pairs to a bridge, with real faults.

::

    with Network(3) as net:            # hosts h0, h1, h2 on 10.77.0.0/24
        t = net.target(1, regions)     # the kit's target engine, running inside h1
        d = net.driver(0)              # an initiator engine inside h0 (tests/faults/driver.py)
        net.netem(0, "delay 50ms")     # tc netem on h0's link (if the kernel has sch_netem)
        net.loss(0, 10)                # drop 10 % of h0's outgoing TCP packets (nftables)
        net.rate(0, "8mbit")           # a bandwidth cap (tc tbf): queueing delay
        net.link(0, up=False)          # pull h0's cable

The namespaces, links and addresses come from :mod:`mpcomm.testing.netns`
(shared with tests/multihost and tests/topology); what is here is the fault
suite's own: the bridge, and the faults. Every namespace, link and rule lives
inside namespaces made for the run: no traffic reaches the machine's own
network. Needs root; :func:`unavailable` says why not, for ``pytest.skip``.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from mpcomm.testing import LineProcess, TargetProcess
from mpcomm.testing.netns import Namespaces, unavailable

__all__ = ["Driver", "Network", "netem_unavailable", "nft_unavailable", "unavailable"]

SUBNET = "10.77.0"
DRIVER = Path(__file__).with_name("driver.py")

_CACHE: dict[str, str] = {}


def _tool_unavailable(key: str, argv: list[str], missing: str) -> str:
    """'' when ``argv`` runs in a fresh namespace, else ``missing`` and why (cached per ``key``)."""
    if key not in _CACHE:
        why = unavailable()
        if not why:
            with Namespaces(f"{key}probe") as ns:
                err = ns.run(ns.add(""), *argv, check=False)
            why = f"{missing}: {err.stderr.strip() or f'exit {err.returncode}'}" if err.returncode else ""
        _CACHE[key] = why
    return _CACHE[key]


def netem_unavailable() -> str:
    """Why ``tc netem`` cannot be used here ('' when it can)."""
    return _tool_unavailable("netem", ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                             "tc netem unavailable (the kernel lacks sch_netem?)")


def nft_unavailable() -> str:
    """Why nftables rules cannot be used here ('' when they can)."""
    if shutil.which("nft") is None:
        return "needs nftables (apt-get install nftables)"
    return _tool_unavailable("nft", ["nft", "add", "table", "inet", "probe"], "nftables unusable")


class Network:
    """``n`` hosts (namespaces h0..hn-1 at 10.77.0.1..n) on one bridge in a switch namespace."""

    def __init__(self, n: int = 2) -> None:
        self.n = n
        self.procs: list[Any] = []
        self.ns: Namespaces | None = None
        self.switch = ""
        self.hosts: list[str] = []
        self.ifaces: list[str] = []

    # -- topology ---------------------------------------------------------------------

    def __enter__(self) -> Network:
        self.ns = Namespaces("f")  # RuntimeError with the reason where namespaces cannot be made
        try:
            self._build(self.ns)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _ns(self, ns: str, *argv: str, check: bool = True) -> Any:
        assert self.ns is not None
        return self.ns.run(ns, *argv, check=check)

    def _build(self, ns: Namespaces) -> None:
        self.switch = ns.add("s")
        self.hosts = [ns.add(f"h{i}") for i in range(self.n)]
        self.ifaces = [ns.ifname(str(i)) for i in range(self.n)]
        self._ns(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        ns.link(self.switch, "br0", up=True)
        for i, (host, ifc) in enumerate(zip(self.hosts, self.ifaces)):
            # The host's end in the host, the other on the switch's bridge: nothing is ever
            # created in the machine's own namespace.
            ns.veth(self.switch, f"{ifc}p", host, ifc)
            ns.ip(self.switch, "link", "set", f"{ifc}p", "master", "br0")
            ns.link(self.switch, f"{ifc}p", up=True)
            ns.address(host, ifc, f"{self.addr(i)}/24")

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def exec_prefix(self, i: int) -> list[str]:
        assert self.ns is not None
        return self.ns.prefix(self.hosts[i])

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
        """Host ``i``'s cable in (``up``) or pulled."""
        assert self.ns is not None
        self.ns.link(self.hosts[i], self.ifaces[i], up)

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
        if self.ns is not None:
            self.ns.close()


class Driver(LineProcess):
    """An initiator engine in a host namespace, driven with one JSON command per line (see driver.py)."""

    quit_line = json.dumps({"op": "quit"})

    def __init__(self, prefix: list[str], addr: str, config: dict[str, Any]) -> None:
        super().__init__([sys.executable, str(DRIVER), json.dumps({"endpoint": f"{addr}:0", "config": config})],
                         prefix=prefix)

    def call(self, wait: float = 60, **cmd: Any) -> Any:
        reply = json.loads(self.request(json.dumps(cmd), wait))
        if "fatal" in reply:
            raise RuntimeError(f"driver: {reply['fatal']}")
        return reply
