"""tcp's initiator has one general path and one fast path (docs/tcp.md, "Paths"; issue 28 item 5).

Every request, whatever its shape (a small write or read, a striped one, a batch, a write
carrying its notification), is built by one header rule (``wire.request``), leaves through
one submit (``TcpTransport._send`` -> ``Conn.submit``) and its reply is ended by one
handler (``Conn._one_reply``). The only thing that differs between the fast and the general
path is which thread does the socket calls: the poster's thread sends (``send_nowait`` in
``Conn.submit``, the one place) and the ``result()`` caller reads (``Conn._drive``, called
from ``client.drive`` only), or the connection's writer and reader threads do. The first
tests check the call sites in the source; the last ones run each shape over real sockets and
count frames at the three choke points and which threads did the I/O.
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from typing import Any

import pytest

from mpcomm.plugins.tcp import client, transport, wire

TCP = Path(transport.__file__).parent
INITIATOR = ("transport.py", "client.py", "staging.py", "wire.py")


def _calls(name: str, files: tuple[str, ...] = INITIATOR) -> list[tuple[str, str]]:
    """(file, enclosing function) of every call of an attribute or function called ``name``."""
    found: list[tuple[str, str]] = []
    for f in files:
        tree = ast.parse((TCP / f).read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    callee = node.func
                    called = callee.attr if isinstance(callee, ast.Attribute) else getattr(callee, "id", None)
                    if called == name:
                        found.append((f, fn.name))
    # A call inside a nested function is found for both functions: keep the innermost only.
    return sorted(set(found))


def test_one_header_rule_one_way_out_one_way_in() -> None:
    # Request headers are packed by wire.request only (REQ.pack nowhere else in the plugin).
    for p in TCP.glob("*.py"):
        if p.name != "wire.py":
            assert "REQ.pack" not in p.read_text(), p.name
    assert set(_calls("submit")) == {("transport.py", "_send")}
    assert set(_calls("_send", ("transport.py",))) == {("transport.py", "post"), ("transport.py", "post_many"),
                                                       ("transport.py", "notify")}
    # One frame rule for single requests and stripes alike.
    assert set(_calls("_frame")) == {("transport.py", "post")}
    # Replies: one handler, reached by the reader thread or a driver.
    assert set(_calls("_one_reply")) == {("client.py", "_reader"), ("client.py", "_drive"),
                                         ("client.py", "_take_arriving")}


def test_the_one_fast_path_is_the_callers_own_thread() -> None:
    # Sent on the poster's thread: one place. Read on the result() caller's: one entry.
    assert set(_calls("send_nowait")) == {("client.py", "submit")}
    assert set(_calls("_drive")) == {("client.py", "drive")}
    assert set(_calls("drive")) == {("transport.py", "drive"), ("transport.py", "notify")}


class _Trace:
    """Counts frames at the three choke points and records which thread sent and read each."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.heads = 0
        self.submits = 0
        self.replies = 0
        self.inline_senders: list[int] = []
        self.writer_sends = 0
        self.readers: list[int] = []
        request, submit, one_reply = wire.request, client.Conn.submit, client.Conn._one_reply
        send_nowait, send = client.send_nowait, client.Conn._send

        def counted_request(*a: Any) -> Any:
            self.heads += 1
            return request(*a)

        def counted_submit(conn: Any, piece: Any, inline: bool) -> bool:
            self.submits += 1
            return submit(conn, piece, inline)

        def counted_reply(conn: Any, sock: Any, head: Any) -> None:
            self.replies += 1
            self.readers.append(threading.get_ident())
            one_reply(conn, sock, head)

        def counted_nowait(sock: Any, views: Any) -> Any:
            self.inline_senders.append(threading.get_ident())
            return send_nowait(sock, views)

        def counted_send(conn: Any, sock: Any, views: Any) -> None:
            self.writer_sends += 1
            send(conn, sock, views)

        monkeypatch.setattr(wire, "request", counted_request)
        monkeypatch.setattr(client.Conn, "submit", counted_submit)
        monkeypatch.setattr(client.Conn, "_one_reply", counted_reply)
        monkeypatch.setattr(client, "send_nowait", counted_nowait)
        monkeypatch.setattr(client.Conn, "_send", counted_send)

    def reset(self) -> None:
        self.heads = self.submits = self.replies = self.writer_sends = 0
        self.inline_senders.clear()
        self.readers.clear()


def test_every_request_shape_takes_the_same_three_steps(spawn: Any, make_engine: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    target = spawn()
    ini = make_engine({"plugins": {"tcp": {"connections": 4, "stripe_threshold": 64 << 10}}})
    remote = ini.open(target.address, "kv")
    buf = ini.allocate(1 << 20)
    ini.write(buf, remote, 0, 4096).result(10)  # dialled, outside the count
    trace = _Trace(monkeypatch)
    offs = [4096 * i for i in range(8)]
    shapes = {
        "write": (lambda: ini.write(buf, remote, 0, 4096), 1),
        "read": (lambda: ini.read(buf, remote, 0, 4096), 1),
        "noted write": (lambda: ini.write(buf, remote, 0, 4096, notify=b"n"), 1),
        "striped write": (lambda: ini.write(buf, remote, 0, 512 << 10), 4),
        "striped read": (lambda: ini.read(buf, remote, 0, 512 << 10), 4),
        "batch write": (lambda: ini.write_many(buf, remote, offs, offs, [4096] * 8), 1),
        "batch read": (lambda: ini.read_many(buf, remote, offs, offs, [4096] * 8), 1),
    }
    for what, (start, frames) in shapes.items():
        trace.reset()
        start().result(10)
        assert (trace.heads, trace.submits, trace.replies) == (frames, frames, frames), what
    ini.close()


def test_a_waited_request_takes_the_fast_path_and_a_large_callback_one_the_general(
        spawn: Any, make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    target = spawn()
    ini = make_engine({"plugins": {"tcp": {"connections": 1}}})
    remote = ini.open(target.address, "kv")
    buf = ini.allocate(1 << 20)
    ini.write(buf, remote, 0, 4096).result(10)
    me = threading.get_ident()
    trace = _Trace(monkeypatch)
    fast = 0
    for _ in range(20):  # a loaded machine may preempt this thread past the reader's hand-over
        trace.reset()
        ini.write(buf, remote, 0, 4096).result(10)
        if trace.inline_senders == [me] and trace.readers == [me] and not trace.writer_sends:
            fast += 1
    assert fast >= 10, "a small request waited on was not sent and read on the caller's thread"
    # Over inline_threshold (256 KiB) and nobody drives it: the connection's threads do the I/O.
    trace.reset()
    done = threading.Event()
    ini.write(buf, remote, 0, 512 << 10).add_done_callback(lambda _t: done.set())
    assert done.wait(10)
    assert trace.inline_senders == [] and trace.writer_sends == 1
    assert len(trace.readers) == 1 and trace.readers[0] != me
    ini.close()


def test_undriven_is_declared_in_the_transport_contract() -> None:
    """Transport.undriven (what a callback added to a posted request calls) is in the contract the
    registry checks each plugin against, and tcp's implementation passes it."""
    from mpcomm.transport import TRANSPORT_CONTRACT, contract_problems

    assert TRANSPORT_CONTRACT["undriven"].kind == "method"
    assert contract_problems(transport.TcpTransport) == []
