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
* ``stats`` → JSON of ``engine.stats()``;
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
import time
from collections.abc import Callable, Iterable
from typing import IO, Any

from mpcomm.testing.patterns import pattern


def serve_commands(handlers: dict[str, Callable[..., str]], out: IO[str], lines: Iterable[str] | None = None) -> None:
    """Answer one command per line with one line until ``quit`` or the end of ``lines`` (stdin).

    ``handlers[word](*args)`` returns the answer for ``word args...``. An
    unknown word, or any exception a handler raises, is answered ``error
    Class: message`` on one line and the loop goes on: a target under test
    never dies of a bad command. Shared by the kit's target and richer targets
    built on it (the fault suite's host).
    """
    for line in sys.stdin if lines is None else lines:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "quit":
            return
        fn = handlers.get(cmd[0])
        if fn is None:
            out.write(f"error unknown command {cmd[0]}\n")
            continue
        try:
            answer = fn(*cmd[1:])
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            answer = f"error {type(exc).__name__}: {str(exc).replace(chr(10), ' ')}"
        out.write(answer + "\n")


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
        entry: dict[str, Any] = {"peer": note.peer, "region": note.region,
                                 "data": note.data.decode(errors="replace")}
        try:
            d = json.loads(note.data)
            view = regions[note.region].view[d["off"] : d["off"] + d["len"]]
            entry["data_in_place"] = hashlib.sha256(view).hexdigest() == d["sha"]
        except (ValueError, KeyError, TypeError):
            pass
        notes.append(entry)

    engine.on_notification(on_note)
    out.write(json.dumps({"address": engine.address, "pid": os.getpid(), "node_id": engine.node_id}) + "\n")

    def sha(name: str, off: str, ln: str) -> str:
        view = regions[name].view if name in regions else memoryview(memory[name])
        return hashlib.sha256(view[int(off) : int(off) + int(ln)]).hexdigest()

    def fill(name: str, seed: str) -> str:
        r = regions[name]
        r.view[:] = pattern(int(seed), r.size)
        return "ok"

    def zero(name: str) -> str:
        r = regions[name]
        r.view[:] = bytes(r.size)
        return "ok"

    def unregister(name: str) -> str:
        engine.unregister(regions[name])  # refused (RegionBusyError): it stays reachable
        regions.pop(name)
        return "ok"

    def register(name: str) -> str:
        if name in regions:
            raise ValueError(f"region {name!r} is still registered")
        regions[name] = engine.register(memory[name], name=name)
        return "ok"

    def settled_notes() -> str:
        # Natively delivered notifications run their callbacks after the sender's ack
        # (docs/tcp.md): let the ones already accepted run first.
        until = time.monotonic() + 10
        while engine.stats()["notifications_awaiting_callbacks"] and time.monotonic() < until:
            time.sleep(0.001)
        return json.dumps(notes)

    def stats() -> str:
        return json.dumps(engine.stats(), default=str)

    serve_commands({"sha": sha, "fill": fill, "zero": zero, "notes": settled_notes, "stats": stats,
                    "unregister": unregister, "register": register}, out)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
