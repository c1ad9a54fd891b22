"""A notifying tcp write is one WRITE frame that carries its note (wire.py FLAG_NOTE), served alike by
the native data port (_dataport.c do_write_note) and by server.py (_write_note): the data lands,
then the note is queued, then one reply; a refusal (full queue, over a limit, a bad region) comes
before a byte lands; hostile lengths close the connection and never crash the target; and the
initiator sends it with no notify worker (Transport.carries_notification)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tcp_support import Target, closed, error_code, raw_to, reply

import mpcomm
from mpcomm.control import NotificationQueue
from mpcomm.errors import BackPressureError, LimitError
from mpcomm.plugins.tcp import dataport, wire
from mpcomm.plugins.tcp.server import Server
from mpcomm.plugins.tcp.transport import TcpTransport

U32, U64 = (1 << 32) - 1, (1 << 64) - 1
MAX_NOTIFY = 64 << 10

SERVERS = [pytest.param(True, id="native", marks=pytest.mark.skipif(
               dataport.load() is None, reason=f"native data port: {dataport.reason}")),
           pytest.param(False, id="python")]


def _config(native: bool, **limits: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {"plugins": {"tcp": {"native_server": native}}}
    if limits:
        cfg["limits"] = limits
    return cfg


def noting(remote: mpcomm.RemoteRegion | None = None, *, offset: int = 0, data: bytes = b"", note: bytes = b"",
           name: bytes = b"kv", count: int | None = None, note_len: int | None = None, req_id: int = 1,
           flags: int = wire.FLAG_NOTE, op: int = wire.OP_WRITE) -> bytes:
    """A WRITE frame carrying a note: header, NOTE_LEN, name, note, data (any field overridable)."""
    rid, token, epoch = (remote.region_id, remote.token, int(remote.epoch, 16)) if remote is not None else (0, 0, 0)
    head = wire.REQ.pack(wire.REQ_MAGIC, op, flags, len(name) if count is None else count, req_id, rid, token, epoch,
                         offset, len(data), time.time() + 10)
    return head + wire.NOTE_LEN.pack(len(note) if note_len is None else note_len) + name + note + data


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("native", SERVERS)
def test_a_notifying_write_is_one_frame_and_no_notify_worker_runs(spawn: Any, native: bool) -> None:
    tgt: Target = spawn(config=_config(native))
    assert tgt.tcp.get("write_note") is True
    assert ("notify" in tgt.tcp) == native  # bare notifications: NOTIFY frames only to the native port
    with mpcomm.Engine({"plugins": {"tcp": {"connections": 1}}}, transports=["tcp"]) as e:
        remote = e.open(tgt.address, "kv", timeout=5)
        for i in range(5):
            data = bytes([i + 1]) * 4096
            note = json.dumps({"off": 4096 * i, "len": 4096, "sha": _sha(data)}).encode()
            h = e.write(data, remote, 4096 * i, notify=note)
            h.result(5)
            assert h.transport == "tcp"
        # Threads of the engine's notify pool start lazily: none ever started.
        workers = [t.name for t in threading.enumerate() if t.name.startswith("mpcomm-notify_")]
        assert workers == [], workers
    notes = json.loads(tgt.cmd("notes"))
    assert [n["peer"] for n in notes] == [e.node_id] * 5  # the sender HELLO and authentication proved
    assert [n["region"] for n in notes] == ["kv"] * 5
    assert all(n["data_in_place"] for n in notes), notes  # each note after its data
    assert [json.loads(n["data"])["off"] for n in notes] == [4096 * i for i in range(5)]


@pytest.mark.parametrize("native", SERVERS)
def test_a_full_queue_refuses_before_the_data_lands(spawn: Any, native: bool) -> None:
    tgt: Target = spawn(config=_config(native, max_queued_notifications=2))
    with mpcomm.Engine(transports=["tcp"]) as e:
        remote = e.open(tgt.address, "kv", timeout=5)
        e.write(b"a" * 64, remote, 0, notify=b"1").result(5)
        e.write(b"b" * 64, remote, 64, notify=b"2").result(5)
        for _ in range(6):  # the target's refusals say nothing about the path: it never cools down
            with pytest.raises(BackPressureError, match="max_queued_notifications=2") as err:
                e.write(b"c" * 64, remote, 0, notify=b"3").result(5)
            assert err.value.retryable
        # Nothing of the refused request landed: the region holds what the first write left.
        assert tgt.cmd("sha kv 0 128") == _sha(b"a" * 64 + b"b" * 64)
        # The connection serves on: a write without a note lands.
        e.write(b"d" * 64, remote, 128).result(5)
        assert tgt.cmd("sha kv 128 64") == _sha(b"d" * 64)
    assert [n["data"] for n in json.loads(tgt.cmd("notes"))] == ["1", "2"]


@pytest.mark.parametrize("native", SERVERS)
def test_a_refused_region_or_an_oversized_note_touches_nothing(spawn: Any, native: bool) -> None:
    tgt: Target = spawn(config=_config(native, max_notify_bytes=100))
    with mpcomm.Engine(transports=["tcp"]) as e:
        remote = e.open(tgt.address, "kv", timeout=5)
        with pytest.raises(LimitError, match="max_notify_bytes"):
            e.write(b"x" * 64, remote, 0, notify=b"n" * 101).result(5)
        assert tgt.cmd("sha kv 0 64") == _sha(bytes(64))
    s = tgt.raw()
    s.sendall(noting(dataclasses.replace(remote, token=remote.token ^ 1), data=b"y" * 32, note=b"never", req_id=3))
    status, rid, _c, body = reply(s)
    assert (status, rid, error_code(body)) == (wire.ST_ERR, 3, "permission_denied")
    # Out of bounds: refused, drained, the connection stays.
    s.sendall(noting(remote, offset=(1 << 20) - 8, data=b"z" * 16, note=b"never", req_id=4))
    status, rid, _c, body = reply(s)
    assert (status, rid, error_code(body)) == (wire.ST_ERR, 4, "out_of_bounds")
    s.sendall(noting(remote, offset=8, data=b"ok", note=b"landed", req_id=5))
    assert reply(s)[:2] == (wire.ST_OK, 5)
    s.close()
    assert tgt.cmd("sha kv 0 16") == _sha(bytes(8) + b"ok" + bytes(6))
    assert [(n["peer"], n["data"]) for n in json.loads(tgt.cmd("notes"))] == [("raw-client", "landed")]


@pytest.mark.parametrize("native", SERVERS)
def test_hostile_noting_frames_close_the_connection_never_crash_the_target(spawn: Any, native: bool) -> None:
    tgt: Target = spawn(config=_config(native))
    with mpcomm.Engine(transports=["tcp"]) as e:
        remote = e.open(tgt.address, "kv", timeout=5)

    def cut(frame: bytes) -> None:
        s = tgt.raw()
        try:
            s.sendall(frame)
        except OSError:
            pass  # closed while we sent: what matters is that it closed
        assert closed(s, 5), frame[:80].hex()
        s.close()

    data = b"d" * 4096
    cut(noting(remote, data=data, note=b"n", count=U32))  # a region name of 2^32-1 bytes
    cut(noting(remote, data=data, note=b"n", count=wire.MAX_NOTE_REGION + 1))
    cut(noting(remote, data=data, note=b"n" * 4096, note_len=U32))  # a note of 2^32-1 bytes
    cut(noting(remote, data=data, note=b"n" * 4096, note_len=U64))  # 2^64-1: nothing allocated or drained
    cut(noting(remote, data=data, note=b"n" * 4096, note_len=MAX_NOTIFY + 1))
    cut(noting(remote, data=data, note=b"n", op=wire.OP_READ))  # the flag on another op
    cut(noting(remote, data=data, note=b"n", flags=0x02))  # an unknown flag
    cut(noting(remote, data=data, note=b"n", flags=wire.FLAG_NOTE | 0x80))
    s = tgt.raw()  # a frame cut short in its note: the deadline ends the connection
    s.sendall(noting(remote, data=data, note=b"short", note_len=100)[: wire.REQ.size + wire.NOTE_LEN.size + 2 + 5])
    s.shutdown(socket.SHUT_WR)
    assert closed(s, 15)
    s.close()
    assert tgt.alive
    assert tgt.cmd("sha kv 0 4096") == _sha(bytes(4096))  # none of them wrote a byte
    assert json.loads(tgt.cmd("notes")) == []
    with mpcomm.Engine(transports=["tcp"]) as e:  # still serving
        e.write(b"ok", e.open(tgt.address, "kv", timeout=5), notify=b"after").result(5)
    assert [n["data"] for n in json.loads(tgt.cmd("notes"))] == ["after"]


@pytest.mark.parametrize("native", SERVERS)
def test_a_noting_frame_byte_by_byte_and_an_empty_name_and_note(spawn: Any, native: bool) -> None:
    tgt: Target = spawn(config=_config(native))
    with mpcomm.Engine(transports=["tcp"]) as e:
        remote = e.open(tgt.address, "kv", timeout=5)
    s = tgt.raw()
    frame = noting(remote, offset=100, data=b"sliced", note=b"n1", req_id=21)
    for i in range(len(frame)):
        s.sendall(frame[i : i + 1])
    assert reply(s)[:2] == (wire.ST_OK, 21)
    s.sendall(noting(remote, offset=0, data=b"e", note=b"", name=b"", req_id=22))
    assert reply(s)[:2] == (wire.ST_OK, 22)
    s.close()
    assert tgt.cmd("sha kv 100 6") == _sha(b"sliced")
    assert [(n["region"], n["data"]) for n in json.loads(tgt.cmd("notes"))] == [("kv", "n1"), ("", "")]


def test_the_note_is_queued_after_its_data_in_this_process(make_engine: Any) -> None:
    """The target's consumer wakes on the note and finds the data in place at once."""
    tgt = make_engine(transports=["tcp"])
    buf = bytearray(1 << 16)
    tgt.register(buf, name="kv")
    ini = make_engine(transports=["tcp"])
    remote = ini.open(tgt.address, "kv", timeout=5)
    for i in range(20):
        data = bytes([i % 251 + 1]) * (1 << 16)
        seen: list[bool] = []
        waiter = threading.Thread(target=lambda d=data: (tgt.wait_notification(5), seen.append(bytes(buf) == d)))
        waiter.start()
        ini.write(data, remote, 0, notify=b"n").result(5)
        waiter.join(5)
        assert seen == [True], i


