"""Network namespaces for tests that need a second "host": namespaces, veth links, addresses, processes.

::

    from mpcomm.testing import netns

    why = netns.unavailable()            # '' when namespaces can be made here (root, iproute2)
    with netns.Namespaces("demo") as ns:
        a, b = ns.add("a"), ns.add("b")  # two namespaces, loopback up in each
        ns.veth(a, "va", b, "vb")        # a veth pair, one end in each
        ns.address(a, "va", "10.77.0.1/24")
        ns.address(b, "vb", "10.77.0.2/24")
        proc = netns.popen(b, [sys.executable, "-m", "mpcomm.testing.target", spec])

``None`` as a namespace means this process's own one (for a test whose
initiator runs here and whose target runs "on another host"). :func:`two_hosts`
is the common case: one link between here (or a namespace) and a namespace,
on a private /24 picked at random.

Every name carries this process's pid (``mpcn<pid>-...``): :meth:`Namespaces.close`
(also run at exit) deletes what the set made, and namespaces a killed earlier
run left behind are swept when a new set opens. Deleting a namespace deletes
its ends of the veth pairs, so nothing outlives the set. Needs root and
iproute2; :func:`unavailable` says why not, for ``pytest.skip``. Traffic stays
on the links made here: only addresses a test assigns are dialled.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["PREFIX", "Namespaces", "TwoHosts", "exec_prefix", "ip", "popen", "probe", "random_net", "run", "run_in",
           "sweep_stale", "two_hosts", "unavailable"]

#: Every namespace this module makes is named ``PREFIX<pid>-...``; the pid is what :func:`sweep_stale` checks.
PREFIX = "mpcn"
_STALE = re.compile(rf"^({PREFIX}(\d+)-\S*)")


def run(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``argv`` with its output captured as text; CalledProcessError (with stderr) when ``check`` and it fails."""
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=timeout)


