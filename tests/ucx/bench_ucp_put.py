"""Rough put bandwidth of the ctypes binding vs the bundled ucx_perftest.

Not a pytest module (no test_ prefix).  Run:  python tests/ucx/bench_ucp_put.py
Both sides busy-poll (like ucx_perftest); UCX_TLS is varied per row, and the
binding rows also vary peer error handling, which changes transport selection.
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "ucp_peer.py")
_spec = importlib.util.spec_from_file_location(
    "mpcomm_ucx_ucp_bench", os.path.join(HERE, "..", "..", "plugins", "ucx", "_ucp.py"))
ucp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ucp)

SIZES = [4 * 1024 * 1024, 64 * 1024 * 1024]


def env_for(tls):
    env = dict(os.environ)
    env.pop("UCX_TLS", None)
    if tls:
        env["UCX_TLS"] = tls
    return env


def binding(tls, eh, iters):
    env = env_for(tls)
    t = subprocess.Popen([sys.executable, PEER, "target", "--busy", "--size", str(max(SIZES))],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    info = t.stdout.readline()
    b = subprocess.Popen([sys.executable, PEER, "bench", "--eh", str(eh), "--iters", str(iters),
                          "--sizes", ",".join(map(str, SIZES))],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    b.stdin.write(info)
    b.stdin.flush()
    res = json.loads(b.stdout.readline())
    b.wait(120)
    t.stdin.write("exit\n")
    t.stdin.flush()
    t.wait(60)
    return res


def perftest(tls, size, iters, eh=False):
    exe, env = ucp.tool("ucx_perftest")
    env.pop("UCX_TLS", None)
    if tls:
        env["UCX_TLS"] = tls
    port = str(13337 + size % 1000)
    srv = subprocess.Popen([exe, "-p", port], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    out = subprocess.run([exe, "127.0.0.1", "-p", port, "-t", "ucp_put_bw", "-s", str(size),
                          "-n", str(iters), "-w", "3"] + (["-e"] if eh else []), env=env, capture_output=True, text=True, timeout=300)
    srv.wait(60)
    # Final summary row: "Final: iters typical avg overall | bw(avg) bw(overall) | msgrate..."
    rows = [l for l in out.stdout.splitlines() if l.strip().startswith("Final:")]
    if not rows:
        return None, out.stdout[-500:] + out.stderr[-500:]
    nums = re.findall(r"[\d.]+", rows[-1])
    return float(nums[5]), rows[-1].strip()


if __name__ == "__main__":
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    for tls in (None, "tcp"):
        for eh in (0, 1):
            r = binding(tls, eh, iters)
            print(f"binding UCX_TLS={tls or '<unset>'} eh={eh}: "
                  + ", ".join(f"{k.split(':')[0]} {int(k.split(':')[1]) >> 20} MiB: {v / 1.048576:.0f} MiB/s"
                            for k, v in r["mb_s"].items())
                  + f"  lanes={[l.split(':', 1)[1].split()[0] for l in r['lanes']]}")
        for eh in (False, True):
            for size in SIZES:
                bw, row = perftest(tls, size, iters, eh)
                print(f"ucx_perftest UCX_TLS={tls or '<unset>'}{' -e' if eh else ''} ucp_put_bw"
                      f" -s {size}: {bw} MiB/s | {row}")
