"""Regions under fault: unregistered on the target while requests are in flight, and
memory for a new registration refused. On loopback, for every transport on main.

Unregister: initiator threads keep writing and reading slots of the region
(disjoint, with guard gaps) while the target unregisters it. Each request ends
within its deadline, with success or a clear MpcommError; the target reports
the old memory's sha256 the moment ``unregister`` returned and no byte may
change it afterwards; every slot whose last write was reported complete holds
exactly that write, every guard gap its background; a second region on the
same target is served throughout.

Refused memory: RLIMIT_AS lowered inside the target process, and a size beyond
what the node holds: a clear AllocationError, and the target keeps serving.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support import SLACK, HostProcess, back_to_baseline, resources, sha, transports

import mpcomm
from mpcomm.testing.patterns import pattern

MiB = 1 << 20
SIZE = 32 * MiB
SLOT = 256 << 10
GAP = 4096
FILL = 606
DEADLINE = 2.5
GRACE = 1.0
CONFIG = {"runtime": {"abort_grace_ms": int(GRACE * 1000), "request_timeout_ms": int(DEADLINE * 1000)}}
# What a request hitting a region being unregistered may end in (besides success).
CLEAR = (mpcomm.AccessError, mpcomm.TransferTimeout, mpcomm.PeerConnectionError, mpcomm.TransferError)

pytestmark = pytest.mark.parametrize("transport", transports())


def slot_offset(i: int) -> int:
    return GAP + i * (SLOT + GAP)


NSLOTS = (SIZE - GAP) // (SLOT + GAP)


@pytest.fixture
def initiator(transport: str) -> Iterator[mpcomm.Engine]:
    with mpcomm.Engine(CONFIG, transports=[transport]) as e:
        yield e


@pytest.mark.parametrize("how", ["buffer", "allocate"])
def test_unregister_while_requests_are_in_flight(transport: str, how: str, initiator: mpcomm.Engine,
                                                 request: pytest.FixtureRequest) -> None:
    t = HostProcess(transport, {"kv": [SIZE, how, FILL], "other": [MiB, "buffer", 1]})
    try:
        kv = initiator.open(t.address, "kv")
        other = initiator.open(t.address, "other")
        state: dict[int, int | None] = {}  # slot -> seed of its last completed write (None: unknown)
        outcomes: list[tuple[str, float, BaseException | None]] = []
        lock = threading.Lock()
        stop = threading.Event()

        def worker(k: int) -> None:
            rng_seed = 1000 * k
            slots = range(k, NSLOTS, 3)
            buf = bytearray(SLOT)
            n = 0
            while not stop.is_set():
                for i in slots:
                    if stop.is_set():
                        break
                    n += 1
                    seed = rng_seed + n
                    kind = "read" if n % 4 == 0 else "write"
                    t0 = time.monotonic()
                    try:
                        if kind == "write":
                            fut = initiator.write(pattern(seed, SLOT), kv, slot_offset(i), timeout=DEADLINE)
                        else:
                            fut = initiator.read(buf, kv, slot_offset(i), timeout=DEADLINE)
                        fut.result(DEADLINE + GRACE + SLACK + 30)
                        err = None
                    except BaseException as exc:  # noqa: BLE001 - examined below
                        err = exc
                    took = time.monotonic() - t0
                    with lock:
                        outcomes.append((kind, took, err))
                        if kind == "write":
                            state[i] = seed if err is None else None
                        elif err is None and state.get(i) is not None:
                            assert bytes(buf) == pattern(state[i], SLOT), f"read of slot {i} returned wrong bytes"
                    if err is not None:
                        time.sleep(0.01)

        threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(3)]
        for th in threads:
            th.start()
        time.sleep(0.6)  # traffic in full flow
        reply = t.cmd("unregister kv 10", timeout=30)
        assert reply.startswith("ok "), reply
        at_unregister = reply.split()[1]
        t_unreg = time.monotonic()
        # The region is gone: the other region still serves, at once.
        initiator.write(b"still here", other, 0, timeout=5).result(10)
        time.sleep(0.5)  # more requests on the old descriptor, then let the threads finish theirs
        stop.set()
        for th in threads:
            th.join(DEADLINE + GRACE + SLACK + 40)
            assert not th.is_alive(), "a request never ended"
        time.sleep(0.5)
        assert t.sha("old:kv", 0, SIZE) == at_unregister, "a byte landed in the region after unregister returned"

        for kind, took, err in outcomes:
            assert took <= DEADLINE + GRACE + SLACK, f"a {kind} took {took:.1f}s against a {DEADLINE}s deadline"
            if err is not None:
                assert isinstance(err, CLEAR), f"{kind} ended in an unclear error: {type(err).__name__}: {err}"
        done = sum(1 for _, _, e in outcomes if e is None)
        assert done > 10, f"only {done} requests completed before the unregister: the case did not run"
        # Requests after the unregister are refused; later ones name the region as unknown or gone.
        with pytest.raises(mpcomm.MpcommError):
            initiator.write(b"x", kv, slot_offset(0), timeout=3).result(10)
        # Completed writes are present, guard gaps untouched (in the old memory, as unregister left it).
        bg = pattern(FILL, SIZE)
        for i in range(NSLOTS):
            off = slot_offset(i)
            assert t.sha("old:kv", off - GAP, GAP) == sha(bg[off - GAP : off]), f"guard before slot {i} changed"
            seed = state.get(i, -1)
            if seed == -1:
                assert t.sha("old:kv", off, SLOT) == sha(bg[off : off + SLOT]), f"untouched slot {i} changed"
            elif seed is not None:
                assert t.sha("old:kv", off, SLOT) == sha(pattern(seed, SLOT)), f"slot {i}: completed write missing"
        assert time.monotonic() - t_unreg < 60
        # Re-registering the name gives a new region the old descriptor cannot reach.
        assert t.cmd(f"register kv {SIZE} {how} {FILL}") == "ok"
        with pytest.raises(mpcomm.AccessError):
            initiator.write(b"stale", kv, 0, timeout=3).result(10)
        fresh = initiator.open(t.address, "kv")
        initiator.write(pattern(5, SLOT), fresh, GAP, timeout=5).result(10)
        assert t.sha("kv", GAP, SLOT) == sha(pattern(5, SLOT))
        assert t.pong()
    finally:
        t.close()


def _refused_under_rlimit_as(transport: str, initiator: mpcomm.Engine) -> str:
    """Lower RLIMIT_AS in the target to its VmSize + 512 MiB, ask for 2 GiB; return the refusal.

    Checks, under the lowered limit, that the target keeps serving: existing
    regions, a new peer's connection, a small registration; and that threads,
    fds and memory return to their baseline afterwards.
    """
    t = HostProcess(transport, {"kv": [4 * MiB, "buffer", FILL]})
    try:
        kv = initiator.open(t.address, "kv")
        initiator.write(b"before", kv, 0, timeout=5).result(10)
        base = resources(t.pid)
        vm = int(t.cmd("vmsize"))
        assert t.cmd(f"rlimit AS {vm + 512 * MiB}") == "ok"
        try:
            reply = t.reply(f"register big {2048 * MiB} allocate 1")
            assert reply.startswith("error "), f"2 GiB registered under a {vm + 512 * MiB}-byte address space: {reply}"
            initiator.write(pattern(2, MiB), kv, MiB, timeout=5).result(10)
            assert t.sha("kv", MiB, MiB) == sha(pattern(2, MiB))
            with mpcomm.Engine(CONFIG, transports=[transport]) as other:
                r = other.open(t.address, "kv")
                other.write(b"newcomer", r, 2 * MiB, timeout=5).result(10)
            assert t.cmd(f"register small {MiB} allocate 3") == "ok"
            small = initiator.open(t.address, "small")
            initiator.write(pattern(4, MiB), small, 0, timeout=5).result(10)
            assert t.sha("small", 0, MiB) == sha(pattern(4, MiB))
        finally:
            t.cmd("rlimit AS inf")
        back_to_baseline(t.pid, base, rss_slack=128 << 20, count_slack=4)
        return reply
    finally:
        t.close()


def test_registration_refused_under_a_lowered_address_space_limit_keeps_serving(
        transport: str, initiator: mpcomm.Engine) -> None:
    _refused_under_rlimit_as(transport, initiator)


def test_registration_refused_under_a_lowered_address_space_limit_is_an_allocation_error(
        transport: str, initiator: mpcomm.Engine) -> None:
    reply = _refused_under_rlimit_as(transport, initiator)
    assert reply.startswith("error AllocationError"), f"not a clear AllocationError: {reply!r}"


def test_registration_beyond_what_the_node_holds(transport: str, initiator: mpcomm.Engine) -> None:
    t = HostProcess(transport, {"kv": [MiB, "buffer", FILL]})
    try:
        with open("/proc/meminfo") as f:
            total = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal:"))
        reply = t.reply(f"register huge {4 * total} allocate 1")
        assert reply.startswith("error AllocationError"), reply
        assert str(4 * total) in reply or "GiB" in reply or "TiB" in reply, f"the error names no size: {reply}"
        kv = initiator.open(t.address, "kv")
        initiator.write(pattern(9, 4096), kv, 100, timeout=5).result(10)
        assert t.sha("kv", 100, 4096) == sha(pattern(9, 4096))
    finally:
        t.close()


def test_registration_under_a_lowered_memlock_limit(transport: str, initiator: mpcomm.Engine) -> None:
    """RLIMIT_MEMLOCK of 64 KiB: a transport that pins refuses with AllocationError; one that does not, registers.

    Either way nothing else breaks: the target keeps serving, and what it registered works.
    """
    t = HostProcess(transport, {"kv": [MiB, "buffer", FILL]})
    try:
        assert t.cmd("rlimit MEMLOCK 65536") == "ok"
        reply = t.reply(f"register locked {16 * MiB} allocate 1")
        assert reply == "ok" or reply.startswith("error AllocationError"), reply
        kv = initiator.open(t.address, "kv")
        initiator.write(pattern(9, 4096), kv, 0, timeout=5).result(10)
        assert t.sha("kv", 0, 4096) == sha(pattern(9, 4096))
        if reply == "ok":
            r = initiator.open(t.address, "locked")
            initiator.write(pattern(8, 8 * MiB), r, MiB, timeout=10).result(20)
            assert t.sha("locked", MiB, 8 * MiB) == sha(pattern(8, 8 * MiB))
    finally:
        t.close()


