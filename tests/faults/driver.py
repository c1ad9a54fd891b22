"""An initiator engine for the fault suite, run inside a host namespace: ``python driver.py SPEC``.

SPEC is JSON ``{"endpoint": "10.77.0.1:0", "config": {...}}``. It prints one
JSON line (its address), then answers one JSON command per stdin line with
one JSON line. Every transfer reports how it ended and how long it took::

    {"op": "start", "kind": "write", "addr": A, "region": R, "offset": O, "length": N, "seed": S, "timeout": T}
        -> {"id": k}                   (the request runs in the background)
    {"op": "wait", "id": k}            -> {"ok": bool, "error": name, "message": str, "elapsed": s, "sha": hex}
    {"op": "run", ...same as start...} -> the outcome directly
    {"op": "quit"}

``sha`` is the sha256 of the bytes written (or read), for the test to compare
with the target's own ``sha`` of that range.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    import mpcomm
    from mpcomm.testing.patterns import pattern

    engine = mpcomm.Engine(spec.get("config") or None, endpoint=spec["endpoint"], transports=["tcp"])
    remotes: dict[tuple[str, str], Any] = {}
    running: dict[int, tuple[Any, float, str, Any]] = {}
    next_id = 0

    def remote(addr: str, region: str, timeout: float) -> Any:
        key = (addr, region)
        if key not in remotes:
            remotes[key] = engine.open(addr, region, timeout=timeout)
        return remotes[key]

    def start(cmd: dict[str, Any]) -> tuple[Any, float, str, Any]:
        t0 = time.monotonic()
        try:
            r = remote(cmd["addr"], cmd["region"], cmd["timeout"])
            if cmd["kind"] == "write":
                data = pattern(cmd["seed"], cmd["length"])
                fut = engine.write(data, r, cmd["offset"], timeout=cmd["timeout"])
                return fut, t0, hashlib.sha256(data).hexdigest(), None
            buf = bytearray(cmd["length"])
            fut = engine.read(buf, r, cmd["offset"], timeout=cmd["timeout"])
            return fut, t0, "", buf
        except mpcomm.MpcommError as exc:
            return exc, t0, "", None

    def finish(entry: tuple[Any, float, str, Any]) -> dict[str, Any]:
        fut, t0, sha, buf = entry
        try:
            if isinstance(fut, BaseException):
                raise fut
            fut.result(120)  # a hang shows as a huge elapsed, never as a stuck driver
            if buf is not None:
                sha = hashlib.sha256(buf).hexdigest()
            return {"ok": True, "elapsed": time.monotonic() - t0, "sha": sha}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            if isinstance(exc, mpcomm.MpcommError) and exc.peer:
                remotes.pop(next((k for k in remotes if k[0] == exc.peer), ("", "")), None)
            return {"ok": False, "error": type(exc).__name__, "message": str(exc)[:500],
                    "elapsed": time.monotonic() - t0,
                    "confirmed": getattr(exc, "confirmed", None)}

    out.write(json.dumps({"address": engine.address, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "quit":
                break
            if op == "start":
                next_id += 1
                running[next_id] = start(cmd)
                out.write(json.dumps({"id": next_id}) + "\n")
            elif op == "wait":
                out.write(json.dumps(finish(running.pop(cmd["id"]))) + "\n")
            elif op == "run":
                out.write(json.dumps(finish(start(cmd))) + "\n")
            elif op == "forget":
                remotes.clear()
                out.write(json.dumps({"ok": True}) + "\n")
            else:
                out.write(json.dumps({"fatal": f"unknown op {op!r}"}) + "\n")
        except Exception as exc:  # noqa: BLE001
            out.write(json.dumps({"fatal": f"{type(exc).__name__}: {exc}"}) + "\n")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
