"""Helper process for test_ucp_binding.py / bench_ucp_put.py.

Runs as a plain script (never imported by pytest) and loads
plugins/ucx/_ucp.py by file path, so it works before mpcomm is installed.
Protocol: one JSON object per line on stdout; commands on stdin.

  target    --size N [--busy] [--readonly]
                                maps an mmap buffer (--readonly: without PROT_REMOTE_WRITE),
                                prints {address, base, rkey};
                                then serves stdin: "check OFF LEN SEED", "exit".
  initiator --offset K --size N --eh 0|1 [--seed S] [--kill-test]
                                first stdin line = target's JSON.
  bench     --sizes a,b --iters I --eh 0|1
"""
import argparse
import importlib.util
import json
import mmap
import os
import random
import select
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_MOD = os.path.join(_HERE, "..", "..", "plugins", "ucx", "_ucp.py")
_spec = importlib.util.spec_from_file_location("mpcomm_ucx_ucp", _MOD)
ucp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ucp)

FILL = 0xEE

# UCX logs (UCX_LOG_LEVEL, UCX_PROTO_INFO) go to the C-level stdout, which would
# corrupt the JSON protocol: keep a private dup of fd 1 and point fd 1 at stderr.
_proto = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)


def emit(**kw):
    _proto.write(json.dumps(kw) + "\n")
    _proto.flush()


def pattern(seed, n):
    return random.Random(seed).randbytes(n)


def lanes(text):
    return [l.strip() for l in text.splitlines() if "lane[" in l]


def target(args):
    ctx = ucp.Context()
    w = ctx.create_worker()
    n = args.size
    buf = mmap.mmap(-1, n)
    buf[:] = bytes([FILL]) * n
    prot = None
    if args.readonly:  # what the transport registers for a read-only region: no PROT_REMOTE_WRITE
        prot = ucp.PROT_LOCAL_READ | ucp.PROT_LOCAL_WRITE | ucp.PROT_REMOTE_READ
    mh = ctx.mem_map(ucp.buffer_address(buf), n, prot)
    emit(address=w.address.hex(), base=mh.address, rkey=mh.pack_rkey().hex(), size=n,
         version=ucp.version(), pid=os.getpid())
    efd, stdin = w.fileno(), sys.stdin.fileno()
    pending = b""
    while True:
        # Passive side still has to progress: tcp (and shm without zero-copy)
        # implement put/get as active messages handled by *this* worker.
        if args.busy:
            w.progress()
            ready = select.select([stdin], [], [], 0)[0]
        else:
            if not w.arm():
                continue
            ready = select.select([stdin, efd], [], [], 1.0)[0]
        if stdin not in ready:
            continue
        chunk = os.read(stdin, 4096)
        if not chunk:
            break
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            cmd = line.decode().split()
            if cmd[0] == "check":
                off, ln, seed = map(int, cmd[1:])
                ok = buf[off:off + ln] == pattern(seed, ln)
                edges = (off == 0 or buf[off - 1] == FILL) and (off + ln >= n or buf[off + ln] == FILL)
                emit(ok=bool(ok), edges=bool(edges))
            elif cmd[0] == "exit":
                ctx.close()
                emit(bye=True)
                return


def initiator(args):
    info = json.loads(sys.stdin.readline())
    ctx = ucp.Context()
    w = ctx.create_worker()
    ep = w.connect(bytes.fromhex(info["address"]), error_handling=bool(args.eh))
    rk = ep.unpack_rkey(bytes.fromhex(info["rkey"]))
    n, off = args.size, args.offset
    assert off + n <= info["size"]
    src = mmap.mmap(-1, n)
    src[:] = pattern(args.seed, n)
    dst = mmap.mmap(-1, n)
    remote = info["base"] + off
    t0 = time.monotonic()
    ucp.wait_all([ep.put(ucp.buffer_address(src), n, remote, rk)], timeout=30)
    ucp.wait_all([ep.flush()], timeout=30)  # remote completion before reading back
    t1 = time.monotonic()
    ucp.wait_all([ep.get(ucp.buffer_address(dst), n, remote, rk)], timeout=30)
    t2 = time.monotonic()
    emit(roundtrip_ok=dst[:] == src[:], put_s=t1 - t0, get_s=t2 - t1,
         lanes=lanes(ep.info()), thread_mode=w.thread_mode)
    if args.kill_test:
        emit(ready=True)
        sys.stdin.readline()  # test kills the target, then says "go"
        t0 = time.monotonic()
        status = None
        try:
            ucp.wait_all([ep.get(ucp.buffer_address(dst), n, remote, rk)], timeout=args.deadline)
            ucp.wait_all([ep.flush()], timeout=args.deadline)
            status = 0
        except ucp.UcxError as exc:
            status = exc.status
            msg = str(exc)
        emit(status=status, elapsed=time.monotonic() - t0, err_cb=ep.error_status,
             msg=msg if status else "")
        ep.close(force=True, timeout=5)
    else:
        ep.close(force=False, timeout=10)
    ctx.close()


def bench(args):
    info = json.loads(sys.stdin.readline())
    ctx = ucp.Context()
    w = ctx.create_worker()
    ep = w.connect(bytes.fromhex(info["address"]), error_handling=bool(args.eh))
    rk = ep.unpack_rkey(bytes.fromhex(info["rkey"]))
    results = {}
    for n in map(int, args.sizes.split(",")):
        src = mmap.mmap(-1, n)
        src[:] = b"\x5a" * n
        mh = ctx.mem_map(ucp.buffer_address(src), n)  # pre-registered local side
        addr = ucp.buffer_address(src)
        # warm-up (connection wireup, registration caches)
        ucp.wait_all([ep.put(addr, n, info["base"], rk, memh=mh), ep.flush()], timeout=60)
        for mode in ("serial", "pipelined"):
            # serial: wait for local completion of each put (1 in flight);
            # pipelined: post all puts, then one flush (what ucx_perftest does).
            t0 = time.monotonic()
            reqs = []
            for _ in range(args.iters):
                r = ep.put(addr, n, info["base"], rk, memh=mh)
                if mode == "serial":
                    ucp.wait_all([r], timeout=60)
                else:
                    reqs.append(r)
            ucp.wait_all(reqs + [ep.flush()], timeout=120)
            dt = time.monotonic() - t0
            results[f"{mode}:{n}"] = n * args.iters / dt / 1e6
    emit(mb_s=results, lanes=lanes(ep.info()))
    ep.close(force=False, timeout=10)
    ctx.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["target", "initiator", "bench"])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--offset", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--eh", type=int, default=1)
    ap.add_argument("--busy", action="store_true")
    ap.add_argument("--readonly", action="store_true")
    ap.add_argument("--kill-test", action="store_true")
    ap.add_argument("--deadline", type=float, default=10.0)
    ap.add_argument("--sizes", default="4194304")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    {"target": target, "initiator": initiator, "bench": bench}[args.role](args)


if __name__ == "__main__":
    main()
