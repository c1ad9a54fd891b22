"""4 KiB write latency of ucx over ``UCX_TLS=tcp,self`` against an idle target, per progress model.

Two processes on this host: a target that registers 8 MiB and sleeps, and an
initiator that times 1,000 ``write(...).result()`` of 4 KiB after 100 warm-up
writes. ``MPCOMM_UCX_NATIVE`` is set per side from ``TGT_NATIVE`` /
``INI_NATIVE`` (default 1: the native progress loop; 0: the Python progress
thread), so each side's share of the latency can be measured (docs/ucx.md,
"The cost on a quiet machine")::

    python benchmarks/ucx_tcp_idle_latency.py <python> '<target config json>' '<initiator config json>' LABEL
    TGT_NATIVE=0 INI_NATIVE=0 python benchmarks/ucx_tcp_idle_latency.py .venv/bin/python '{}' '{}' python-threads

Prints ``LABEL {"p50": us, "p90": us}``. Run the variants interleaved: the
figures are only comparable within one session.
"""

import json
import os
import subprocess
import sys

TARGET = r"""
import sys, time, json
import mpcomm
e = mpcomm.Engine(json.loads(sys.argv[1]), transports=["ucx"])
e.register(bytearray(8 << 20), name="kv")
print(e.address, flush=True)
time.sleep(600)
"""
INIT = r"""
import sys, time, json
import mpcomm
addr, iters, cfg = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
with mpcomm.Engine(cfg, transports=["ucx"]) as ini:
    r = ini.open(addr, "kv"); src = ini.allocate(4096)
    for _ in range(100):
        ini.write(src, r, 0, 4096).result(30)
    lat = []
    for _ in range(iters):
        t = time.perf_counter(); ini.write(src, r, 0, 4096).result(30); lat.append(time.perf_counter() - t)
lat.sort()
print(json.dumps({"p50": lat[len(lat) // 2] * 1e6, "p90": lat[int(len(lat) * .9)] * 1e6}))
"""


def main() -> None:
    py, tcfg, icfg, label = sys.argv[1:5]
    env = dict(os.environ, UCX_TLS="tcp,self")
    tenv = dict(env, MPCOMM_UCX_NATIVE=os.environ.get("TGT_NATIVE", "1"))
    ienv = dict(env, MPCOMM_UCX_NATIVE=os.environ.get("INI_NATIVE", "1"))
    tgt = subprocess.Popen([py, "-c", TARGET, tcfg], stdout=subprocess.PIPE, text=True, env=tenv)
    try:
        addr = tgt.stdout.readline().strip()
        r = subprocess.run([py, "-c", INIT, addr, "1000", icfg], capture_output=True, text=True, env=ienv,
                           timeout=300)
        out = r.stdout.strip().splitlines()
        print(label, out[-1] if out else r.stderr[-300:])
    finally:
        tgt.kill()
        tgt.wait()


if __name__ == "__main__":
    main()
