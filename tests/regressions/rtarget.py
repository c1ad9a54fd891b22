"""A target engine in its own process for the request-path regression tests.

``python rtarget.py SPEC`` where SPEC is JSON ``{"transports": [...], "config": {...}}``.
It prints ``{"address": ..., "pid": ..., "node_id": ...}`` and then answers one
JSON request per stdin line: ``{"exec": CODE}`` runs Python statements,
``{"eval": EXPR}`` returns the expression's value (JSON), both in one namespace
holding ``engine``, ``mpcomm``, ``sha`` (hex sha256 of a buffer) and whatever
earlier statements bound. Replies are ``{"ok": value}`` or ``{"error": "Type: msg"}``.

The parent test drives the real engine of this process through that pipe (the
code comes from the test itself, never from a peer), so each regression can
set up exactly the target-side sequence it needs: registering twice under one
name, unregistering while keeping the memory to hash it afterwards, counting
registrations, reading its own RSS.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import traceback
from typing import Any


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import mpcomm

    engine = mpcomm.Engine(spec.get("config") or None, endpoint="127.0.0.1:0", transports=spec["transports"],
                           autoload=True)
    ns: dict[str, Any] = {"engine": engine, "mpcomm": mpcomm, "os": os,
                          "sha": lambda b: hashlib.sha256(b).hexdigest()}
    out.write(json.dumps({"address": engine.address, "pid": os.getpid(), "node_id": engine.node_id}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if "exec" in req:
                exec(req["exec"], ns)  # noqa: S102 - code from the parent test over a private pipe
                reply: dict[str, Any] = {"ok": None}
            elif "eval" in req:
                reply = {"ok": eval(req["eval"], ns)}  # noqa: S307 - as above
            elif req.get("quit"):
                break
            else:
                reply = {"error": "ValueError: unknown request"}
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            reply = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=4)}
        out.write(json.dumps(reply, default=repr) + "\n")
    engine.close(timeout=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
