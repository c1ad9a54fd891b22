"""A target engine for the fault suite with more levers than the kit's: ``python host.py SPEC``.

SPEC is JSON ``{"transport": name, "endpoint": "127.0.0.1:0", "config": {...},
"regions": {"name": [size, how, seed]}}``; ``how`` is ``buffer`` (a registered
bytearray), ``readonly`` (registered bytes) or ``allocate`` (Engine.allocate); every region starts filled with
``pattern(seed)``. It prints one JSON line (address, pid, node_id, epoch, transports), then
answers one command per stdin line with one line:

* ``sha NAME OFF LEN`` — sha256 of that range; ``old:NAME`` is the memory of a
  region that was unregistered (kept alive here, so a late byte is seen);
* ``fill NAME SEED``;
* ``register NAME SIZE HOW SEED`` — ``ok`` or ``error Class: message``;
* ``unregister NAME [TIMEOUT]`` — ``ok SHA``: the sha256 of the whole old memory taken as
  unregister returned (the memory stays, as ``old:NAME``);
* ``rlimit AS|MEMLOCK SOFT`` — lower (or ``inf``) this process's soft limit;
  ``vmsize`` — this process's VmSize in bytes;
* ``ping`` — ``pong`` (the command loop is alive);
* ``quit``.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import sys
from typing import Any


def main(argv: list[str]) -> int:
    spec: dict[str, Any] = json.loads(argv[1])
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import mpcomm
    from mpcomm.testing.patterns import pattern

    engine = mpcomm.Engine(spec.get("config") or None, endpoint=spec.get("endpoint", "127.0.0.1:0"),
                           transports=[spec["transport"]])
    regions: dict[str, Any] = {}
    memory: dict[str, Any] = {}  # name -> the bytes behind it (old:NAME after unregister)

    def register(name: str, size: int, how: str, seed: int) -> None:
        if how == "allocate":
            region = engine.allocate(size, name=name)
            region.view[:] = pattern(seed, size)
            mem: Any = region.view[:]  # a second view: the mapping outlives unregister while we hold it
        elif how == "readonly":
            mem = bytes(pattern(seed, size))
            region = engine.register(mem, name=name)
        else:
            mem = bytearray(pattern(seed, size))
            region = engine.register(mem, name=name)
        regions[name] = region
        memory[name] = mem

    for name, (size, how, seed) in spec.get("regions", {}).items():
        register(name, int(size), how, int(seed))
    out.write(json.dumps({"address": engine.address, "pid": os.getpid(), "node_id": engine.node_id,
                          "epoch": engine.epoch,
                          "transports": engine.info().transports}) + "\n")
    limits = {"AS": resource.RLIMIT_AS, "MEMLOCK": resource.RLIMIT_MEMLOCK}
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        try:
            op = cmd[0]
            if op == "sha":
                off, ln = int(cmd[2]), int(cmd[3])
                out.write(hashlib.sha256(memoryview(memory[cmd[1]])[off : off + ln]).hexdigest() + "\n")
            elif op == "fill":
                mem = memory[cmd[1]]
                memoryview(mem)[:] = pattern(int(cmd[2]), len(mem))
                out.write("ok\n")
            elif op == "register":
                register(cmd[1], int(cmd[2]), cmd[3], int(cmd[4]))
                out.write("ok\n")
            elif op == "unregister":
                region = regions[cmd[1]]
                engine.unregister(region, timeout=float(cmd[2]) if len(cmd) > 2 else None)
                del regions[cmd[1]]
                old = memory[f"old:{cmd[1]}"] = memory.pop(cmd[1])
                # The old memory's sha the moment unregister returned: any later change is a late byte.
                out.write(f"ok {hashlib.sha256(memoryview(old)).hexdigest()}\n")
            elif op == "rlimit":
                which = limits[cmd[1]]
                _soft, hard = resource.getrlimit(which)
                soft = resource.RLIM_INFINITY if cmd[2] == "inf" else int(cmd[2])
                resource.setrlimit(which, (soft, hard))
                out.write("ok\n")
            elif op == "vmsize":
                with open("/proc/self/status") as f:
                    kb = next(int(ln.split()[1]) for ln in f if ln.startswith("VmSize:"))
                out.write(f"{kb * 1024}\n")
            elif op == "ping":
                out.write("pong\n")
            elif op == "quit":
                break
            else:
                out.write(f"error unknown command {op}\n")
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            out.write(f"error {type(exc).__name__}: {str(exc).replace(chr(10), ' ')}\n")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
