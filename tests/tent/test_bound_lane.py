"""The provider's bound lane (``Provider.issue_bound``): a request between the two ranges a host's last
request went through goes straight to the engine. It must accept exactly what the look-ups of
``Provider.issue`` accept, and no change that could make a look-up answer differently may leave it
in use. Real engines over tcp on loopback."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tent_support import SIZE, Mem

from mpcomm.tent.codes import ProviderError
from mpcomm.tent.provider import Provider


def _bind(b: Provider, ma: Mem, mb: Mem) -> None:
    """One request through the general path: it leaves the pair bound."""
    b.issue("write", mb.addr, "A", ma.addr, 8, 10.0, watch=False).result()


def _looked_up(b: Provider, local: object, remote: object, length: object) -> bool:
    """Whether Provider.issue's own look-ups accept the request (the rule the bound lane must follow)."""
    try:
        if not isinstance(length, int) or length <= 0:
            return False
        b.local_region(local, length)  # type: ignore[arg-type]
    except (ProviderError, TypeError):
        return False
    return type(remote) is int and any(x.addr <= remote and remote + length <= x.addr + x.length
                                       for x in b.host_buffers("A"))


def _edges(size: int) -> st.SearchStrategy[int]:
    return st.sampled_from([0, 1, -1, size - 1, size, size + 1, 2**31, 2**32, 2**63 - 1, 2**64 - 1, -(2**63)])


@settings(max_examples=120, deadline=None, derandomize=True, database=None)
@given(lo=_edges(SIZE), ro=_edges(SIZE), length=_edges(SIZE) | st.sampled_from([8, 4096, SIZE]),
       odd=st.sampled_from([None, "bool", "float", "str"]))
def test_the_bound_lane_accepts_exactly_what_the_look_ups_accept(nodes, lo, ro, length, odd) -> None:  # type: ignore[no-untyped-def]
    a, b, ma, mb = nodes
    _bind(b, ma, mb)
    local, remote, n = mb.addr + lo, ma.addr + ro, length
    if odd == "bool":
        n = bool(length)
    elif odd == "float":
        local = float(local)
    elif odd == "str":
        remote = str(remote)
    mb.mm[:] = bytes([(lo + ro) % 251 + 1]) * SIZE
    t = b.issue_bound("write", local, "A", remote, n, 10.0)
    if t is None:
        # Not taken: only exact ints the look-ups accept must have been taken.
        assert not (type(local) is int and type(remote) is int and type(n) is int and _looked_up(b, local, remote, n))
        return
    assert _looked_up(b, local, remote, n)
    t.result()
    assert ma.mm[ro:ro + n] == mb.mm[lo:lo + n]


def test_every_change_a_look_up_could_see_retires_the_bound_pair(nodes) -> None:  # type: ignore[no-untyped-def]
    a, b, ma, mb = nodes

    def bound() -> bool:
        t = b.issue_bound("write", mb.addr, "A", ma.addr, 8, 10.0)
        if t is not None:
            t.result()
        return t is not None

    assert b.issue_bound("write", mb.addr, "B?", ma.addr, 8, 10.0) is None  # a host never used: nothing bound
    _bind(b, ma, mb)
    assert bound() and bound()
    b.mark_stale("A")  # a restart or a broken link noticed
    assert not bound()
    _bind(b, ma, mb)
    assert bound()
    b.query("A")  # the keys fetched again: new descriptors
    assert not bound()
    _bind(b, ma, mb)
    b.connect("A", "127.0.0.1", a.tcp_port)  # the host record replaced
    assert not bound()
    _bind(b, ma, mb)
    b.unregister_memory(mb.addr)  # the local range gone ...
    assert not bound()
    b.register_memory(mb.addr, 4096)  # ... and back, smaller: only the general path's answer counts
    assert not bound()
    with pytest.raises(ProviderError):
        b.issue("write", mb.addr + 4096, "A", ma.addr, 8, 10.0, watch=False)
    _bind(b, ma, mb)
    assert bound()
    assert b.issue_bound("write", mb.addr + 4096, "A", ma.addr, 8, 10.0) is None  # outside the new range
    b.unregister_memory(mb.addr)
    b.register_memory(mb.addr, SIZE)
    b.publish(mb.addr, SIZE)
    _bind(b, ma, mb)
    b.unpublish(mb.addr)  # the local range re-registered under a new name
    assert not bound()