def probe(*argv: str) -> str:
    """'' when ``argv`` succeeds, else why not (its stderr, its exit code, or the OS error)."""
    try:
        r = run(*argv, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return "" if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


def exec_prefix(ns: str | None) -> list[str]:
    """The launcher that runs a command inside ``ns`` (``ip netns exec NS``; nothing for None)."""
    return ["ip", "netns", "exec", ns] if ns is not None else []


def run_in(ns: str | None, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` inside ``ns`` to completion (output captured)."""
    return run(*exec_prefix(ns), *argv, check=check)


def popen(ns: str | None, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
    """Start ``argv`` inside ``ns`` (``subprocess.Popen`` keywords pass through); the caller ends it."""
    return subprocess.Popen([*exec_prefix(ns), *argv], **kw)


def ip(ns: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip [-n ns] args...``."""
    return run("ip", *(["-n", ns] if ns is not None else []), *args, check=check)


_UNAVAILABLE: list[str] = []  # the answer, once asked: the probe makes and deletes a namespace


def unavailable() -> str:
    """Why network namespaces cannot be made here ('' when they can)."""
    if not _UNAVAILABLE:
        if os.geteuid() != 0:
            why = "network namespaces need root"
        elif shutil.which("ip") is None:
            why = "iproute2 (ip) is not installed"
        else:
            name = f"{PREFIX}{os.getpid()}-probe"
            err = probe("ip", "netns", "add", name)
            probe("ip", "netns", "del", name)
            why = f"cannot create a network namespace: {err}" if err else ""
        _UNAVAILABLE.append(why)
    return _UNAVAILABLE[0]


def sweep_stale() -> None:
    """Delete the namespaces of this module whose process is gone (a killed earlier run)."""
    for line in run("ip", "netns", "list", check=False).stdout.splitlines():
        m = _STALE.match(line.strip())
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            run("ip", "netns", "del", m.group(1), check=False)


class Namespaces:
    """A set of network namespaces and the veth links between them, all deleted by :meth:`close`.

    ``label`` goes into the names (``mpcn<pid>-<tag><label><name>``) to tell
    suites apart in ``ip netns list``. Raises RuntimeError with the reason
    when namespaces cannot be made here.
    """

    def __init__(self, label: str = "") -> None:
        why = unavailable()
        if why:
            raise RuntimeError(why)
        sweep_stale()
        #: Random per set: interface names in this process's own namespace must not collide with another run's.
        self.tag = secrets.token_hex(3)
        self.label = label
        self.made: list[str] = []
        self._root_links: list[str] = []
        atexit.register(self.close)

    def __enter__(self) -> Namespaces:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- namespaces and links ------------------------------------------------------------

    def add(self, name: str) -> str:
        """Make namespace ``name`` (returns its full name) with its loopback up."""
        ns = f"{PREFIX}{os.getpid()}-{self.tag}{self.label}{name}"
        run("ip", "netns", "add", ns)
        self.made.append(ns)
        run_in(ns, "ip", "link", "set", "lo", "up")
        return ns

    def ifname(self, suffix: str) -> str:
        """An interface name unique to this set (``mp<tag><suffix>``, at most 15 characters)."""
        name = f"mp{self.tag}{suffix}"
        if len(name) > 15:
            raise ValueError(f"interface name {name!r} is longer than the kernel's 15 characters")
        return name

    def veth(self, a: str | None, dev_a: str, b: str | None, dev_b: str) -> None:
        """A veth pair: ``dev_a`` in namespace ``a``, ``dev_b`` in ``b`` (None: this process's namespace).

        The pair is made inside ``a`` with its peer put straight into ``b``, so
        nothing appears in the machine's own namespace unless a side asks for it.
        """
        peer = ["peer", "name", dev_b] + (["netns", b] if b is not None else [])
        ip(a, "link", "add", dev_a, "type", "veth", *peer)
        if a is None:
            self._root_links.append(dev_a)
        elif b is None:
            self._root_links.append(dev_b)

    def address(self, ns: str | None, dev: str, cidr: str) -> None:
        """Give ``dev`` in ``ns`` the address ``cidr`` (``10.77.0.1/24``) and bring it up."""
        ip(ns, "addr", "add", cidr, "dev", dev)
        self.link(ns, dev, up=True)

    def link(self, ns: str | None, dev: str, up: bool) -> None:
        """Set ``dev`` in ``ns`` up or down (down: the cable is pulled, both ways)."""
        ip(ns, "link", "set", dev, "up" if up else "down")

    # The per-namespace commands, as methods too (``ns.run(host, ...)``): they need no state of the set.
    ip = staticmethod(ip)
    prefix = staticmethod(exec_prefix)
    run = staticmethod(run_in)
    popen = staticmethod(popen)

    # -- teardown ----------------------------------------------------------------------

    def close(self) -> None:
        """Delete every link and namespace of this set (idempotent; errors are ignored)."""
        for dev in self._root_links:
            run("ip", "link", "del", dev, check=False)
        self._root_links.clear()
        for ns in reversed(self.made):
            run("ip", "netns", "del", ns, check=False)
        self.made.clear()
        atexit.unregister(self.close)


@dataclass(frozen=True)
class TwoHosts:
    """Two ends of one private link: ``a`` (None: this process's namespace) and namespace ``b``."""

    a: str | None
    b: str
    dev_a: str
    dev_b: str
    addr_a: str
    addr_b: str

    @property
    def prefix_a(self) -> list[str]:
        """The launcher for a command on side a (empty when a is this process's namespace)."""
        return exec_prefix(self.a)

    @property
    def prefix_b(self) -> list[str]:
        """The launcher for a command on side b (``ip netns exec B``)."""
        return exec_prefix(self.b)


def random_net(first_octets: str) -> str:
    """``first_octets.N`` for a random N in 1..250: a /24 unlikely to be another concurrent run's."""
    return f"{first_octets}.{1 + secrets.randbelow(250)}"


@contextmanager
def two_hosts(label: str, first_octets: str = "10.231", *, here: bool = True) -> Iterator[TwoHosts]:
    """A namespace linked by veth to this process's namespace (``here``) or to a second namespace.

    Addresses ``<net>.1`` (side a) and ``<net>.2`` (side b) on a random /24 of
    ``first_octets``; both sides' loopback is up. Everything is deleted on exit.
    RuntimeError with the reason when namespaces cannot be made here.
    """
    with Namespaces(label) as ns:
        a = None if here else ns.add("a")
        b = ns.add("b")
        dev_a, dev_b = ns.ifname("a"), ns.ifname("b")
        net = random_net(first_octets)
        ns.veth(a, dev_a, b, dev_b)
        ns.address(a, dev_a, f"{net}.1/24")
        ns.address(b, dev_b, f"{net}.2/24")
        yield TwoHosts(a, b, dev_a, dev_b, f"{net}.1", f"{net}.2")