def test_the_python_queue_holds_room_for_a_note_whose_data_lands_first() -> None:
    q = NotificationQueue(max_count=2, max_bytes=10)
    q.reserve(6)
    q.put("a", 4)
    assert len(q) == 1  # held room is not a queued note
    with pytest.raises(BackPressureError, match="2 notifications, 10 bytes"):
        q.reserve(0)  # the count is full with the held room
    with pytest.raises(BackPressureError):
        q.put("b", 0)
    q.cancel(6)
    q.reserve(6)
    q.put_reserved("c", 6)
    assert [q.get(0), q.get(0)] == ["a", "c"] and q.nbytes == 0


@pytest.mark.skipif(dataport.load() is None, reason=f"native data port: {dataport.reason}")
def test_the_native_queue_holds_room_for_a_note_whose_data_lands_first() -> None:
    q = dataport.load().Notes(max_count=2, max_bytes=10)
    assert q.reserve(6) is None
    assert q.put("p", "r", b"xyzw", True) is None
    assert "max_queued_notifications=2" in q.reserve(0)
    assert q.put("p", "r", b"", True) is not None
    assert q.size() == (1, 4, 0)  # held room is not a queued note, as in the Python queue
    q.cancel(6)
    assert q.size() == (1, 4, 0)
    assert q.reserve(6) is None
    q.commit("p", "r", b"abcdef", True)
    assert [q.get(0), q.get(0)] == [("p", "r", b"xyzw"), ("p", "r", b"abcdef")]
    assert q.size() == (0, 0, 0)
    with pytest.raises(ValueError):
        q.reserve(MAX_NOTIFY + 1)
    with pytest.raises(ValueError):
        q.reserve(-1)


