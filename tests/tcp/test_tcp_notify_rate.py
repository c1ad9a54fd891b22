"""limits.notify_rate is one token bucket per sender node id, shared by all its connections and
paths into the target's notification queue: tcp's native NOTIFY frames, notes carried on WRITE
frames (native and Python servers), the control channel. At most limits.max_notify_senders
buckets are held. The bucket rule exists twice, in C (_dataport.c, the native queue) and in
Python (core/engine/senders.py); the two are compared here on generated inputs."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tcp_support import Target, error_code, reply, req

import mpcomm
from mpcomm.control import PeerLink
from mpcomm.engine.notify import Notification, Notifications
from mpcomm.engine.senders import NS, SenderRates, admit, idle
from mpcomm.errors import BackPressureError
from mpcomm.peer import PeerInfo
from mpcomm.plugins.tcp import dataport, wire

NATIVE = dataport.load()
needs_native = pytest.mark.skipif(NATIVE is None, reason=f"native data port: {dataport.reason}")
SERVERS = [pytest.param(True, id="native", marks=needs_native), pytest.param(False, id="python")]
U64 = (1 << 64) - 1


# -- the rule: C against Python -----------------------------------------------------------------

def _py_trace(rate: int, times: list[int]) -> list[tuple[bool, bool]]:
    tat, out = 0, []
    for now in times:
        after = admit(tat, now, rate)
        if after is not None:
            tat = after
        out.append((after is not None, idle(tat, now, rate)))
    return out


EDGES = [0, 1, 2, NS - 1, NS, NS + 1, 1 << 31, 1 << 32, (1 << 63) - 1, 1 << 63, U64 - 1, U64]
RATES = st.one_of(st.sampled_from([1, 2, 3, 7, 1000, 10_000, 1 << 24, (1 << 31) - 1, (1 << 32) - 1]),
                  st.integers(1, (1 << 32) - 1))


@st.composite
def times(draw: Any) -> list[int]:
    """Instants in ns, near the edges or near each other, in any order (a thread that read the
    clock before another may take the lock after it)."""
    base = draw(st.sampled_from(EDGES) | st.integers(0, U64))
    steps = draw(st.lists(st.sampled_from([0, 1, NS // 7, NS // 2, NS, 3 * NS]) | st.integers(-NS, 10 * NS),
                          max_size=60))
    out, t = [], base
    for d in steps:
        t = min(max(t + d, 0), U64)
        out.append(draw(st.sampled_from(EDGES)) if draw(st.integers(0, 9)) == 0 else t)
    return out


@needs_native
@settings(max_examples=400, deadline=None)
@given(rate=RATES, ts=times())
def test_the_native_and_the_python_bucket_rule_agree(rate: int, ts: list[int]) -> None:
    assert NATIVE.rate_trace(rate, ts) == _py_trace(rate, ts)


@settings(max_examples=300, deadline=None)
@given(rate=st.integers(1, 50), gaps=st.lists(st.integers(0, NS // 3), min_size=1, max_size=80),
       start=st.sampled_from([0, 1 << 40, (1 << 63) - 1]))
def test_a_sender_gets_the_burst_and_then_the_rate_never_more(rate: int, gaps: list[int], start: int) -> None:
    ts, t = [], start
    for g in gaps:
        t += g
        ts.append(t)
    got = _py_trace(rate, ts)
    if NATIVE is not None and ts[-1] <= U64:
        assert NATIVE.rate_trace(rate, ts) == got
    ok = [t for t, (admitted, _idle) in zip(ts, got) if admitted]
    # In any window [a, b]: at most the burst plus what refilled in b - a.
    for i in range(len(ok)):
        for j in range(i, len(ok)):
            assert j - i + 1 <= rate + (ok[j] - ok[i]) * rate // NS
    # A fresh sender gets its whole burst at once.
    burst = _py_trace(rate, [start] * (rate + 1))
    assert [a for a, _ in burst] == [True] * rate + [False]


def test_the_table_forgets_idle_senders_and_refuses_new_ones_while_all_are_busy() -> None:
    now = [10 * NS]
    rates = SenderRates(rate=2, max_senders=2, clock=lambda: now[0])
    rates.take("a")
    rates.take("b")
    with pytest.raises(BackPressureError, match="max_notify_senders=2"):
        rates.take("c")
    assert len(rates) == 2
    now[0] += NS // 2  # each bucket refilled: both idle, both forgotten
    rates.take("c")
    assert len(rates) == 1
    rates.take("c")
    with pytest.raises(BackPressureError, match="notify_rate"):
        rates.take("c")

    def full() -> None:
        raise BackPressureError("queue full")

    now[0] += NS  # refused by the queue after the rate admitted it: no token spent
    for _ in range(5):
        with pytest.raises(BackPressureError, match="queue full"):
            rates.take("c", full)
    rates.take("c")
    rates.take("c")


# -- the queue (native and Python), in this process ---------------------------------------------

def _queue(native: bool, rate: int, max_senders: int, max_count: int = 1000) -> Notifications:
    n = Notifications(max_count, 1 << 20, rate, max_senders)
    if native:
        assert n.adopt(NATIVE.Notes(max_count=max_count, max_bytes=1 << 20, rate=rate, max_senders=max_senders))
    return n


@pytest.mark.parametrize("native", SERVERS)
def test_each_sender_has_its_own_bucket_in_the_queue_and_the_table_is_bounded(native: bool) -> None:
    q = _queue(native, rate=2, max_senders=2)
    for _ in range(2):  # each sender spends its whole burst: its bucket is busy for a second
        q.deliver(Notification("a", "kv", b"x"))
    with pytest.raises(BackPressureError, match="notify_rate"):
        q.deliver(Notification("a", "kv", b"x"))
    for _ in range(2):
        q.cancel(q.reserve(1, "b"))  # another sender: its own bucket (the carried-note path)
    with pytest.raises(BackPressureError, match="notify_rate"):
        q.reserve(1, "b")
    with pytest.raises(BackPressureError, match="max_notify_senders=2"):
        q.deliver(Notification("c", "kv", b"x"))  # both held buckets are busy: a third waits
    assert q.senders() == 2
    time.sleep(1.1)  # every bucket refilled: idle, forgotten when a new sender needs room
    q.deliver(Notification("c", "kv", b"x"))
    assert q.senders() <= 2
    assert [q.wait(0).peer for _ in range(3)] == ["a", "a", "c"]


@pytest.mark.parametrize("native", SERVERS)
def test_a_refusal_for_room_spends_no_token(native: bool) -> None:
    q = _queue(native, rate=2, max_senders=8, max_count=1)
    q.deliver(Notification("a", "kv", b"1"))
    for _ in range(10):
        with pytest.raises(BackPressureError, match="max_queued_notifications"):
            q.deliver(Notification("a", "kv", b"2"))
    assert q.wait(0).data == b"1"
    q.deliver(Notification("a", "kv", b"3"))  # the second token was never spent on the refusals
    assert q.wait(0).data == b"3"


@needs_native
def test_notes_moved_into_the_native_queue_spend_no_token() -> None:
    q = Notifications(10, 1 << 20, 1, 8)
    q.deliver(Notification("a", "kv", b"1"))
    assert q.adopt(NATIVE.Notes(max_count=10, max_bytes=1 << 20, rate=1, max_senders=8))
    assert len(q) == 1 and q.senders() == 0
    q.deliver(Notification("a", "kv", b"2"))  # the native bucket starts full
    with pytest.raises(BackPressureError, match="notify_rate"):
        q.deliver(Notification("a", "kv", b"3"))


# -- real target processes ---------------------------------------------------------------------

def _notify_frame(rid: int, payload: bytes = b"n") -> bytes:
    return req(wire.OP_NOTIFY, length=len(payload), count=2, req_id=rid) + b"kv" + payload


def _noting(remote: mpcomm.RemoteRegion, rid: int, note: bytes = b"n") -> bytes:
    head = wire.REQ.pack(wire.REQ_MAGIC, wire.OP_WRITE, wire.FLAG_NOTE, 2, rid, remote.region_id, remote.token,
                         int(remote.epoch, 16), 0, 8, time.time() + 10)
    return head + wire.NOTE_LEN.pack(len(note)) + b"kv" + note + b"d" * 8


def _fire(socks: list[socket.socket], frames: Any, per_sock: int) -> tuple[list[str], float]:
    """Send ``per_sock`` frames on each socket, round robin, then read every reply: the outcomes
    ("ok" or the error code) and the seconds from the first send to the last reply."""
    start = time.monotonic()
    for i in range(per_sock):
        for k, s in enumerate(socks):
            s.sendall(frames(1000 * k + i + 1))
    out = []
    for s in socks:
        for _ in range(per_sock):
            status, _rid, _count, body = reply(s)
            out.append("ok" if status == wire.ST_OK else error_code(body))
    return out, time.monotonic() - start


@pytest.mark.parametrize("native", SERVERS)
def test_one_sender_over_several_data_connections_gets_the_rate_in_total(spawn: Any, native: bool) -> None:
    """Carried notes (WRITE frames with FLAG_NOTE, both servers) on four connections of one node id:
    with a bucket per connection it got four times the rate."""
    rate = 5
    tgt: Target = spawn(config={"plugins": {"tcp": {"native_server": native}}, "limits": {"notify_rate": rate}})
    with mpcomm.Engine(transports=["tcp"]) as e:
        remote = e.open(tgt.address, "kv", timeout=5)
    socks = [tgt.raw(node="striped-sender") for _ in range(4)]
    try:
        outcomes, took = _fire(socks, lambda rid: _noting(remote, rid), per_sock=8)
    finally:
        for s in socks:
            s.close()
    ok = outcomes.count("ok")
    assert rate <= ok <= rate + int(took * rate) + 1, (ok, took)
    assert set(outcomes) == {"ok", "back_pressure"}
    peers = {n["peer"] for n in json.loads(tgt.cmd("notes"))}
    assert peers == {"striped-sender"}


@needs_native
def test_notify_frames_the_control_channel_and_carried_notes_draw_on_one_bucket(spawn: Any) -> None:
    rate = 6
    tgt: Target = spawn(config={"limits": {"notify_rate": rate}})
    assert tgt.tcp.get("notify") is True
    with mpcomm.Engine(transports=["tcp"]) as e:
        remote = e.open(tgt.address, "kv", timeout=5)
    me = "one-sender"
    a, b = tgt.raw(node=me), tgt.raw(node=me)
    link = PeerLink(tgt.address, local_info=PeerInfo(node_id=me, epoch="0a", address="127.0.0.1:1"), secret="",
                    timeout=5, on_lost=lambda _l: None)
    start = time.monotonic()
    outcomes = []
    try:
        for i in range(4):  # two paths, two connections: 8 attempts, the budget is 6
            a.sendall(_notify_frame(10 + i))
            b.sendall(_noting(remote, 20 + i))
        for s in (a, b):
            for _ in range(4):
                status, _rid, _count, body = reply(s)
                outcomes.append("ok" if status == wire.ST_OK else error_code(body))
        for _ in range(3):  # the control channel: same node id, same bucket
            try:
                link.request({"t": "notify", "region": "kv", "data": b"c".hex()}, 5)
                outcomes.append("ok")
            except BackPressureError:
                outcomes.append("back_pressure")
        took = time.monotonic() - start
        # Another sender is not held back by this one's flood.
        c = tgt.raw(node="other-sender")
        c.sendall(_notify_frame(30))
        assert reply(c)[0] == wire.ST_OK
        c.close()
    finally:
        link.close()
        a.close()
        b.close()
    ok = outcomes.count("ok")
    assert rate <= ok <= rate + int(took * rate) + 1, (outcomes, took)
    assert outcomes.count("back_pressure") == len(outcomes) - ok


@pytest.mark.parametrize("native", SERVERS)
def test_two_senders_each_get_their_own_rate(spawn: Any, native: bool) -> None:
    rate = 4
    tgt: Target = spawn(config={"plugins": {"tcp": {"native_server": native}}, "limits": {"notify_rate": rate}})
    with mpcomm.Engine(transports=["tcp"]) as e:
        remote = e.open(tgt.address, "kv", timeout=5)
    result = {}
    for node in ("sender-one", "sender-two"):
        s = tgt.raw(node=node)
        try:
            result[node], took = _fire([s], lambda rid: _noting(remote, rid), per_sock=rate + 3)
        finally:
            s.close()
        assert rate <= result[node].count("ok") <= rate + int(took * rate) + 1, (result, took)
        assert result[node][:rate] == ["ok"] * rate


@needs_native
def test_a_flood_of_distinct_senders_holds_a_bounded_table(spawn: Any) -> None:
    """Forty node ids, one notification each, against max_notify_senders = 8 at a rate of 1 a
    second (a bucket stays busy for a second after its note): the table never holds more than 8."""
    tgt: Target = spawn(config={"limits": {"notify_rate": 1, "max_notify_senders": 8}})
    socks = [tgt.raw(node=f"flood-{i:02d}") for i in range(40)]
    try:
        outcomes, took = _fire(socks, _notify_frame, per_sock=1)
    finally:
        for s in socks:
            s.close()
    held = json.loads(tgt.cmd("stats"))["notification_senders"]
    assert held <= 8
    ok = outcomes.count("ok")
    assert ok >= 8
    if took < 0.9:  # no bucket went idle meanwhile: exactly the table's worth got through
        assert ok == 8, (outcomes, took)
    assert set(outcomes) <= {"ok", "back_pressure"}
    time.sleep(1.1)  # every bucket idle: a new sender finds room
    s = tgt.raw(node="late-sender")
    s.sendall(_notify_frame(99))
    assert reply(s)[0] == wire.ST_OK
    s.close()
    assert json.loads(tgt.cmd("stats"))["notification_senders"] <= 8
