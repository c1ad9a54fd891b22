"""[limits] on the control endpoint, enforced against raw sockets on a target engine in
another process; the accept loop out of file descriptors; range-checked configuration."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from typing import Any, ClassVar

import pytest
from core_support import SlowTransport, Target, plugin_module
from rawpeer import RawPeer, fake_info, split_frames

import mpcomm
from mpcomm import auth, wire
from mpcomm.control import NotificationQueue, PeerLink
from mpcomm.peer import PeerInfo, parse_endpoint


@pytest.fixture
def limited() -> Any:
    started: list[Target] = []

    def start(**limits: Any) -> Target:
        t = Target({"kv": [4096, "buffer"]}, config={"limits": limits})
        started.append(t)
        return t

    yield start
    for t in started:
        t.close()


def serves(target: Target) -> None:
    with mpcomm.Engine(transports=["tcp"]) as e:
        e.write(b"ok", e.open(target.address, "kv", timeout=5)).result(5)
    assert target.alive


# -- notifications -----------------------------------------------------------------------------


def test_notification_size_is_enforced_by_the_receiver(limited: Any) -> None:
    target = limited()
    with RawPeer(target.address) as p:
        p.join()
        ok = p.request({"t": "notify", "region": "kv", "data": "ab" * (64 << 10)})
        assert ok["t"] == "ok"
        big = p.request({"t": "notify", "region": "kv", "data": "ab" * ((64 << 10) + 1)}, rid=2)
        assert big["t"] == "error" and big["code"] == "limit" and "max_notify_bytes" in big["message"]
        assert p.request({"t": "ping"}, rid=3)["t"] == "pong"  # the connection stays usable
    notes = json.loads(target.cmd("notes"))
    assert len(notes) == 1  # the oversized one never reached the engine


def test_notification_size_limit_is_configurable(limited: Any) -> None:
    target = limited(max_notify_bytes=100)
    with RawPeer(target.address) as p:
        p.join()
        assert p.request({"t": "notify", "region": "kv", "data": "00" * 101})["code"] == "limit"
    with mpcomm.Engine(transports=["tcp"]) as e:
        remote = e.open(target.address, "kv")
        with pytest.raises(mpcomm.LimitError):
            e.notify(remote, b"x" * 101)
        e.notify(remote, b"x" * 100)


def test_notification_rate_is_bounded_per_sender(limited: Any) -> None:
    target = limited(notify_rate=5)
    codes: list[str] = []
    with RawPeer(target.address) as p:
        p.join()
        for i in range(40):
            codes.append(p.request({"t": "notify", "region": "kv", "data": "00"}, rid=i + 1)["t"])
        refused = [p.request({"t": "notify", "region": "kv", "data": "00"}, rid=99)]
        assert p.request({"t": "ping"}, rid=100)["t"] == "pong"
    assert 5 <= codes.count("ok") <= 8 and codes.count("error") >= 30
    assert refused[0]["t"] == "error" and refused[0]["code"] == "back_pressure"
    time.sleep(0.5)  # the bucket refills
    with RawPeer(target.address) as p:
        p.join()
        assert p.request({"t": "notify", "region": "kv", "data": "00"})["t"] == "ok"


def test_notification_rate_is_shared_by_a_senders_control_connections(limited: Any) -> None:
    """Two control connections of one node id share its bucket; a bucket per connection gave twice
    the rate. Another node id has its own."""
    target = limited(notify_rate=5)
    info = fake_info()
    codes: list[str] = []
    with RawPeer(target.address) as p, RawPeer(target.address) as q:
        p.join(info=info)
        q.join(info=info)
        start = time.monotonic()
        for i in range(12):
            for peer in (p, q):
                codes.append(peer.request({"t": "notify", "region": "kv", "data": "00"}, rid=i + 1)["t"])
        took = time.monotonic() - start
        with RawPeer(target.address) as other:
            other.join()
            assert other.request({"t": "notify", "region": "kv", "data": "00"})["t"] == "ok"
    assert 5 <= codes.count("ok") <= 5 + int(took * 5) + 1, (codes, took)


def test_notification_queue_is_bounded_and_refuses_when_full() -> None:
    q = NotificationQueue(max_count=3, max_bytes=100)
    q.put("a", 10)
    q.put("b", 80)
    with pytest.raises(mpcomm.BackPressureError, match="max_queued_notify_bytes"):
        q.put("c", 20)
    q.put("c", 10)
    with pytest.raises(mpcomm.BackPressureError, match="max_queued_notifications"):
        q.put("d", 0)
    assert (len(q), q.nbytes) == (3, 100)
    assert [q.get(0), q.get(0), q.get(0)] == ["a", "b", "c"]
    assert q.nbytes == 0
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        q.get(0.1)
    assert time.monotonic() - start < 1


# -- connections, idle time, frame size and time -------------------------------------------


def _challenged(s: socket.socket) -> bool:
    """True if the node started a handshake on ``s`` (sent its challenge); False if it hung up."""
    s.settimeout(3)
    try:
        data = s.recv(64)
    except ConnectionResetError:
        return False
    return bool(data) and split_frames(data)[0][:2] == (b"MA", auth.T_CHALLENGE)


@pytest.mark.parametrize("which", ["max_connections", "max_connections_per_peer"])
def test_connection_limits(limited: Any, which: str) -> None:
    target = limited(**{which: 3, "max_connections" if which != "max_connections" else "max_connections_per_peer": 1000})
    held = [socket.create_connection(parse_endpoint(target.address)) for _ in range(3)]
    try:
        assert all(_challenged(s) for s in held)
        extra = socket.create_connection(parse_endpoint(target.address))
        with extra:
            assert not _challenged(extra)  # closed at once, no thread, no handshake
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5
    while True:  # the held slots are released as their connections close
        try:
            serves(target)
            break
        except mpcomm.PeerConnectionError:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_idle_connections_are_closed_but_live_links_keep_themselves_alive(limited: Any) -> None:
    target = limited(idle_timeout_ms=500)
    with RawPeer(target.address) as p:
        p.join()
        start = time.monotonic()
        p.expect_closed(5)
        assert 0.4 <= time.monotonic() - start < 2.5
    link = PeerLink(target.address, local_info=PeerInfo.from_dict(fake_info()), secret="", timeout=5,
                    on_lost=lambda _l: None)
    try:
        time.sleep(1.6)  # three idle periods: the link pinged in between
        assert link.alive
        assert link.request({"t": "ping"}, 5)["t"] == "pong"
    finally:
        link.close()


def test_frame_size_limit(limited: Any) -> None:
    target = limited(max_frame_bytes=4096)
    with RawPeer(target.address) as p:
        p.join()
        assert p.request({"t": "lookup", "name": "kv", "pad": "x" * 3000})["t"] == "region"
        wire.send_json(p.sock, {"t": "lookup", "name": "kv", "pad": "x" * 5000, "id": 2})
        p.expect_closed()
    serves(target)


def test_a_frame_must_arrive_whole_within_the_frame_timeout(limited: Any) -> None:
    target = limited(frame_timeout_ms=500)
    with RawPeer(target.address) as p:
        p.join()
        frame = wire.encode_json({"t": "ping", "id": 1})
        p.sock.sendall(frame[:5])
        start = time.monotonic()
        for byte in frame[5:]:
            time.sleep(0.2)
            try:
                p.sock.send(bytes([byte]))
            except OSError:
                break
            if time.monotonic() - start > 3:
                break
        p.expect_closed(3)
        assert time.monotonic() - start < 3
    serves(target)


# -- out of file descriptors ----------------------------------------------------------------

EMFILE_CHILD = textwrap.dedent("""
    import os, resource, sys, json
    import mpcomm
    e = mpcomm.Engine({"transport": {"handshake_timeout_ms": 20000}}, transports=["tcp"])
    e.register(bytearray(64), name="kv")
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 4, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    print(json.dumps({"address": e.address}), flush=True)
    for line in sys.stdin:
        if line.strip() == "stats":
            print(json.dumps({"backoffs": e._server.accept_backoffs, "cpu": sum(os.times()[:2])}), flush=True)
        else:
            break
    e.close()