# -- generated frames against servers in this process (a crash would end the test run) -----------

@pytest.fixture(scope="module", params=SERVERS)
def small_targets(request: pytest.FixtureRequest) -> Any:
    cfg = _config(request.param, max_notify_bytes=1000, max_queued_notifications=4)
    e = mpcomm.Engine(cfg, transports=["tcp"])
    buf = bytearray(4096)
    region = e.register(buf, name="kv")
    yield e, buf, region
    e.close()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(count=st.sampled_from([0, 1, 2, 1023, 1024, 1025, 1 << 31, U32]) | st.integers(0, U32),
       note_len=st.sampled_from([0, 1, 999, 1000, 1001, MAX_NOTIFY, MAX_NOTIFY + 1, U32, 1 << 63, U64 - 1, U64])
       | st.integers(0, U64),
       body=st.integers(0, 2048), offset=st.sampled_from([0, 4000, 4096, U64]), n=st.sampled_from([0, 8, 96]))
def test_generated_noting_frames_get_an_answer_or_a_closed_connection(small_targets: Any, count: int, note_len: int,
                                                                      body: int, offset: int, n: int) -> None:
    engine, buf, region = small_targets
    buf[:] = bytes(len(buf))
    s = raw_to(engine, "gen-client")
    try:
        head = wire.REQ.pack(wire.REQ_MAGIC, wire.OP_WRITE, wire.FLAG_NOTE, count, 5, region.id, region.token,
                             int(engine.epoch, 16), offset, n, time.time() + 10)
        s.sendall(head + wire.NOTE_LEN.pack(note_len) + b"\x01" * body)
        if count > wire.MAX_NOTE_REGION or note_len > MAX_NOTIFY:
            assert closed(s, 5)
            assert bytes(buf) == bytes(len(buf))
        elif body >= count + note_len + n:  # the whole frame arrived: one answer
            status, rid, _c, payload = reply(s)
            assert rid == 5
            fits = n <= 4096 and offset <= 4096 - n
            if not fits:
                assert (status, error_code(payload)) == (wire.ST_ERR, "out_of_bounds")
            elif note_len > 1000:
                assert (status, error_code(payload)) == (wire.ST_ERR, "limit")
            else:
                assert status == wire.ST_OK or error_code(payload) == "back_pressure"
            if status != wire.ST_OK:
                assert bytes(buf) == bytes(len(buf))  # refused before a byte landed
        while True:  # keep the queue from filling for the next example
            try:
                engine.wait_notification(0)
            except TimeoutError:
                break
    finally:
        s.close()
    t = raw_to(engine, "gen-client")  # the port still serves
    t.sendall(wire.REQ.pack(wire.REQ_MAGIC, wire.OP_WRITE, wire.FLAG_NOTE, 2, 9, region.id, region.token,
                            int(engine.epoch, 16), 0, 2, time.time() + 10) + wire.NOTE_LEN.pack(2) + b"kvokok")
    assert reply(t)[:2] == (wire.ST_OK, 9)
    t.close()
    note = engine.wait_notification(1)
    assert (note.peer, note.region, note.data) == ("gen-client", "kv", b"ok")


