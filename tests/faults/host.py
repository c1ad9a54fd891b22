"""A target engine for the fault suite with more levers than the kit's: ``python host.py SPEC``.

Its command loop is the kit's (``mpcomm.testing.target.serve_commands``); only the commands differ.

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
    from mpcomm.testing.target import serve_commands

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

    def sha(name: str, off: str, ln: str) -> str:
        return hashlib.sha256(memoryview(memory[name])[int(off) : int(off) + int(ln)]).hexdigest()

    def fill(name: str, seed: str) -> str:
        mem = memory[name]
        memoryview(mem)[:] = pattern(int(seed), len(mem))
        return "ok"

    def register_cmd(name: str, size: str, how: str, seed: str) -> str:
        register(name, int(size), how, int(seed))
        return "ok"

    def unregister(name: str, timeout: str | None = None) -> str:
        engine.unregister(regions[name], timeout=float(timeout) if timeout is not None else None)
        del regions[name]
        old = memory[f"old:{name}"] = memory.pop(name)
        # The old memory's sha the moment unregister returned: any later change is a late byte.
        return f"ok {hashlib.sha256(memoryview(old)).hexdigest()}"

    def rlimit(which: str, soft: str) -> str:
        res = limits[which]
        _soft, hard = resource.getrlimit(res)
        resource.setrlimit(res, (resource.RLIM_INFINITY if soft == "inf" else int(soft), hard))
        return "ok"

    def vmsize() -> str:
        with open("/proc/self/status") as f:
            kb = next(int(ln.split()[1]) for ln in f if ln.startswith("VmSize:"))
        return str(kb * 1024)

    serve_commands({"sha": sha, "fill": fill, "register": register_cmd, "unregister": unregister,
                    "rlimit": rlimit, "vmsize": vmsize, "ping": lambda: "pong"}, out)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
