"""Notifications over the native data port (plugins/tcp/_dataport.c NOTIFY frames and its Notes
queue): taken into the target's bounded queue and acknowledged without the target's GIL, in
order, with the sender the connection's handshake proved; the same limits and refusal as the
control channel; hostile lengths never crash the target."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tcp_support import Target, closed, error_code, raw_to, reply, req

import mpcomm
from mpcomm.control import PeerLink
from mpcomm.errors import BackPressureError
from mpcomm.plugins.tcp import dataport, wire

pytestmark = pytest.mark.skipif(dataport.load() is None, reason=f"native data port: {dataport.reason}")

U32, U64 = (1 << 32) - 1, (1 << 64) - 1
MAX_NOTIFY = 64 << 10


# -- a target whose interpreter is busy --------------------------------------------------------

# Spins in Python for SPIN seconds with a 10 s switch interval (a thread waiting for the GIL gets
# it only after 10 s), then reports what its queue and its callbacks received.
_SPINNER = textwrap.dedent("""
    import json, sys, threading, time, mpcomm
    cfg, spin_s, callbacks = json.loads(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
    e = mpcomm.Engine(cfg, transports=json.loads(sys.argv[4]))
    e.register(bytearray(1 << 20), name="kv")
    seen = []
    if callbacks:
        e.on_notification(lambda n: seen.append(n.data.hex()))   # observes, does not consume
    print(e.address, flush=True)
    sys.stdin.readline()                    # the initiator is connected
    def spin():
        end = time.monotonic() + spin_s
        print("spinning", flush=True)
        while time.monotonic() < end:       # holds the GIL throughout
            pass
    sys.setswitchinterval(10)
    t = threading.Thread(target=spin)
    t.start()
    t.join()
    sys.setswitchinterval(0.005)
    time.sleep(0.2)                         # the callback thread's turn
    notes = []
    while True:
        try:
            n = e.wait_notification(0)
        except TimeoutError:
            break
        notes.append([n.peer, n.region, n.data.hex()])
    print(json.dumps({"queue": notes, "callbacks": seen}), flush=True)
    sys.stdin.readline()
    e.close()
""")


class Spinner:
    def __init__(self, config: dict[str, Any], spin_s: float, callbacks: bool,
                 transports: tuple[str, ...] = ("tcp",)) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SPINNER, json.dumps(config), str(spin_s),
                                      "1" if callbacks else "0", json.dumps(list(transports))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.address = self._line()

    def _line(self) -> str:
        return self.proc.stdout.readline().strip()  # type: ignore[union-attr]

    def go(self) -> None:
        self.proc.stdin.write("go\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        assert self._line() == "spinning"
        time.sleep(0.2)  # the spinner has the GIL; with a 10 s switch interval it keeps it

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self._line())
        return out

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.mark.parametrize(("callbacks", "transports"), [(False, ("tcp",)), (True, ("tcp",)), (False, ("shm", "tcp"))],
                         ids=["queue", "with-callbacks", "shm-data"])
def test_notifying_writes_to_a_target_spinning_in_python_complete_within_the_switch_interval(
        make_engine: Any, callbacks: bool, transports: tuple[str, ...]) -> None:
    """shm-data: the data moves by shm (one-sided), the notification by tcp's native data port."""
    t = Spinner({}, 6.0, callbacks, transports)
    try:
        ini = make_engine({"plugins": {"tcp": {"connections": 1}}}, transports=list(transports))
        remote = ini.open(t.address, "kv", timeout=10)
        src = ini.allocate(4096)
        # The data connection is dialled and authenticated now (HELLO and authentication are Python's,
        # once per connection; with shm moving the data only a notification dials it).
        ini.write(src, remote, 0, 4096, notify=b"warm").result(5)
        t.go()
        lat = []
        t0 = time.monotonic()
        for i in range(20):
            src.view[:8] = i.to_bytes(8, "little")
            s = time.perf_counter()
            h = ini.write(src, remote, 0, 4096, notify=f"note-{i}".encode(), timeout=5)
            h.result(5)
            lat.append(time.perf_counter() - s)
            assert h.transport == transports[0]
        ini.notify(remote, b"bare", timeout=5)
        took = time.monotonic() - t0
        assert took < 4, f"20 notifying writes took {took:.1f} s against a target holding its GIL (10 s interval)"
        assert max(lat) < 2, f"slowest notifying write {max(lat):.2f} s"
        print(f"\nspinning target: notifying 4 KiB write p50 {sorted(lat)[10] * 1e6:.0f} us, max {max(lat) * 1e3:.1f} ms")
        got = t.report()
        want = [b"warm".hex()] + [f"note-{i}".encode().hex() for i in range(20)] + [b"bare".hex()]
        assert [n[2] for n in got["queue"]] == want  # in order, every one, the right payload
        assert {(n[0], n[1]) for n in got["queue"]} == {(ini.node_id, "kv")}  # the sender the handshake proved
        assert got["callbacks"] == (want if callbacks else [])  # the callbacks ran, later, in order
    finally:
        t.close()


def test_a_full_queue_refuses_the_sender_while_the_target_spins_and_loses_nothing(make_engine: Any) -> None:
    t = Spinner({"limits": {"max_queued_notifications": 4}}, 5.0, False)
    try:
        ini = make_engine({"plugins": {"tcp": {"connections": 1}}})
        remote = ini.open(t.address, "kv", timeout=10)
        src = ini.allocate(4096)
        ini.write(src, remote, 0, 4096).result(5)
        t.go()
        outcomes = []
        t0 = time.monotonic()
        for i in range(7):
            try:
                ini.write(src, remote, 0, 4096, notify=f"n{i}".encode(), timeout=5).result(5)
                outcomes.append("ok")
            except mpcomm.MpcommError as exc:
                outcomes.append(type(exc).__name__)
        took = time.monotonic() - t0
        assert outcomes == ["ok"] * 4 + ["BackPressureError"] * 3, outcomes
        assert took < 3, f"took {took:.1f} s: the refusals waited for the target's GIL"
        got = t.report()
        assert [bytes.fromhex(n[2]) for n in got["queue"]] == [b"n0", b"n1", b"n2", b"n3"]  # nothing lost
    finally:
        t.close()


def test_a_full_queue_is_a_retryable_back_pressure_error_and_draining_makes_room(make_engine: Any) -> None:
    tgt = make_engine({"limits": {"max_queued_notifications": 2, "max_queued_notify_bytes": 1 << 20}})
    buf = bytearray(4096)
    tgt.register(buf, name="kv")
    ini = make_engine()
    remote = ini.open(tgt.address, "kv", timeout=5)
    ini.notify(remote, b"a")
    ini.write(b"x" * 64, remote, 0, notify=b"b").result(5)
    with pytest.raises(BackPressureError, match="max_queued_notifications=2") as err:
        ini.write(b"y" * 64, remote, 0, notify=b"c").result(5)
    assert err.value.retryable
    # The note rode on the WRITE frame (wire.py FLAG_NOTE): refused before a byte of its data landed.
    assert bytes(buf[:64]) == b"x" * 64
    assert [tgt.wait_notification(1).data for _ in range(2)] == [b"a", b"b"]
    ini.notify(remote, b"d")
    assert tgt.wait_notification(1).data == b"d"


def test_the_control_channel_and_the_data_port_fill_one_queue(make_engine: Any) -> None:
    """Both paths end in the same native queue: one count limit, one FIFO."""
    tgt = make_engine({"limits": {"max_queued_notifications": 3}})
    tgt.register(bytearray(4096), name="kv")
    assert tgt.stats()["notifications_queued"] == 0
    native = make_engine(transports=["tcp"])
    r1 = native.open(tgt.address, "kv", timeout=5)
    native.notify(r1, b"1")  # data port
    # The control channel, as a peer that reaches no native data port sends them.
    link = PeerLink(tgt.address, local_info=native.info(), secret="", timeout=5, on_lost=lambda _l: None)
    try:
        assert link.request({"t": "notify", "region": "kv", "data": b"2".hex()}, 5)["t"] == "ok"
        native.notify(r1, b"3")
        with pytest.raises(BackPressureError):
            link.request({"t": "notify", "region": "kv", "data": b"4".hex()}, 5)
        with pytest.raises(BackPressureError):
            native.notify(r1, b"5")
    finally:
        link.close()
    assert tgt.stats()["notifications_queued"] == 3
    assert [tgt.wait_notification(1).data for _ in range(3)] == [b"1", b"2", b"3"]


# -- the frame, raw ----------------------------------------------------------------------------

def _notify(length: int, region: bytes = b"kv", payload: bytes | None = None, rid: int = 7,
            count: int | None = None) -> bytes:
    head = req(wire.OP_NOTIFY, length=length, count=len(region) if count is None else count, req_id=rid)
    return head + region + (payload if payload is not None else b"")


def test_hostile_notify_frames_close_the_connection_never_crash_the_target(spawn: Any) -> None:
    tgt: Target = spawn(config={"limits": {"max_notify_bytes": 100}})
    assert tgt.tcp.get("notify") is True

    def cut(frame: bytes) -> None:
        s = tgt.raw()
        s.sendall(frame)
        assert closed(s, 5), frame[:64]
        s.close()

    cut(_notify(U32, payload=b"z" * 4096))  # a length of 2^32-1
    cut(_notify(U64, payload=b"z" * 4096))  # 2^64-1: nothing is drained or allocated for it
    cut(_notify(U64 - 1, region=b""))
    cut(_notify(MAX_NOTIFY + 1, payload=b"z" * 4096))
    cut(_notify(4, count=U32))  # a region name of 2^32-1 bytes
    cut(_notify(4, count=1025))
    assert tgt.alive
    # Within MAX_NOTIFY but over this node's limits.max_notify_bytes: refused, the connection stays.
    s = tgt.raw()
    s.sendall(_notify(101, payload=b"q" * 101, rid=11))
    status, rid, _count, body = reply(s)
    assert (status, rid, error_code(body)) == (wire.ST_ERR, 11, "limit")
    assert "max_notify_bytes" in json.loads(body)["message"]
    # The frame's fields name no sender: the queue gets the node id HELLO proved ("raw-client").
    s.sendall(_notify(5, payload=b"hello", rid=12) + _notify(3, region="ö".encode() * 2, payload=b"abc", rid=13))
    assert reply(s)[:2] == (wire.ST_OK, 12) and reply(s)[:2] == (wire.ST_OK, 13)
    s.close()
    notes = json.loads(tgt.cmd("notes"))
    assert [(n["peer"], n["region"], n["data"]) for n in notes] == [("raw-client", "kv", "hello"),
                                                                  ("raw-client", "öö", "abc")]
    with mpcomm.Engine(transports=["tcp"]) as e:  # still serving
        e.write(b"ok", e.open(tgt.address, "kv", timeout=5), notify=b"after").result(5)
    assert json.loads(tgt.cmd("notes"))[-1]["data"] == "after"


def test_a_notify_frame_split_across_packets_and_a_short_one_are_handled(spawn: Any) -> None:
    tgt: Target = spawn()
    s = tgt.raw()
    frame = _notify(6, payload=b"sliced", rid=21)
    for i in range(len(frame)):  # byte by byte
        s.sendall(frame[i : i + 1])
    assert reply(s)[:2] == (wire.ST_OK, 21)
    s.sendall(_notify(100, payload=b"short"))  # 95 bytes never come: the deadline ends the connection
    s.shutdown(socket.SHUT_WR)
    assert closed(s, 15)
    s.close()
    assert [n["data"] for n in json.loads(tgt.cmd("notes"))] == ["sliced"]


def test_a_python_served_port_does_not_advertise_notify_and_the_control_channel_carries_them(spawn: Any) -> None:
    tgt: Target = spawn(config={"plugins": {"tcp": {"native_server": False}}})
    assert "notify" not in tgt.tcp
    with mpcomm.Engine(transports=["tcp"]) as e:
        e.write(b"ok", e.open(tgt.address, "kv", timeout=5), notify=b"via-control").result(5)
    assert json.loads(tgt.cmd("notes"))[-1]["data"] == "via-control"


# -- the queue itself ----------------------------------------------------------------------------

def test_the_native_queue_bounds_count_and_bytes_without_wrapping() -> None:
    m = dataport.load()
    q = m.Notes(max_count=3, max_bytes=10)
    assert q.put("p", "r", b"x" * 11, True) is not None  # over the bytes alone
    assert q.put("p", "r", b"x" * 10, True) is None
    assert q.put("p", "r", b"", True) is None  # the bytes are at their limit, the count is not
    assert "max_queued_notify_bytes=10" in q.put("p", "r", b"y", True)
    assert q.get(0) == ("p", "r", b"x" * 10)
    assert q.size() == (1, 0, 0)
    huge = m.Notes(max_count=U64, max_bytes=U64)  # sums near 2^64 never wrap into acceptance
    assert huge.put("p", "r", b"a" * 100, True) is None and huge.size()[1] == 100
    assert q.get(0) == ("p", "r", b"")
    assert q.get(0.01) is None and q.get(float("nan")) is None and q.get(-1) is None
    with pytest.raises(ValueError):
        q.put("p", "r", b"z" * (MAX_NOTIFY + 1), True)
    from mpcomm.engine.notify import MAX_NOTIFY as ENGINE_MAX

    assert m.MAX_NOTIFY == ENGINE_MAX == MAX_NOTIFY  # the C bound is the engine's


def test_the_native_queue_holds_notes_for_the_callbacks_in_order() -> None:
    m = dataport.load()
    q = m.Notes(max_count=2, max_bytes=100)
    q.set_callbacks(True)
    assert q.put("p", "r", b"1", False) is None  # a native delivery: waits for the callbacks
    assert q.put("p", "r", b"2", True) is None  # the control channel's: callbacks already ran
    assert q.get(0) is None  # the head waits for its callbacks: FIFO, no overtaking
    assert q.put("p", "r", b"3", False) is not None  # both count against the limit meanwhile
    seq, note = q.dispatch(0)
    assert note == ("p", "r", b"1") and q.size()[2] == 1
    assert q.dispatch(0) is None
    q.settle(seq, False)  # observed, not consumed: now wait_notification's
    assert [q.get(0), q.get(0)] == [("p", "r", b"1"), ("p", "r", b"2")]
    assert q.put("p", "r", b"4", False) is None
    seq, _ = q.dispatch(0)
    q.settle(seq, True)  # consumed: gone
    assert q.size() == (0, 0, 0)
    assert q.put("p", "r", b"5", False) is None
    q.close()  # no callback thread any more: what waited for one is wait_notification's
    assert q.dispatch(None) is None and q.get(0) == ("p", "r", b"5")


# -- generated frames against a server in this process (a crash would end the test run) ----------

@pytest.fixture(scope="module")
def small_target() -> Any:
    e = mpcomm.Engine({"limits": {"max_notify_bytes": 1000, "max_queued_notifications": 4}}, transports=["tcp"])
    e.register(bytearray(4096), name="kv")
    yield e
    e.close()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(count=st.sampled_from([0, 1, 2, 1023, 1024, 1025, 1 << 31, U32]) | st.integers(0, U32),
       length=st.sampled_from([0, 1, 999, 1000, 1001, MAX_NOTIFY, MAX_NOTIFY + 1, U32, 1 << 63, U64 - 1, U64])
       | st.integers(0, U64),
       body=st.integers(0, 2048))
def test_generated_notify_frames_get_an_answer_or_a_closed_connection(small_target: mpcomm.Engine, count: int,
                                                                      length: int, body: int) -> None:
    s = raw_to(small_target, "fuzz-client")
    try:
        s.sendall(req(wire.OP_NOTIFY, count=count, length=length, req_id=5) + b"n" * body)
        if count > 1024 or length > MAX_NOTIFY:
            assert closed(s, 5)
        elif body >= count + length:  # the whole frame arrived: one answer
            status, rid, _c, payload = reply(s)
            assert rid == 5
            if length > 1000:
                assert (status, error_code(payload)) == (wire.ST_ERR, "limit")
            else:
                assert status == wire.ST_OK or error_code(payload) == "back_pressure"
        while True:  # keep the queue from filling for the next example
            try:
                small_target.wait_notification(0)
            except TimeoutError:
                break
    finally:
        s.close()
    t = raw_to(small_target, "fuzz-client")  # the port still serves
    t.sendall(_notify(2, payload=b"ok", rid=9))
    assert reply(t)[:2] == (wire.ST_OK, 9)
    t.close()
    assert small_target.wait_notification(1).peer == "fuzz-client"