def test_submitted_notifying_writes_carry_their_notes_too(spawn: Any) -> None:
    tgt: Target = spawn()
    with mpcomm.Engine({"plugins": {"tcp": {"connections": 1}}}, transports=["tcp"]) as e:
        remote = e.open(tgt.address, "kv", timeout=5)
        src = e.allocate(4096)
        src.view[:] = bytes(range(256)) * 16
        reqs = [mpcomm.Request("write", src, remote, 1024 * i, 1024, local_offset=1024 * i,
                               notify=json.dumps({"off": 1024 * i, "len": 1024,
                                                  "sha": _sha(bytes(src.view[1024 * i : 1024 * (i + 1)]))}).encode())
                for i in range(4)]
        e.submit(reqs).result(10)
        assert not [t.name for t in threading.enumerate() if t.name.startswith("mpcomm-notify_")]
    notes = json.loads(tgt.cmd("notes"))
    assert sorted(json.loads(n["data"])["off"] for n in notes) == [0, 1024, 2048, 3072]
    assert all(n["data_in_place"] for n in notes), notes


class _NoteThenDropServer(Server):
    """Queues a carried note and lands its data, then drops the connection instead of the first reply."""

    dropped = 0

    def _reply(self, sock: socket.socket, status: int, req_id: int, length: int, *body: Any, count: int = 0,
               end: float) -> None:
        if status == wire.ST_OK and not type(self).dropped:
            type(self).dropped += 1
            sock.shutdown(socket.SHUT_RDWR)
            raise ConnectionResetError("dropped before the reply")
        super()._reply(sock, status, req_id, length, *body, count=count, end=end)


def test_a_connection_lost_before_the_reply_fails_the_request_and_delivers_the_note_once(
        make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TcpTransport, "server_class", _NoteThenDropServer)
    tgt = make_engine(transports=["tcp", "shm"])
    monkeypatch.undo()
    buf = bytearray(4096)
    tgt.register(buf, name="kv")
    ini = make_engine({"plugins": {"tcp": {"connections": 1}}}, transports=["tcp", "shm"])
    remote = ini.open(tgt.address, "kv", timeout=5)
    with pytest.raises(mpcomm.MpcommError) as err:  # shm, next on the route, is not tried
        ini.write(b"w" * 64, remote, 0, notify=b"once", timeout=10, route=("tcp", "shm")).result(10)
    assert _NoteThenDropServer.dropped == 1
    assert not isinstance(err.value, BackPressureError)
    # Not posted again: a second attempt would have queued the note a second time.
    assert tgt.wait_notification(2).data == b"once"
    with pytest.raises(TimeoutError):
        tgt.wait_notification(0.5)
    ini.write(b"v" * 64, remote, 0, notify=b"next", timeout=10, route=("tcp", "shm")).result(10)  # it goes on
    assert tgt.wait_notification(2).data == b"next" and bytes(buf[:64]) == b"v" * 64