def test_after_a_failed_transfer_the_peer_is_looked_up_again(own_nodes) -> None:  # type: ignore[no-untyped-def]
    """A transfer that fails because the peer is gone retires the pair: the next one resolves afresh."""
    a, b, ma, mb = own_nodes
    _bind(b, ma, mb)
    a.shutdown()
    t = b.issue_bound("write", mb.addr, "A", ma.addr, 8, 2.0)
    if t is not None:  # posted before the loss was seen: it fails, and says so
        with pytest.raises(Exception):  # noqa: B017 - whichever error the loss is reported as
            t.result()
        b.settled("A", t)
    assert b.issue_bound("write", mb.addr, "A", ma.addr, 8, 2.0) is None


def test_sync_transfers_follow_unregister_and_register_again(tcp_engines) -> None:  # type: ignore[no-untyped-def]
    """Through the Mooncake API: a range unregistered after a transfer is refused, and nothing lands."""
    a, b = tcp_engines
    ma, mb = Mem(), Mem()
    session = f"127.0.0.1:{a.get_rpc_port()}"
    assert a.register_memory(ma.addr, SIZE) == 0 and b.register_memory(mb.addr, SIZE) == 0
    mb.mm[0:4] = b"one!"
    assert b.transfer_sync_write(session, mb.addr, ma.addr, 4) == 0
    assert b.transfer_sync_write(session, mb.addr, ma.addr, 4) == 0
    assert ma.mm[0:4] == b"one!"
    assert b.unregister_memory(mb.addr) == 0
    mb.mm[0:4] = b"two!"
    assert b.transfer_sync_write(session, mb.addr, ma.addr, 4) == -1
    assert b.transfer_sync_read(session, mb.addr, ma.addr, 4) == -1
    assert ma.mm[0:4] == b"one!" and mb.mm[0:4] == b"two!"
    assert b.register_memory(mb.addr, 4096) == 0
    assert b.transfer_sync_write(session, mb.addr + 4096, ma.addr, 4) == -1  # past the new range
    assert b.transfer_sync_write(session, mb.addr, ma.addr, 4) == 0
    assert ma.mm[0:4] == b"two!"
    assert b.transfer_sync_read(session, mb.addr + 8, ma.addr, 4) == 0
    assert mb.mm[8:12] == b"two!"
    assert b.transfer_sync(session, mb.addr + 16, ma.addr, 4, 1) == 0  # a plain int opcode: Write
    assert ma.mm[0:4] == b"\0\0\0\0"
    assert b.transfer_sync_write(session, mb.addr, ma.addr, True) == 0  # not an exact int: general path
    assert b.transfer_sync_write(session, mb.addr, ma.addr, 4.0) == -1
    assert b.transfer_sync_write(session, mb.addr, ma.addr, 1 << 64) == -1
    assert b.transfer_sync_write(session, mb.addr, ma.addr, 0) == -1
    assert b.transfer_sync_write("127.0.0.1:1", mb.addr, ma.addr, 4) == -1


def test_threads_alternating_between_two_local_ranges_land_every_byte(tcp_engines) -> None:  # type: ignore[no-untyped-def]
    """The pair kept per host changes under the threads' feet (two local ranges, eight threads)."""
    a, b = tcp_engines
    ma, m1, m2 = Mem(2 * SIZE), Mem(), Mem()
    session = f"127.0.0.1:{a.get_rpc_port()}"
    assert a.register_memory(ma.addr, 2 * SIZE) == 0
    assert b.register_memory(m1.addr, SIZE) == 0 and b.register_memory(m2.addr, SIZE) == 0
    m1.mm[:] = bytes(range(256)) * (SIZE // 256)
    m2.mm[:] = bytes(reversed(range(256))) * (SIZE // 256)
    piece = SIZE // 64
    errors: list[tuple[int, int]] = []

    def work(t: int) -> None:
        for j in range(t, 64, 8):
            for k, m in enumerate((m1, m2)):
                off = j * piece
                rc = b.transfer_sync_write(session, m.addr + off, ma.addr + k * SIZE + off, piece)
                if rc:
                    errors.append((j, k))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert ma.mm[:SIZE] == m1.mm[:] and ma.mm[SIZE:] == m2.mm[:]