""")


def test_accept_loop_survives_running_out_of_file_descriptors() -> None:
    proc = subprocess.Popen([sys.executable, "-c", EMFILE_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, bufsize=1)
    held: list[socket.socket] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        address = json.loads(proc.stdout.readline())["address"]

        def stats() -> dict[str, Any]:
            proc.stdin.write("stats\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
            return json.loads(proc.stdout.readline())  # type: ignore[union-attr]

        # Exhaust the child's descriptors with handshakes it must keep open (20 s deadline), then more.
        for _ in range(12):
            held.append(socket.create_connection(parse_endpoint(address), timeout=5))
        time.sleep(0.3)
        before = stats()
        time.sleep(1.5)
        after = stats()
        assert after["backoffs"] > before["backoffs"] > 0, "accept never hit EMFILE"
        # Backing off, not spinning: well under half a core over 1.5 s (a spin burns all of it).
        assert after["cpu"] - before["cpu"] < 0.5, f"accept loop burned {after['cpu'] - before['cpu']:.2f}s CPU"
        assert after["backoffs"] - before["backoffs"] < 200
        for s in held:
            s.close()
        held.clear()
        # Descriptors free: the loop accepts again and a real peer gets in.
        deadline = time.monotonic() + 10
        while True:
            try:
                with mpcomm.Engine(transports=["tcp"]) as e:
                    e.write(b"hi", e.open(address, "kv", timeout=3)).result(5)
                break
            except (mpcomm.PeerConnectionError, mpcomm.TransferTimeout):
                assert time.monotonic() < deadline, "the accept loop never recovered"
                time.sleep(0.2)
        assert proc.poll() is None
    finally:
        for s in held:
            s.close()
        if proc.poll() is None:
            proc.stdin.write("quit\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- configuration ranges ----------------------------------------------------------------------


class RangedTransport(SlowTransport):
    name: ClassVar[str] = "ranged"
    default_options: ClassVar[dict[str, Any]] = {"delay": 0.0, "connections": 4, "chunk": 1 << 20,
                                                 "mode": "a", "revoke_timeout": 2.0}
    option_ranges: ClassVar[dict[str, Any]] = {"connections": (1, 64), "chunk": (4096, None),
                                               "mode": ("a", "b")}


RANGED = plugin_module("ranged_plugin", RangedTransport)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("connections", 0, "plugins.ranged.connections must be between 1 and 64, not 0"),
    ("chunk", -1, "plugins.ranged.chunk must be at least 4096, not -1"),
    ("mode", "c", "plugins.ranged.mode must be one of 'a', 'b'"),
    ("connections", True, "plugins.ranged.connections must be int, not bool"),
    ("revoke_timeout", 2.0 ** 63, "plugins.ranged.revoke_timeout is out of range"),
    ("revoke_timeout", 90000.0, "plugins.ranged.revoke_timeout must be between 0 and 86400"),
    ("delay", float("nan"), "plugins.ranged.delay must be a finite number"),
])
def test_plugin_options_are_range_checked(key: str, value: Any, message: str) -> None:
    with pytest.raises(mpcomm.ConfigError) as info:
        mpcomm.Engine({"plugins": {"ranged": {key: value}}}, plugins=[RANGED], transports=["ranged"], autoload=False)
    assert message in str(info.value)


def test_plugin_options_in_range_are_accepted() -> None:
    with mpcomm.Engine({"plugins": {"ranged": {"connections": 64, "chunk": 4096, "mode": "b"}}},
                       plugins=[RANGED], transports=["ranged"], autoload=False) as e:
        assert e.transports["ranged"].ctx.options["connections"] == 64


@pytest.mark.parametrize(("section", "key"), [
    ("runtime", "request_timeout_ms"), ("runtime", "abort_grace_ms"), ("transport", "handshake_timeout_ms"),
    ("runtime", "queue_depth"), ("runtime", "worker_threads"), ("limits", "idle_timeout_ms"),
])
def test_huge_timeouts_and_sizes_are_config_errors_not_overflows(section: str, key: str) -> None:
    for value in (2**63 - 1, 0, -1):
        with pytest.raises(mpcomm.ConfigError, match=rf"{section}\.{key} must be between"):
            mpcomm.Config.from_dict({section: {key: value}})


def test_unknown_plugin_section_names_it_and_lists_installed() -> None:
    with pytest.raises(mpcomm.ConfigError) as info:
        mpcomm.Engine({"plugins": {"tpc": {"connections": 2}}}, transports=["tcp"])
    msg = str(info.value)
    assert "[plugins.tpc]" in msg and "tcp" in msg and "optional = true" in msg
    # A transport installed only on other nodes is fine when marked optional.
    with mpcomm.Engine({"plugins": {"tpc": {"optional": True, "connections": 2}}}, transports=["tcp"]):
        pass
    # An installed transport that is not running (here: shm, not selected) is not an error either.
    with mpcomm.Engine({"plugins": {"shm": {"chunk": 1 << 20}}}, transports=["tcp"]):
        pass


def test_engine_errors_for_weak_env_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPCOMM_SECRET", "hunter2")
    with pytest.raises(mpcomm.ConfigError, match="mpcomm secret"):
        mpcomm.Engine(transports=["tcp"])


def test_limits_defaults_are_documented() -> None:
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    for f in mpcomm.Config().limits.__dataclass_fields__:
        assert f"`limits.{f}`" in doc, f"docs/security.md does not document limits.{f}"
    assert os.path.exists(Path(__file__).parents[2] / "docs" / "reliability.md")
