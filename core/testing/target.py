"""The conformance kit's target process: ``python -m mpcomm.testing.target SPEC``.

SPEC is JSON: ``{"transport": name, "plugins": ["module", ...], "config": {...},
"endpoint": "127.0.0.1:0", "regions": {"name": [size, how]}}`` where ``how`` is
``"allocate"`` (Engine.allocate), ``"buffer"`` (a registered bytearray) or
``"readonly"`` (registered read-only bytes, zero-filled).

It prints one JSON line ``{"address": ..., "pid": ...}`` on stdout, then
answers one command per stdin line with one stdout line:

* ``sha NAME OFFSET LENGTH`` → hex sha256 of that range;
* ``fill NAME SEED`` → fills the region with ``pattern(SEED)``; ``ok``;
* ``zero NAME`` → zero-fills; ``ok``;
* ``notes`` → JSON list of notifications received so far (with a check of
  the data they follow);
* ``unregister NAME`` → ``ok`` or the error; a ``"buffer"`` region's memory is
  kept, so ``sha NAME ...`` still hashes it (revocation checks: nothing may land there);
* ``register NAME`` → registers a new region named NAME over the memory kept by
  ``unregister NAME``; ``ok``;
* ``quit``.

Notifications whose payload is JSON ``{"off":, "len":, "sha":}`` are checked
on arrival: the kit asserts the data was already in place.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
from typing import Any

from mpcomm.testing.patterns import pattern


def main(argv: list[str]) -> int:
    spec: dict[str, Any] = json.loads(argv[1])
    # The kit owns stdout; anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import mpcomm

    plugins = [importlib.import_module(m) for m in spec.get("plugins", [])]
    engine = mpcomm.Engine(
        spec.get("config") or None,
        endpoint=spec.get("endpoint", "127.0.0.1:0"),
        transports=[spec["transport"]],
        plugins=plugins,
        autoload=spec.get("autoload"),
    )
    regions: dict[str, Any] = {}
    # The memory behind "buffer" regions: kept after unregister to hash it (nothing may land there).
    memory: dict[str, bytearray] = {}
    for name, (size, how) in spec.get("regions", {}).items():
        if how == "allocate":
            regions[name] = engine.allocate(size, name=name)
        elif how == "readonly":
            regions[name] = engine.register(bytes(size), name=name)
        else:
            memory[name] = bytearray(size)
            regions[name] = engine.register(memory[name], name=name)
    notes: list[dict[str, Any]] = []

    def on_note(note: Any) -> None:
        entry: dict[str, Any] = {"region": note.region, "data": note.data.decode(errors="replace")}
        try:
            d = json.loads(note.data)
            view = regions[note.region].view[d["off"] : d["off"] + d["len"]]
            entry["data_in_place"] = hashlib.sha256(view).hexdigest() == d["sha"]
        except (ValueError, KeyError, TypeError):
            pass
        notes.append(entry)

    engine.on_notification(on_note)
    out.write(json.dumps({"address": engine.address, "pid": os.getpid(), "node_id": engine.node_id}) + "\n")
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        try:
            if cmd[0] == "sha":
                view = regions[cmd[1]].view if cmd[1] in regions else memoryview(memory[cmd[1]])
                off, ln = int(cmd[2]), int(cmd[3])
                out.write(hashlib.sha256(view[off : off + ln]).hexdigest() + "\n")
            elif cmd[0] == "fill":
                r = regions[cmd[1]]
                r.view[:] = pattern(int(cmd[2]), r.size)
                out.write("ok\n")
            elif cmd[0] == "zero":
                r = regions[cmd[1]]
                r.view[:] = bytes(r.size)
                out.write("ok\n")
            elif cmd[0] == "notes":
                out.write(json.dumps(notes) + "\n")
            elif cmd[0] == "unregister":
                engine.unregister(regions[cmd[1]])  # refused (RegionBusyError): it stays reachable
                regions.pop(cmd[1])
                out.write("ok\n")
            elif cmd[0] == "register":
                if cmd[1] in regions:
                    raise ValueError(f"region {cmd[1]!r} is still registered")
                regions[cmd[1]] = engine.register(memory[cmd[1]], name=cmd[1])
                out.write("ok\n")
            elif cmd[0] == "quit":
                break
            else:
                out.write(f"error unknown command {cmd[0]}\n")
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            out.write(f"error {type(exc).__name__}: {exc}\n")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
