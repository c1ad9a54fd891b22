#!/usr/bin/env python3
"""The Mooncake API's sync calls, waited on with no other Python thread (issue 28 item 2).

    python waiter_check.py PROTOCOL            # initiator: spawns the target, exits 0 or 1 with the report
    python waiter_check.py PROTOCOL --target   # target: registers a buffer, prints its session and address

The initiator installs :class:`mpcomm.testing.completion.PythonThreads` before its
TransferEngine starts any thread, then checks transfer_sync_write/read and
batch_transfer_sync_write/read: only the calling thread may run Python while it waits.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys

SIZE = 1 << 20
N = 4096
BATCH = 8


def _engine(protocol: str):  # type: ignore[no-untyped-def]
    from mpcomm.tent import TransferEngine

    eng = TransferEngine()
    assert eng.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == 0
    return eng, f"127.0.0.1:{eng.get_rpc_port()}"


def _buffer(eng, n: int):  # type: ignore[no-untyped-def]
    mm = mmap.mmap(-1, n)
    anchor = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(anchor)
    assert eng.register_memory(addr, n, "cpu:0") == 0
    return mm, anchor, addr


def target(protocol: str) -> None:
    eng, session = _engine(protocol)
    mm, _anchor, addr = _buffer(eng, SIZE)
    print(json.dumps({"session": session, "addr": addr}), flush=True)
    sys.stdin.readline()  # the initiator closes stdin when it is done
    os._exit(0)


def initiator(protocol: str) -> int:
    from mpcomm.testing.completion import PythonThreads, waiter_only

    threads = PythonThreads()
    threads.install()
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), protocol, "--target"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(p.stdout.readline())  # type: ignore[union-attr]
        s, ra = info["session"], info["addr"]
        eng, _ = _engine(protocol)
        mm, _anchor, la = _buffer(eng, SIZE)
        mm[:] = os.urandom(SIZE)
        offs = [i * N for i in range(BATCH)]
        # Warm-up: connections, attachments and lazily started threads are not the wait.
        assert eng.transfer_sync_write(s, la, ra, N) == 0
        assert eng.transfer_sync_read(s, la + SIZE // 2, ra, N) == 0
        assert eng.batch_transfer_sync_write(s, [la + o for o in offs], [ra + o for o in offs], [N] * BATCH) == 0
        cases = [
            ("transfer_sync_write", lambda: eng.transfer_sync_write(s, la, ra, N)),
            ("transfer_sync_read", lambda: eng.transfer_sync_read(s, la + SIZE // 2, ra, N)),
            ("batch_transfer_sync_write",
             lambda: eng.batch_transfer_sync_write(s, [la + o for o in offs], [ra + o for o in offs], [N] * BATCH)),
            ("batch_transfer_sync_read",
             lambda: eng.batch_transfer_sync_read(s, [la + SIZE // 2 + o for o in offs], [ra + o for o in offs],
                                                  [N] * BATCH)),
        ]
        for name, call in cases:
            rc = waiter_only(threads, f"{protocol} {name}", call)
            assert rc == 0, f"{name} returned {rc}"
        assert mm[SIZE // 2 : SIZE // 2 + N * BATCH] == mm[: N * BATCH], "the read-back differs"
    except AssertionError as exc:
        print(f"FAILED {exc}", flush=True)
        return 1
    finally:
        threads.uninstall()
        p.stdin.close()  # type: ignore[union-attr]
        p.wait(30)
    print("passed", flush=True)
    return 0


if __name__ == "__main__":
    if "--target" in sys.argv:
        target(sys.argv[1])
    else:
        rc = initiator(sys.argv[1])
        sys.stdout.flush()
        os._exit(rc)  # the engine's threads need not be joined
