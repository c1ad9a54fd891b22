"""The owner's liveness from its alive page, without a system call per copy (issue 28, speed).

A memfd copy used to poll the owner's pidfd after each copy: 0.2-0.6 us of system
call here, a third of a bound 4 KiB write. Now the owner hands its alive page (a
robust mutex one of its threads holds for the life of the process; the kernel
marks it FUTEX_OWNER_DIED when that thread dies, before the process counts as
exited) with each memfd, and the initiator reads that word after the copy. These
tests run the owner as a real process and kill it.
"""

from __future__ import annotations

import errno
import mmap
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from shm_support import make_engine

from mpcomm import PeerConnectionError
from mpcomm.memory import buffer_address
from mpcomm.plugins.shm import _copyloop

OWNER = r"""
import os, socket, sys, time
from mpcomm.plugins.shm import _copyloop
loop = _copyloop.get()
s = socket.socket(fileno=int(sys.argv[1]))
fd = loop.alive_page()
assert loop.alive_page() == fd  # one page per process
socket.send_fds(s, [b"page"], [fd])
time.sleep(60)
"""


def native_loop() -> Any:
    loop = _copyloop.get()
    if not loop.native or loop.mover is None:  # the ctypes-only build polls, as before
        pytest.skip(f"the copy loop's extension module is not in use here: {loop.reason}")
    assert loop.alive_page is not None, "the compiled copy loop makes alive pages"
    return loop


class Owner:
    """A process that made its alive page and sent it over a socket pair."""

    def __init__(self) -> None:
        a, b = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-c", OWNER, str(b.fileno())], pass_fds=[b.fileno()])
        b.close()
        a.settimeout(30)
        _, fds, _, _ = socket.recv_fds(a, 16, 1)
        a.close()
        self.page = fds[0]
        self.pidfd = os.pidfd_open(self.proc.pid)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        os.close(self.page)
        os.close(self.pidfd)


@pytest.fixture
def owner() -> Iterator[Owner]:
    native_loop()
    o = Owner()
    yield o
    o.close()


def _buffers() -> tuple[Any, Any, int, int]:
    src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    return src, dst, buffer_address(memoryview(src)), buffer_address(memoryview(dst))


def test_a_copy_reads_the_owners_word_and_fails_once_the_owner_is_killed(owner: Owner) -> None:
    loop = native_loop()
    assert loop.watch(owner.pidfd, owner.page, owner.proc.pid) == 1
    try:
        src, dst, s, d = _buffers()
        assert loop.copy(d, s, 4096, owner.pidfd) == 0
        assert (dst == src).all()
        owner.kill()
        assert loop.copy(d, s, 4096, owner.pidfd) == -errno.ESRCH
        z = np.zeros(1, dtype=np.int64)
        one = np.array([4096], dtype=np.int64)
        assert loop.copy_many(d, 4096, z, s, 4096, z, one, 0, 1, 1 << 20, owner.pidfd) == -errno.ESRCH
    finally:
        assert loop.unwatch(owner.pidfd) == 1
    assert loop.unwatch(owner.pidfd) == 0
    assert loop.copy(d, s, 4096, owner.pidfd) == -errno.ESRCH  # polled again: the same answer


def test_a_page_is_filed_only_for_its_own_pid_and_stays_read_only(owner: Owner) -> None:
    loop = native_loop()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with open(os.pidfd_open(other.pid), "rb", buffering=0) as f:  # someone else's pidfd
            assert loop.watch(f.fileno(), owner.page, other.pid) == 0
    finally:
        other.kill()
        other.wait(10)
    unsealed = os.memfd_create("not-a-page")
    try:
        os.ftruncate(unsealed, 4096)
        assert loop.watch(owner.pidfd, unsealed, owner.proc.pid) == 0
    finally:
        os.close(unsealed)
    assert loop.watch(owner.pidfd, owner.page, 0) == 0
    with pytest.raises(PermissionError):  # sealed: no initiator can forge the owner's word
        mmap.mmap(owner.page, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _alive_maps() -> list[str]:
    """Read-only mappings of an alive page here: other processes' pages (this process's own is rw)."""
    with open("/proc/self/maps") as f:
        return [line for line in f if "mpcomm-shm-alive" in line and line.split()[1] == "r--s"]


def test_an_attached_memfd_region_is_watched_through_the_owners_page(spawn) -> None:
    native_loop()
    target = spawn({"mem": [1 << 20, "allocate"]})
    before = len(_alive_maps())
    with make_engine() as e:
        remote = e.open(target.address, "mem")
        assert e.write(b"x" * 4096, remote).result(10) == 4096
        assert len(_alive_maps()) == before + 1  # the target's page, filed under its pidfd
        holder = int(target.cmd("hold"))  # a forked child keeps the connections open: only the page tells
        try:
            os.kill(target.pid, signal.SIGKILL)
            target.proc.wait(10)
            with pytest.raises(PeerConnectionError, match="exited"):
                e.write(b"y" * 4096, remote, timeout=5).result(10)
        finally:
            os.kill(holder, signal.SIGKILL)
