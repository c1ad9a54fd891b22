"""The native data port (plugins/tcp/_dataport.c): served without the GIL, the same answers as the
Python server, revocation that holds, and hostile frames that never crash the target."""

from __future__ import annotations

import hashlib
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tcp_support import closed, error_code, reply, req, wait_for

import mpcomm
from mpcomm.errors import MpcommError
from mpcomm.plugins.tcp import dataport, wire
from mpcomm.testing.spinning import SpinningTarget

pytestmark = pytest.mark.skipif(dataport.load() is None, reason=f"native data port: {dataport.reason}")

U64 = (1 << 64) - 1


def _port(engine: mpcomm.Engine) -> Any:
    port = engine.transports["tcp"].dataport
    assert port is not None, "the tcp transport serves plain connections natively by default"
    return port


# -- a target whose interpreter is busy --------------------------------------------------------

def _p50(ini: mpcomm.Engine, src: Any, remote: Any, n: int) -> float:
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        ini.write(src, remote, 0, 4096).result(5)
        lat.append(time.perf_counter() - t)
    return sorted(lat)[len(lat) // 2]


def test_a_target_spinning_in_python_still_serves_a_write(make_engine: Any) -> None:
    with SpinningTarget(None, ["tcp"]) as target:
        ini = make_engine({"plugins": {"tcp": {"connections": 1}}})
        remote = ini.open(target.address, "kv", timeout=10)
        src = ini.allocate(4096)
        src.view[:] = b"s" * 4096
        idle = _p50(ini, src, remote, 50)  # also: the one connection is dialled and authenticated
        target.spin()  # the spinner has the GIL; with a 10 s switch interval it keeps it
        t0 = time.monotonic()
        busy = _p50(ini, src, remote, 50)  # each within its 5 s timeout (the Python server: ~10 s each)
        back = bytearray(4096)
        ini.read(back, remote, 0).result(5)
        took = time.monotonic() - t0
        assert bytes(back) == b"s" * 4096
        assert took < 9, f"50 writes and a read took {took:.1f} s against a target holding its GIL"
        print(f"\nspinning target: 4 KiB write p50 {busy * 1e6:.0f} us vs idle {idle * 1e6:.0f} us "
              f"(ratio {busy / idle:.2f})")


# -- revocation ------------------------------------------------------------------------------

def test_unregister_during_an_inflight_write_stops_every_later_byte(spawn: Any, make_engine: Any) -> None:
    size = 32 << 20  # at 64 KiB per 5 ms the write needs 2.5 s or more: it is in flight at unregister
    tgt = spawn({"kv": [size, "buffer"]}, config={"runtime": {"abort_grace_ms": 300}})
    remote = make_engine().open(tgt.address, "kv", timeout=5)
    s = tgt.raw()
    s.sendall(req(wire.OP_WRITE, remote=remote, offset=0, length=size, deadline=time.time() + 60))
    sent = [0]
    stop = threading.Event()

    def pump() -> None:  # 64 KiB every 5 ms: the write is still in flight when unregister comes
        piece = b"\xab" * (64 << 10)
        try:
            while sent[0] < size and not stop.is_set():
                s.sendall(piece)
                sent[0] += len(piece)
                time.sleep(0.005)
        except OSError:
            pass

    th = threading.Thread(target=pump)
    th.start()
    assert wait_for(lambda: sent[0] >= 1 << 20, 10)
    zero = hashlib.sha256(bytes(size)).hexdigest()
    t0 = time.monotonic()
    tgt.cmd("unregister kv")  # returns: no byte lands from here on
    took = time.monotonic() - t0
    after = tgt.sha("kv", 0, size)
    assert after != zero  # bytes were landing before
    th.join(10)  # the pump ends: its connection was cut (or it sent everything into the void)
    stop.set()
    time.sleep(0.3)
    assert tgt.sha("kv", 0, size) == after, "a byte landed after unregister returned"
    assert sent[0] < size, "the write finished: nothing was in flight at unregister"
    assert took < 5, f"unregister took {took:.1f} s (grace 0.3 s)"
    assert closed(s, 5)
    s.close()


def test_unregister_waits_for_a_write_that_finishes_within_the_grace(spawn: Any, make_engine: Any) -> None:
    size = 4 << 20
    tgt = spawn({"kv": [size, "buffer"]}, config={"runtime": {"abort_grace_ms": 5000}})
    remote = make_engine().open(tgt.address, "kv", timeout=5)
    s = tgt.raw()
    s.sendall(req(wire.OP_WRITE, remote=remote, offset=0, length=size, deadline=time.time() + 60))
    s.sendall(b"\x01" * (size // 2))
    time.sleep(0.2)

    def finish() -> None:
        time.sleep(0.5)
        s.sendall(b"\x01" * (size - size // 2))

    th = threading.Thread(target=finish)
    th.start()
    tgt.cmd("unregister kv")  # waits for the write in flight, which completes
    th.join(5)
    assert tgt.sha("kv", 0, size) == hashlib.sha256(b"\x01" * size).hexdigest()
    status, _rid, _count, _body = reply(s)
    assert status == wire.ST_OK
    s.sendall(req(wire.OP_READ, remote=remote, offset=0, length=8))
    status, _rid, _count, body = reply(s)
    assert status == wire.ST_ERR and error_code(body) == "unknown_region"
    s.close()


# -- hostile frames ----------------------------------------------------------------------------

def _batch(op: int, remote: Any, offs: list[int], lens: list[int], total: int | None = None) -> bytes:
    head = req(op, remote=remote, count=len(offs), length=sum(lens) & U64 if total is None else total)
    return head + struct.pack(f"<{len(offs)}Q", *offs) + struct.pack(f"<{len(lens)}Q", *lens)


@pytest.mark.parametrize("server", ["native", "python"])
def test_hostile_frames_get_refusals_or_a_closed_connection_never_a_crash(
        spawn: Any, make_engine: Any, monkeypatch: pytest.MonkeyPatch, server: str) -> None:
    if server == "python":
        monkeypatch.setenv(dataport.ENV, "0")
    tgt = spawn(config={"runtime": {"abort_grace_ms": 200}})
    ini = make_engine()
    remote = ini.open(tgt.address, "kv", timeout=5)
    size = 1 << 20

    def refused(frame: bytes, code: str) -> None:
        s = tgt.raw()
        s.sendall(frame)
        status, _rid, _count, body = reply(s)
        assert status == wire.ST_ERR and error_code(body) == code, body
        s.close()

    def cut(frame: bytes, within: float = 5) -> None:
        s = tgt.raw()
        try:
            s.sendall(frame)
        except OSError:
            pass
        assert closed(s, within)
        s.close()

    for off, n in [((1 << 63) - 1, 8), (U64, 1), (U64, 0), (0, U64), (1, U64), (size, 1), (size + 1, 0),
                   (1 << 32, 1 << 32), ((1 << 63) - 1, 1 << 63)]:
        refused(req(wire.OP_READ, remote=remote, offset=off, length=n), "out_of_bounds")
    for off in [(1 << 63) - 1, U64, size]:  # a refused write's payload (8 bytes) is drained
        refused(req(wire.OP_WRITE, remote=remote, offset=off, length=8) + b"x" * 8, "out_of_bounds")
    refused(req(wire.OP_READ, region_id=U64, token=remote.token, epoch=int(remote.epoch, 16)), "unknown_region")
    refused(req(wire.OP_READ, remote=remote, offset=0, length=8, deadline=1.0), "timeout")
    cut(req(magic=b"XX"))  # bad magic
    cut(req(wire.OP_READV, remote=remote, count=0xFFFFFFFF))  # huge count
    cut(req(op=99, remote=remote))  # unknown op
    cut(req(wire.OP_READ, remote=remote, deadline=float("nan")))
    cut(_batch(wire.OP_READV, remote, [U64], [8]))  # a negative offset (int64)
    cut(_batch(wire.OP_READV, remote, [0] * 4, [1 << 62] * 4))  # lengths whose sum wraps to the header's 0
    cut(_batch(wire.OP_READV, remote, [0], [8], total=16))  # lengths that do not add up
    # A write announcing 2^64-1 bytes: drained until its deadline and the grace, then closed.
    cut(req(wire.OP_WRITE, remote=remote, offset=0, length=U64, deadline=time.time() + 0.3) + b"y" * 4096, 10)
    # A batch whose hull overflows the region: per index, the in-range one is served.
    s = tgt.raw()
    s.sendall(_batch(wire.OP_READV, remote, [(1 << 63) - 1, 64], [8, 8]))
    status, _rid, count, body = reply(s)
    assert status == wire.ST_PARTIAL and count == 2 and body[:2] == b"\x01\x00"
    s.close()
    assert tgt.alive
    data = b"z" * 4096
    ini.write(data, remote, 128).result(5)
    assert tgt.sha("kv", 128, 4096) == hashlib.sha256(data).hexdigest()


# -- the table agrees with RegionTable.serve ---------------------------------------------------

_EDGES = [0, 1, 2, (1 << 31) - 1, 1 << 31, (1 << 31) + 1, (1 << 32) - 1, 1 << 32, (1 << 32) + 1, (1 << 63) - 2,
          (1 << 63) - 1, 1 << 63, U64 - 1, U64]
_SIZE = 4096
_num = st.one_of(st.sampled_from(_EDGES + [_SIZE - 1, _SIZE, _SIZE + 1]), st.integers(0, U64))


@pytest.fixture(scope="module")
def table_engine() -> Any:
    e = mpcomm.Engine(transports=["tcp"])
    rw = e.register(bytearray(_SIZE), name="rw")
    ro = e.register(bytes(_SIZE), name="ro")
    yield e, rw, ro
    e.close()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(off=_num, n=_num, which=st.sampled_from(["rw", "ro", "unknown"]), token_ok=st.booleans(),
       epoch_ok=st.booleans(), access=st.sampled_from(["r", "w"]))
def test_native_table_gives_the_outcome_of_regions_serve(table_engine: Any, off: int, n: int, which: str,
                                                          token_ok: bool, epoch_ok: bool, access: str) -> None:
    engine, rw, ro = table_engine
    t = engine.transports["tcp"]
    region = rw if which == "rw" else ro
    rid = region.id if which != "unknown" else U64 - region.id
    token = region.token if token_ok else region.token ^ 1
    epoch = int(engine.info().epoch, 16) ^ (0 if epoch_ok else 1)
    native = _port(engine).check(rid, token, epoch, off, n, access)
    try:
        t.ctx.regions.serve(rid, token, f"{epoch:016x}", off, n, access).release()
        python = None
    except MpcommError as exc:
        python = (exc.code, str(exc))
    assert native == python


# -- the native server answers frames as the Python server does ---------------------------------

_SMALL = st.sampled_from([0, 1, 7, 8, 4095, 4096, 4097])
_OFF = st.sampled_from(_EDGES + [(1 << 20) - 8, 1 << 20, (1 << 20) + 1])


@pytest.fixture(scope="module")
def twin_targets() -> Any:
    """The same target twice: one served by the native loop, one by server.py."""
    from tcp_support import Target

    native = Target()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(dataport.ENV, "0")
        python = Target()
    try:
        yield native, python
    finally:
        native.close()
        python.close()


def _exchange(tgt: Any, frame: bytes) -> tuple[Any, ...]:
    """What the target answers ``frame``: ("reply", status, count, body) or ("closed",)."""
    s = tgt.raw()
    try:
        s.sendall(frame)
        status, _rid, count, body = reply(s)
        return ("reply", status, count, body)
    except (ConnectionError, OSError, AssertionError):
        return ("closed",)
    finally:
        s.close()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# One input of each kind of answer, so test_the_twin_comparison_saw_every_kind_of_answer does not
# depend on what the random draw found (it missed "closed" once in CI): OK, refused, partial, and a
# batch whose descriptor is past 2^63 (no payload follows it: drained to its deadline, then closed).
@example(op=wire.OP_WRITE, offs=[0], lens=[8], big=None, fill=7)
@example(op=wire.OP_READ, offs=[0], lens=[8], big=U64, fill=1)
@example(op=wire.OP_READV, offs=[0, 1 << 20], lens=[8, 8], big=None, fill=1)
@example(op=wire.OP_WRITEV, offs=[1 << 63], lens=[4096], big=None, fill=1)
@given(op=st.sampled_from([wire.OP_READ, wire.OP_WRITE, wire.OP_READV, wire.OP_WRITEV]),
       offs=st.lists(_OFF, min_size=1, max_size=4), lens=st.lists(_SMALL, min_size=1, max_size=4),
       big=st.sampled_from([None, (1 << 63) - 1, 1 << 63, U64]), fill=st.integers(1, 255))
def test_native_and_python_servers_answer_the_same(twin_targets: Any, op: int, offs: list[int], lens: list[int],
                                                    big: int | None, fill: int) -> None:
    n = min(len(offs), len(lens))
    offs, lens = offs[:n], lens[:n]
    answers = []
    for tgt in twin_targets:
        remote = mpcomm.RemoteRegion.from_dict(_remote_of(tgt))
        if op in (wire.OP_READ, wire.OP_WRITE):
            length = lens[0] if big is None or op == wire.OP_WRITE else big  # writes carry their payload
            frame = req(op, remote=remote, offset=offs[0], length=length, count=0)
            if op == wire.OP_WRITE:
                frame += bytes([fill]) * length
        else:
            frame = _batch(op, remote, offs, lens)
            if op == wire.OP_WRITEV and all(o < 1 << 63 for o in offs):
                frame += bytes([fill]) * sum(lens)
        answers.append(_exchange(tgt, frame))
    _SEEN.append(answers[0][:2])
    assert answers[0] == answers[1]
    native, python = twin_targets
    assert native.sha("kv", 0, 1 << 20) == python.sha("kv", 0, 1 << 20)


_REMOTES: dict[int, dict[str, Any]] = {}
_SEEN: list[tuple[Any, ...]] = []


def _remote_of(tgt: Any) -> dict[str, Any]:
    d = _REMOTES.get(id(tgt))
    if d is None:
        e = mpcomm.Engine(transports=["tcp"])
        try:
            d = _REMOTES[id(tgt)] = e.open(tgt.address, "kv", timeout=10).to_dict()
        finally:
            e.close()
    return d


def test_the_twin_comparison_saw_every_kind_of_answer() -> None:
    """The comparison above is not vacuous: it saw OK, refused, partial and closed answers."""
    kinds = {k if k[0] == "closed" else k[1] for k in _SEEN}
    if not _SEEN:
        pytest.skip("run with test_native_and_python_servers_answer_the_same")
    assert {wire.ST_OK, wire.ST_ERR, wire.ST_PARTIAL, ("closed",)} <= kinds, kinds


# -- when it is not used ------------------------------------------------------------------------

def test_native_server_false_keeps_the_python_server(make_engine: Any) -> None:
    tgt = make_engine({"plugins": {"tcp": {"native_server": False}}})
    assert tgt.transports["tcp"].dataport is None
    region = tgt.register(bytearray(4096), name="kv")
    ini = make_engine()
    ini.write(b"p" * 4096, ini.open(tgt.address, "kv"), 0).result(5)
    assert bytes(region.view) == b"p" * 4096


_NO_COMPILER = textwrap.dedent("""
    import sys
    sys.modules["mpcomm.plugins.tcp._mpcomm_dataport"] = None  # as if the install's build had failed
    import mpcomm
    from mpcomm.plugins.tcp import dataport
    t = mpcomm.Engine(transports=["tcp"])
    r = t.register(bytearray(4096), name="kv")
    i = mpcomm.Engine(transports=["tcp"])
    i.write(b"q" * 4096, i.open(t.address, "kv"), 0).result(5)
    assert bytes(r.view) == b"q" * 4096
    assert t.transports["tcp"].dataport is None
    print("served by", "python" if t.transports["tcp"].dataport is None else "native", "|", dataport.reason)
    i.close(); t.close()
""")


def test_without_the_built_module_the_python_server_serves() -> None:
    out = subprocess.run([sys.executable, "-c", _NO_COMPILER], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "served by python | not installed" in out.stdout, out.stdout
