"""A target engine in its own process for the ucx revocation and security tests.

Run as ``python engine_peer.py CONFIG_JSON``; prints ``{"address", "pid"}`` and then
answers one command per stdin line with one JSON line on stdout:

* ``register NAME SIZE ACCESS HOW``: HOW is ``buffer`` (bytearray) or ``allocate``;
* ``unregister NAME``: Engine.unregister, the buffer is kept (for ``count``);
* ``free NAME``: drop the last reference to the buffer (after unregister);
* ``count NAME BYTE``: how many bytes of the buffer equal BYTE;
* ``fill NAME BYTE``;
* ``open ADDRESS NAME`` / ``write NAME OFFSET LENGTH BYTE``: act as an initiator towards
  another engine (``write`` answers ``{"ok": ...}`` or ``{"failed": "ErrorClass"}``);
* ``ping``, ``quit``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time


def main() -> int:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import mpcomm

    engine = mpcomm.Engine(json.loads(sys.argv[1]) if len(sys.argv) > 1 else None, transports=["ucx"])
    regions: dict[str, object] = {}
    buffers: dict[str, object] = {}
    remotes: dict[str, object] = {}
    out.write(json.dumps({"address": engine.address, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        try:
            if cmd[0] == "register":
                name, size, access, how = cmd[1], int(cmd[2]), cmd[3], cmd[4]
                if how == "allocate":
                    r = engine.allocate(size, name=name, access=access)
                    buffers[name] = r.view
                else:
                    buf = bytearray(size)
                    r = engine.register(buf, name=name, access=access)
                    buffers[name] = buf
                regions[name] = r
                res: object = {"ok": True}
            elif cmd[0] == "unregister":
                t0 = time.monotonic()
                engine.unregister(regions.pop(cmd[1]), timeout=30)
                res = {"ok": True, "s": time.monotonic() - t0}
            elif cmd[0] == "free":
                buffers.pop(cmd[1], None)
                gc.collect()
                res = {"ok": True}
            elif cmd[0] == "count":
                res = {"n": bytes(buffers[cmd[1]]).count(int(cmd[2]))}
            elif cmd[0] == "fill":
                b = buffers[cmd[1]]
                b[:] = bytes([int(cmd[2])]) * len(b)
                res = {"ok": True}
            elif cmd[0] == "open":
                remotes[cmd[2]] = engine.open(cmd[1], cmd[2], timeout=10)
                res = {"ok": True}
            elif cmd[0] == "write":
                name, off, ln, byte = cmd[1], int(cmd[2]), int(cmd[3]), int(cmd[4])
                try:
                    engine.write(bytes([byte]) * ln, remotes[name], off, ln, timeout=5).result(10)
                    res = {"ok": True}
                except mpcomm.MpcommError as exc:
                    res = {"failed": type(exc).__name__}
            elif cmd[0] == "ping":
                res = {"ok": True}
            elif cmd[0] == "quit":
                break
            else:
                res = {"error": f"unknown command {cmd[0]}"}
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            res = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(res) + "\n")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
