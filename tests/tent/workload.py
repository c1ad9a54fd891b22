#!/usr/bin/env python3
"""The shared Mooncake-API workload: the same steps against either engine.

    python workload.py --engine mpcomm      # mpcomm.tent.TransferEngine
    python workload.py --engine mooncake    # mooncake.engine.TransferEngine (the wheel)

Standard library only besides the engine itself (it runs in Mooncake's own
venv too). A target process (this script, ``--role target``) registers a
buffer and answers hash/fill commands on stdin; the initiator (this process)
runs the steps and prints one JSON object: step name -> outcome (return codes
and booleans). tests/tent/test_workload.py runs it for both engines and
compares the outcomes.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib
import json
import mmap
import os
import select
import signal
import subprocess
import sys
import time

SIZE = 4 << 20
HOST = "127.0.0.1"


ETCD = ""  # "host:port" of an etcd server: sessions are named by local_hostname, found through etcd


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def make_engine(kind: str):  # type: ignore[no-untyped-def]
    """(engine, initialize's return code, the session name peers use)."""
    # Mooncake's wheel lives in a venv of its own (it is no test dependency of mpcomm): imported by name.
    module = importlib.import_module("mooncake.engine" if kind == "mooncake" else "mpcomm.tent")
    eng = module.TransferEngine()
    if ETCD:
        name = f"{HOST}:{_free_port()}"
        return eng, eng.initialize(name, ETCD, "tcp", ""), name
    rc = eng.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
    return eng, rc, f"{HOST}:{eng.get_rpc_port()}" if rc == 0 else ""


class Buf:
    def __init__(self, n: int) -> None:
        self.n = n
        self.mm = mmap.mmap(-1, n)
        self._c = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._c)

    def fill(self, seed: int, off: int = 0, n: int | None = None) -> None:
        n = self.n - off if n is None else n
        block = hashlib.sha256(seed.to_bytes(8, "little")).digest() * 2048
        for o in range(off, off + n, len(block)):
            k = min(len(block), off + n - o)
            self.mm[o:o + k] = block[:k]

    def digest(self, off: int = 0, n: int | None = None) -> str:
        n = self.n - off if n is None else n
        return hashlib.sha256(self.mm[off:off + n]).hexdigest()


