#!/usr/bin/env python3
"""mpcomm.tent next to Mooncake: the same Mooncake-API workload through both engines.

``python benchmarks/bench_tent.py [--rounds 3] [--iters 200] [--no-host]``

Part 1 - the Mooncake Python API (``transfer_sync_write``; ``batch_transfer_sync_write``
of 64) at 4 KiB and 4 MiB, through ``mooncake.engine.TransferEngine`` (the
``mooncake-transfer-engine-non-cuda`` wheel, TCP; from ``$PEERS/venv-mcnc``) and
``mpcomm.tent.TransferEngine`` with protocol ``tcp`` (mpcomm's tcp transport) and
``auto`` (what mpcomm picks on one host: shm). Each engine runs a target and an
initiator process; rounds interleave the engines (rotating the order) and the
ratio printed is the median over rounds of mpcomm/Mooncake throughput.

Part 2 - the C++ host's cost per ``putAsync`` + poll + ``release`` through
libmpcomm.so (tests/tent/tent_host.cpp, compiled against the installed
include/ and lib/) against the same loop through ``mpcomm.tent.MPComm`` in
Python and a direct ``Engine.write(...).result()``, 4 KiB to one target.

Part 3 (``--tebench PATH``, a Mooncake build's ``tebench``): TENT itself moving data through
its MPCOMM transport, i.e. through libmpcomm.so, next to TENT's own shm and tcp transports, in
the same run (write, 4 KiB and 4 MiB, batch 1 and 64, one thread, loopback only).

The machine is shared: read the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time

HOST = "127.0.0.1"
PEERS = os.environ.get("PEERS", os.path.join(tempfile.gettempdir(), "peers"))
CASES = [("4KiB", 4 << 10, 1), ("4KiB", 4 << 10, 64), ("4MiB", 4 << 20, 1), ("4MiB", 4 << 20, 64)]


# -- worker roles: stdlib + the engine only (they run in Mooncake's venv too) -----------

def _engine(kind: str, protocol: str):  # type: ignore[no-untyped-def]
    if kind == "mooncake":
        from mooncake.engine import TransferEngine
    else:
        from mpcomm.tent import TransferEngine
    eng = TransferEngine()
    if eng.initialize(HOST, "P2PHANDSHAKE", protocol, "") != 0:
        raise SystemExit(f"{kind}: initialize failed")
    return eng


class _Buf:
    def __init__(self, n: int) -> None:
        self.mm = mmap.mmap(-1, n)
        self._c = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._c)
        ctypes.memset(self.addr, 1, n)


def target_role(kind: str, protocol: str, nbytes: int) -> None:
    eng = _engine(kind, protocol)
    buf = _Buf(nbytes)
    assert eng.register_memory(buf.addr, nbytes, "cpu:0") == 0
    print(json.dumps({"session": f"{HOST}:{eng.get_rpc_port()}", "addr": buf.addr}), flush=True)
    sys.stdin.read()
    os._exit(0)


def initiator_role(kind: str, protocol: str, session: str, raddr: int, iters: int, nbytes: int) -> None:
    eng = _engine(kind, protocol)
    buf = _Buf(nbytes)
    assert eng.register_memory(buf.addr, nbytes, "cpu:0") == 0
    out = {}
    for label, size, batch in CASES:
        n = max(3, iters if size <= 64 << 10 else iters // (20 if batch == 1 else 100))
        if batch == 1:
            def op() -> int:
                return eng.transfer_sync_write(session, buf.addr, raddr, size)
        else:
            la = [buf.addr + i * size for i in range(batch)]
            ra = [raddr + i * size for i in range(batch)]
            ln = [size] * batch

            def op() -> int:
                return eng.batch_transfer_sync_write(session, la, ra, ln)
        for _ in range(3):
            assert op() == 0
        lat = []
        t0 = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            rc = op()
            lat.append(time.perf_counter() - t)
            assert rc == 0, rc
        el = time.perf_counter() - t0
        out[f"{label}x{batch}"] = {"GBps": size * batch * n / el / 1e9, "p50_us": statistics.median(lat) * 1e6,
                                   "iters": n}
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)


# -- supervisor (needs mpcomm) --------------------------------------------------------------

def _spawn(python: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([python, os.path.abspath(__file__), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def run_engine(python: str, kind: str, protocol: str, iters: int, env: dict[str, str]) -> dict[str, dict[str, float]]:
    nbytes = 64 * (4 << 20)
    tgt = _spawn(python, ["--role", "target", "--engine", kind, "--protocol", protocol, "--bytes", str(nbytes)], env)
    try:
        info = json.loads(tgt.stdout.readline())  # type: ignore[union-attr]
        ini = subprocess.run([python, os.path.abspath(__file__), "--role", "initiator", "--engine", kind,
                              "--protocol", protocol, "--session", info["session"], "--raddr", str(info["addr"]),
                              "--iters", str(iters), "--bytes", str(nbytes)],
                             capture_output=True, text=True, timeout=900, env=env)
        lines = [ln for ln in ini.stdout.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            raise RuntimeError(f"{kind}/{protocol} initiator failed: {ini.stderr[-2000:]}")
        return json.loads(lines[-1][7:])
    finally:
        tgt.stdin.close()  # type: ignore[union-attr]
        try:
            tgt.wait(15)
        except subprocess.TimeoutExpired:
            tgt.kill()


def part1(rounds: int, iters: int) -> None:
    mc_py = os.environ.get("MOONCAKE_PYTHON") or os.path.join(PEERS, "venv-mcnc", "bin", "python")
    env = dict(os.environ, MC_LOG_LEVEL="WARNING", GLOG_minloglevel="2")
    libdirs = [os.path.join(PEERS, "sysroot/usr/lib/x86_64-linux-gnu"), os.path.join(PEERS, "sysroot/lib/x86_64-linux-gnu")]
    env["LD_LIBRARY_PATH"] = ":".join([*libdirs, env.get("LD_LIBRARY_PATH", "")])
    engines = [("mpcomm-tcp", sys.executable, "mpcomm", "tcp"), ("mpcomm-auto", sys.executable, "mpcomm", "auto")]
    if os.path.exists(mc_py):
        engines.append(("mooncake-tcp", mc_py, "mooncake", "tcp"))
    else:
        print(f"# Mooncake's wheel not found at {mc_py} (run /work/shared/peers/setup.sh); mpcomm only")
    results: dict[str, list[dict[str, dict[str, float]]]] = {name: [] for name, *_ in engines}
    for r in range(rounds):
        order = engines[r % len(engines):] + engines[:r % len(engines)]
        for name, py, kind, proto in order:
            results[name].append(run_engine(py, kind, proto, iters, env))
    for label, _size, batch in CASES:
        case = f"{label}x{batch}"
        line = [f"case=write message_size={label} batch={batch}"]
        per = {}
        for name in results:
            per[name] = [res[case] for res in results[name]]
            gbps = statistics.median(x["GBps"] for x in per[name])
            p50 = statistics.median(x["p50_us"] for x in per[name])
            line.append(f"{name}={gbps:.3f}GB/s(p50 {p50:.0f}us)")
        if "mooncake-tcp" in per:
            for name in ("mpcomm-tcp", "mpcomm-auto"):
                ratios = [a["GBps"] / b["GBps"] for a, b in zip(per[name], per["mooncake-tcp"])]
                line.append(f"{name}/mooncake={statistics.median(ratios):.2f}"
                            f"[{min(ratios):.2f}-{max(ratios):.2f}]")
        print(" ".join(line), flush=True)


def part2(iters: int) -> None:
    from pathlib import Path

    from mpcomm.tent import MPComm
    from mpcomm.tent.build import compile_host

    src = Path(__file__).resolve().parents[1] / "tests" / "tent" / "tent_host.cpp"
    with tempfile.TemporaryDirectory() as d:
        exe, reason = compile_host(src, Path(d) / "tent_host")
        if exe is None:
            print(f"# C++ host skipped: {reason}")
            return
        size = 4096
        for transport in ("shm", "tcp"):
            env = dict(os.environ, MPCOMM_TENT_BIND="127.0.0.1", MPCOMM_TRANSPORTS=transport,
                       MPCOMM_PYTHON=sys.executable)
            # The target is a process of its own for every path measured (a C++ host running libmpcomm).
            tgt = subprocess.Popen([str(exe), "target", "127.0.0.1:T", "0", str(1 << 20), "0"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=env)
            try:
                _, port_s, addr_s, _n = tgt.stdout.readline().split()  # type: ignore[union-attr]
                port, taddr = int(port_s), int(addr_s)
                out = subprocess.run([str(exe), "bench", "T", str(port), str(taddr), str(size), str(iters)],
                                     capture_output=True, text=True, timeout=600, env=env)
                line = [ln for ln in out.stdout.splitlines() if ln.startswith("BENCH")]
                if not line:
                    print(f"# C++ host bench failed: {out.stdout[-500:]} {out.stderr[-1500:]}")
                    return
                cpp = dict(kv.split("=") for kv in line[0].split()[1:])
                os.environ["MPCOMM_TRANSPORTS"] = transport
                ini = MPComm()
                assert ini.init("127.0.0.1:bench-py", "", 0) == 0
                lbuf = _Buf(size)
                assert ini.register_memory(lbuf.addr, size) == 0
                assert ini.connect("T", "127.0.0.1", port) == 0 and ini.query_remote_buffer("T")[0] == 0
                for _ in range(50):
                    h = ini.put_async(lbuf.addr, "T", taddr, size)
                    ini.wait_transfer(h)
                    ini.release_transfer(h)
                t0 = time.perf_counter()
                for _ in range(iters):
                    h = ini.put_async(lbuf.addr, "T", taddr, size)
                    while not ini.is_transfer_complete(h):
                        time.sleep(0)  # let the completion thread have the GIL
                    ini.release_transfer(h)
                py_api = (time.perf_counter() - t0) / iters * 1e6
                eng = ini.provider.engine
                region, _ = ini.provider.local_region(lbuf.addr, size)
                remote = ini.provider.host_buffers("T")[0].remote
                t0 = time.perf_counter()
                for _ in range(iters):
                    eng.write(region, remote, 0, size).result()  # type: ignore[union-attr]
                direct = (time.perf_counter() - t0) / iters * 1e6
                ini.shutdown()
                del os.environ["MPCOMM_TRANSPORTS"]
            finally:
                tgt.stdin.close()  # type: ignore[union-attr]
                try:
                    tgt.wait(15)
                except subprocess.TimeoutExpired:
                    tgt.kill()
            op = float(cpp["us_per_op"])
            print(f"case=cpp_host transport={transport} message_size=4KiB iters={iters} "
                  f"cpp_putAsync_poll_release={op:.1f}us (putAsync {float(cpp['putAsync_us']):.1f}us, "
                  f"isTransferComplete {float(cpp['isTransferComplete_ns']):.0f}ns, "
                  f"releaseTransfer {float(cpp['releaseTransfer_ns']):.0f}ns) "
                  f"python_MPComm_put_poll_release={py_api:.1f}us python_Engine_write_result={direct:.1f}us "
                  f"cpp/python_engine={op / direct:.2f}", flush=True)


def part3(tebench: str, duration: int) -> None:
    import random

    from mpcomm.tent.build import native_status

    st = native_status()
    if not st["built"]:
        print(f"# tebench skipped: {st['reason']}")
        return
    names = ("mpcomm", "rdma", "tcp", "shm", "nvlink", "mnnvl", "gds", "io_uring")
    rows: dict[tuple[str, int, int], float] = {}
    for xport in ("mpcomm", "shm", "tcp"):
        gates = {n: {"enable": n == xport} for n in names}
        env = dict(os.environ, MPCOMM_TENT_BIND="127.0.0.1", GLOG_minloglevel="1", MPCOMM_PYTHON=sys.executable,
                   LD_LIBRARY_PATH=f"{st['root']}/lib:" + os.environ.get("LD_LIBRARY_PATH", ""),
                   MC_TENT_CONF=json.dumps({"rpc_server_hostname": "127.0.0.1", "transports": gates}))
        for block in (4096, 4 << 20):
            rpc = 12000 + random.randrange(2000)  # TENT allocates 15000-17000 itself
            common = ["--backend=tent", f"--xport_type={xport}", "--metadata_type=p2p", "--seg_type=DRAM",
                      f"--total_buffer_size={512 << 20}"]
            tgt = subprocess.Popen([tebench, *common, f"--rpc_server_port={rpc}"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, env=dict(env, MPCOMM_TCP_PORT=str(23000 + rpc % 1000)))
            try:
                time.sleep(3)
                out = subprocess.run([tebench, *common, f"--rpc_server_port={rpc + 1}", f"--tent_transport_hint={xport}",
                                      f"--target_seg_name=127.0.0.1:{rpc}", "--op_type=write",
                                      f"--start_block_size={block}", f"--max_block_size={block}",
                                      "--start_batch_size=1", "--max_batch_size=64", "--start_num_threads=1",
                                      "--max_num_threads=1", f"--duration={duration}"],
                                     capture_output=True, text=True, timeout=300,
                                     env=dict(env, MPCOMM_TCP_PORT=str(24000 + rpc % 1000)))
            finally:
                tgt.terminate()
                tgt.wait(15)
            for line in out.stdout.splitlines():
                f = line.split()
                if len(f) >= 3 and f[0] == str(block) and f[1] in ("1", "64"):
                    rows[(xport, block, int(f[1]))] = float(f[2])
    for block, label in ((4096, "4KiB"), (4 << 20, "4MiB")):
        for batch in (1, 64):
            got = {x: rows.get((x, block, batch)) for x in ("mpcomm", "shm", "tcp")}
            if not got["mpcomm"]:
                print(f"case=tebench message_size={label} batch={batch} mpcomm=missing")
                continue
            parts = [f"{x}={v:.3f}GB/s" for x, v in got.items() if v]
            ratios = [f"mpcomm/{x}={got['mpcomm'] / v:.2f}" for x, v in got.items() if v and x != "mpcomm"]
            print(f"case=tebench op=write message_size={label} batch={batch} " + " ".join(parts + ratios), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=("supervisor", "target", "initiator"), default="supervisor")
    ap.add_argument("--engine", default="mpcomm")
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--session", default="")
    ap.add_argument("--raddr", type=int, default=0)
    ap.add_argument("--bytes", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=200, help="timed 4 KiB ops per case (fewer for 4 MiB)")
    ap.add_argument("--no-host", action="store_true", help="skip part 2 (the C++ host)")
    ap.add_argument("--no-engines", action="store_true", help="skip part 1")
    ap.add_argument("--tebench", default="", help="a Mooncake build's tebench: also run part 3")
    ap.add_argument("--tebench-duration", type=int, default=2)
    args = ap.parse_args()
    if args.role == "target":
        target_role(args.engine, args.protocol, args.bytes)
    elif args.role == "initiator":
        initiator_role(args.engine, args.protocol, args.session, args.raddr, args.iters, args.bytes)
    else:
        if not args.no_engines:
            part1(args.rounds, args.iters)
        if not args.no_host:
            part2(max(args.iters * 10, 1000))
        if args.tebench:
            part3(args.tebench, args.tebench_duration)


if __name__ == "__main__":
    main()
