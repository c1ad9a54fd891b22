"""Connection floods and slow clients against the tcp data port and the control port.

The target is a real engine process (host.py). For every case: a good peer,
connected before the attack, is served during it (a write, verified); the
target process lives; and once the attackers are gone (or cut by the target)
its VmRSS, threads and open descriptors (``/proc/<pid>/status``,
``/proc/<pid>/fd``) return to their baseline within a generous bound.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support import OP_READ, OP_WRITE, HostProcess, back_to_baseline, data_request, resources, sha

import mpcomm
from mpcomm.peer import parse_endpoint
from mpcomm.testing.patterns import pattern

MiB = 1 << 20
FILL = 808
FLOOD = 300
CONFIG = {"transport": {"handshake_timeout_ms": 1500}, "limits": {"frame_timeout_ms": 2000}}

@pytest.fixture
def target() -> Iterator[HostProcess]:
    t = HostProcess("tcp", {"kv": [16 * MiB, "buffer", FILL]}, config=CONFIG)
    yield t
    t.close()


@pytest.fixture
def good(target: HostProcess) -> Iterator[tuple[mpcomm.Engine, mpcomm.RemoteRegion]]:
    with mpcomm.Engine({"runtime": {"abort_grace_ms": 1000}}, transports=["tcp"]) as e:
        r = e.open(target.address, "kv")
        e.write(b"warm", r, 0, timeout=5).result(10)
        yield e, r


def served(target: HostProcess, good: tuple[mpcomm.Engine, mpcomm.RemoteRegion], seed: int) -> None:
    e, r = good
    e.write(pattern(seed, 256 << 10), r, 8 * MiB, timeout=10).result(15)
    assert target.sha("kv", 8 * MiB, 256 << 10) == sha(pattern(seed, 256 << 10))
    assert target.pong()


def data_addr(target: HostProcess) -> tuple[str, int]:
    host, _ = parse_endpoint(target.address)
    return host, int(target.transport_info["tcp"]["port"])


def control_addr(target: HostProcess) -> tuple[str, int]:
    return parse_endpoint(target.address)


def flood(addr: tuple[str, int], n: int, source: str = "127.0.0.2") -> list[socket.socket]:
    socks = []
    for _ in range(n):
        try:
            socks.append(socket.create_connection(addr, timeout=5, source_address=(source, 0)))
        except OSError:
            break
    return socks


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        try:
            s.close()
        except OSError:
            pass


# -- the data port -------------------------------------------------------------------------


def _data_port_flood(target: HostProcess, good: Any) -> dict[str, int]:
    base = resources(target.pid)
    socks = flood(data_addr(target), FLOOD)
    try:
        assert len(socks) >= 64, f"only {len(socks)} connections could be made"
        served(target, good, 1)
    finally:
        close_all(socks)
    served(target, good, 2)
    return base


def test_data_port_flood_then_threads_and_fds_return(target: HostProcess, good: Any) -> None:
    base = _data_port_flood(target, good)
    back_to_baseline(target.pid, base, rss_slack=1 << 40, count_slack=4, within=20)


def test_data_port_flood_then_memory_returns(target: HostProcess, good: Any) -> None:
    base = _data_port_flood(target, good)
    back_to_baseline(target.pid, base, rss_slack=96 << 20, count_slack=4, within=2)


def test_data_port_flood_is_bounded_while_it_lasts(target: HostProcess, good: Any) -> None:
    base = resources(target.pid)
    socks = flood(data_addr(target), FLOOD)
    try:
        time.sleep(0.5)
        now = resources(target.pid)
        assert now["threads"] <= base["threads"] + 80, f"threads {base['threads']} -> {now['threads']}"
        assert now["rss"] <= base["rss"] + (96 << 20), f"VmRSS {base['rss'] >> 20} -> {now['rss'] >> 20} MiB"
    finally:
        close_all(socks)


def test_data_port_slow_clients_then_baseline(target: HostProcess, good: Any) -> None:
    """Clients trickling a header, and clients that send a write header then nothing: others are served."""
    base = resources(target.pid)
    e, r = good
    head = data_request(r, OP_WRITE, 4 * MiB, MiB, time.time() + 1.0)
    socks = flood(data_addr(target), 40)
    stop = threading.Event()

    def trickle() -> None:
        for k in range(len(head) - 1):
            if stop.is_set():
                return
            for s in socks[:20]:
                try:
                    s.send(head[k : k + 1])
                except OSError:
                    pass
            time.sleep(0.05)

    for s in socks[20:]:
        s.sendall(head + pattern(3, 4096))  # a write of 1 MiB that stalls after 4 KiB
    th = threading.Thread(target=trickle, daemon=True)
    th.start()
    try:
        served(target, good, 3)
        time.sleep(1.5)
        served(target, good, 4)
    finally:
        stop.set()
        th.join(10)
        close_all(socks)
    # The stalled writes landed, if at all, only inside their own range.
    bg = pattern(FILL, 16 * MiB)
    assert target.sha("kv", 4, 4 * MiB - 4) == sha(bg[4 : 4 * MiB])
    assert target.sha("kv", 5 * MiB, 3 * MiB) == sha(bg[5 * MiB : 8 * MiB])
    back_to_baseline(target.pid, base, rss_slack=96 << 20, count_slack=4, within=20)


def test_data_port_stalled_writer_releases_the_region_by_its_deadline(target: HostProcess, good: Any) -> None:
    _e, r = good
    s = socket.create_connection(data_addr(target), timeout=5)
    try:
        s.sendall(data_request(r, OP_WRITE, 4 * MiB, MiB, time.time() + 1.0) + pattern(3, 4096))
        time.sleep(2.5)  # deadline + grace + slack: the target must have let go
        assert target.reply("unregister kv 1").startswith("ok "), "the stalled writer still holds the region"
    finally:
        s.close()


def test_data_port_stalled_reader_releases_the_region_by_its_deadline(target: HostProcess, good: Any) -> None:
    _e, r = good
    s = socket.create_connection(data_addr(target), timeout=5)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        s.sendall(data_request(r, OP_READ, 0, 8 * MiB, time.time() + 1.0))
        time.sleep(2.5)
        assert target.reply("unregister kv 1").startswith("ok "), "the stalled reader still holds the region"
    finally:
        s.close()


# -- the control port ------------------------------------------------------------------------


def test_control_port_flood_and_slow_clients_are_cut_and_return_to_baseline(target: HostProcess, good: Any) -> None:
    """150 silent connections plus 40 trickling one byte every 0.3 s: all are cut by the handshake
    deadline (1.5 s here) while still connected; a good peer is served throughout; the target's
    threads, descriptors and memory return to their baseline with the attackers still holding sockets."""
    base = resources(target.pid)
    silent = flood(control_addr(target), 150, source="127.0.0.3")
    tricklers = flood(control_addr(target), 40, source="127.0.0.4")
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            for s in tricklers:
                try:
                    s.send(b"M")
                except OSError:
                    pass
            time.sleep(0.3)

    th = threading.Thread(target=trickle, daemon=True)
    th.start()
    try:
        served(target, good, 5)
        with mpcomm.Engine(transports=["tcp"]) as newcomer:  # a new peer connects during the attack
            newcomer.write(b"new", newcomer.open(target.address, "kv", timeout=10), 9 * MiB, timeout=5).result(10)
        time.sleep(2.0)  # past the handshake deadline
        back_to_baseline(target.pid, base, rss_slack=64 << 20, count_slack=4, within=15)
        served(target, good, 6)
    finally:
        stop.set()
        th.join(10)
        close_all(silent + tricklers)
    back_to_baseline(target.pid, base, rss_slack=64 << 20, count_slack=4, within=15)