def target_main(kind: str) -> None:
    eng, rc, session = make_engine(kind)
    buf = Buf(SIZE)
    buf.fill(99)
    rc2 = eng.register_memory(buf.addr, SIZE, "cpu:0")
    print(json.dumps({"session": session, "addr": buf.addr, "init": rc, "reg": rc2}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "hash":
            print(buf.digest(int(cmd[1]), int(cmd[2])), flush=True)
        elif cmd[0] == "fill":
            buf.fill(int(cmd[1]))
            print(buf.digest(), flush=True)
        elif cmd[0] == "quit":
            break
    eng.unregister_memory(buf.addr)
    os._exit(0)  # Mooncake's engine threads do not always let the interpreter exit


class Target:
    def __init__(self, kind: str) -> None:
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--engine", kind, "--role", "target",
                                   "--etcd", ETCD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        info = json.loads(self.line(60))
        self.session, self.addr = info["session"], info["addr"]
        self.ok = info["init"] == 0 and info["reg"] == 0

    def line(self, timeout: float) -> str:
        r, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not r:
            raise TimeoutError("target silent")
        return self.p.stdout.readline().strip()  # type: ignore[union-attr]

    def ask(self, cmd: str) -> str:
        self.p.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        self.p.stdin.flush()  # type: ignore[union-attr]
        return self.line(60)

    def kill(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGCONT)
            self.p.kill()
        self.p.wait(10)

    def quit(self) -> None:
        if self.p.poll() is None:
            try:
                self.ask("quit")
                self.p.wait(10)
            except Exception:  # noqa: BLE001
                self.kill()


def initiator_main(kind: str) -> dict[str, object]:
    out: dict[str, object] = {}
    t = Target(kind)
    try:
        out["target_up"] = t.ok
        eng, rc, _session = make_engine(kind)
        out["initialize"] = rc
        loc = Buf(SIZE)
        other = Buf(1 << 20)
        out["register_memory"] = eng.register_memory(loc.addr, SIZE, "cpu:0")
        s, ra = t.session, t.addr

        def lands(off: int, n: int, src_off: int | None = None) -> bool:
            return t.ask(f"hash {off} {n}") == loc.digest(off if src_off is None else src_off, n)

        loc.fill(1)
        out["write_4k"] = eng.transfer_sync_write(s, loc.addr, ra, 4096)
        out["write_4k_landed"] = lands(0, 4096)
        out["write_1m"] = eng.transfer_sync_write(s, loc.addr + 8192, ra + 8192, 1 << 20)
        out["write_1m_landed"] = lands(8192, 1 << 20)
        t.ask("fill 2")
        out["read_1m"] = eng.transfer_sync_read(s, loc.addr, ra, 1 << 20)
        out["read_1m_landed"] = lands(0, 1 << 20)

        loc.fill(3)
        n = 64
        la = [loc.addr + i * 8192 for i in range(n)]
        rr = [ra + i * 8192 for i in range(n)]
        out["batch_write"] = eng.batch_transfer_sync_write(s, la, rr, [4096] * n)
        out["batch_write_landed"] = all(lands(i * 8192, 4096) for i in (0, 17, 63))
        t.ask("fill 4")
        out["batch_read"] = eng.batch_transfer_sync_read(s, la, rr, [4096] * n)
        out["batch_read_landed"] = all(lands(i * 8192, 4096) for i in (0, 31, 63))
        out["batch_length_mismatch"] = eng.batch_transfer_sync_write(s, la, rr[:-1], [4096] * n)

        loc.fill(5)
        bid = eng.batch_transfer_async_write(s, la, rr, [4096] * n)
        out["async_batch_id_nonzero"] = bid != 0
        out["async_batch_status"] = eng.get_batch_transfer_status([bid]) if bid else None
        out["async_batch_landed"] = lands(0, 4096) and lands(63 * 8192, 4096)
        loc.fill(6)
        bid = eng.transfer_submit_write(s, loc.addr, ra, 1 << 20)
        out["submit_id_nonzero"] = bid != 0
        st, t0 = 0, time.monotonic()
        while st == 0 and time.monotonic() - t0 < 30:
            st = eng.transfer_check_status(bid)
        out["check_status_final"] = st
        out["submit_landed"] = lands(0, 1 << 20)

        loc.fill(8)  # whatever of these lands changes the target's bytes
        before = t.ask(f"hash 0 {SIZE}")
        out["write_past_end"] = eng.transfer_sync_write(s, loc.addr, ra + SIZE - 1024, 4096)
        out["write_unpublished_addr"] = eng.transfer_sync_write(s, loc.addr, 0x10000, 4096)
        out["read_unpublished_addr"] = eng.transfer_sync_read(s, loc.addr, 0x10000, 4096)
        out["batch_with_bad_entry"] = eng.batch_transfer_sync_write(s, [loc.addr, loc.addr], [ra, 0x10000],
                                                                   [4096, 4096])
        out["target_untouched_after_bad"] = t.ask(f"hash 0 {SIZE}") == before
        out["unknown_session"] = eng.transfer_sync_write(f"{HOST}:1", loc.addr, ra, 4096)
        out["first_buffer_address_matches"] = eng.get_first_buffer_address(s) == ra

        # A target that stops answering: the call gives up with -1 after the timeout.
        os.kill(t.p.pid, signal.SIGSTOP)
        time.sleep(0.3)  # the signal is asynchronous
        t0 = time.monotonic()
        out["write_to_stopped_peer"] = eng.transfer_sync_write(s, loc.addr, ra, 4096)
        el = time.monotonic() - t0
        os.kill(t.p.pid, signal.SIGCONT)
        out["timeout_bounded"] = el < 120
        time.sleep(0.5)
        out["write_after_resume"] = eng.transfer_sync_write(s, loc.addr, ra, 4096)

        # The peer dies and another one starts: the dead session fails, the new one works.
        t.kill()
        out["write_to_dead_peer"] = eng.transfer_sync_write(s, loc.addr, ra, 4096)
        t = Target(kind)
        loc.fill(7)
        ok = -1
        for _ in range(3):
            ok = eng.transfer_sync_write(t.session, loc.addr, t.addr, 1 << 20)
            if ok == 0:
                break
        out["write_after_peer_restart"] = ok
        out["restart_landed"] = t.ask(f"hash 0 {1 << 20}") == loc.digest(0, 1 << 20)

        out["unregister_memory"] = eng.unregister_memory(loc.addr)
        del other
    finally:
        t.quit()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("mpcomm", "mooncake"), required=True)
    ap.add_argument("--role", choices=("initiator", "target"), default="initiator")
    ap.add_argument("--etcd", default="", help="host:port of an etcd server instead of P2PHANDSHAKE")
    args = ap.parse_args()
    global ETCD
    ETCD = args.etcd
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    os.environ.setdefault("GLOG_minloglevel", "2")
    if args.role == "target":
        target_main(args.engine)
        return
    res = initiator_main(args.engine)
    print("RESULT " + json.dumps(res), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
