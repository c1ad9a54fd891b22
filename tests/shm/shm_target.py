"""A target process for the shm tests: ``python shm_target.py SPEC``.

SPEC is JSON ``{"config": {...}, "regions": {"name": [size, "allocate"|"buffer"|"allocate-r"|"buffer-r"]},
"drop_uid": false}`` (``-r``: registered read-only).
Prints ``{"address", "pid", "node_id"}`` on one line, then answers one command
per stdin line:

* ``sha NAME OFF LEN`` → hex sha256 of the range;
* ``fill NAME SEED`` → fills the region with numpy random bytes from SEED; ``ok``;
* ``unregister NAME`` → ``ok`` or ``error <message>``;
* ``notes`` → JSON list of notifications, each with ``in_place`` (the data
  the note describes was already there when it arrived);
* ``raw NAME OFF LEN`` → hex sha256 of a ``buffer`` region's bytearray, also
  after the region was unregistered (what a late write would change);
* ``ids`` → JSON ``{name: region id}``;
* ``hold`` → forks a child that keeps every fd of this process open (control
  sockets included) and sleeps; prints its pid. Killing this process then
  leaves its connections up: nothing but the pid's death tells a peer;
* ``quit``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time


def main() -> int:
    spec = json.loads(sys.argv[1])
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import numpy as np

    import mpcomm

    engine = mpcomm.Engine(spec.get("config") or None, transports=spec.get("transports", ["shm", "tcp"]))
    regions = {}
    raw = {}
    for name, (size, how) in spec.get("regions", {}).items():
        if how == "allocate":
            regions[name] = engine.allocate(size, name=name)
        elif how == "allocate-r":  # engine memory (memfd) that peers may only read
            regions[name] = engine.allocate(size, name=name, access="r")
        elif how == "buffer-r":  # a plain buffer that peers may only read
            raw[name] = bytearray(size)
            regions[name] = engine.register(raw[name], name=name, access="r")
        else:
            raw[name] = bytearray(size)
            regions[name] = engine.register(raw[name], name=name)
    notes = []

    def on_note(note):
        d = json.loads(note.data)
        view = regions[note.region].view[d["off"] : d["off"] + d["len"]]
        notes.append({"region": note.region, "in_place": hashlib.sha256(view).hexdigest() == d["sha"]})

    engine.on_notification(on_note)
    out.write(json.dumps({"address": engine.address, "pid": os.getpid(), "node_id": engine.node_id}) + "\n")
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "sha":
            name, off, ln = args[0], int(args[1]), int(args[2])
            out.write(hashlib.sha256(regions[name].view[off : off + ln]).hexdigest() + "\n")
        elif cmd == "fill":
            view = regions[args[0]].view
            data = np.random.default_rng(int(args[1])).integers(0, 256, len(view), dtype=np.uint8)
            np.frombuffer(view, dtype=np.uint8)[:] = data
            out.write("ok\n")
        elif cmd == "unregister":
            try:
                engine.unregister(regions[args[0]], timeout=5)
                out.write("ok\n")
            except mpcomm.MpcommError as exc:
                out.write(f"error {exc}\n")
        elif cmd == "raw":
            name, off, ln = args[0], int(args[1]), int(args[2])
            out.write(hashlib.sha256(raw[name][off : off + ln]).hexdigest() + "\n")
        elif cmd == "ids":
            out.write(json.dumps({name: r.id for name, r in regions.items()}) + "\n")
        elif cmd == "hold":
            pid = os.fork()
            if pid == 0:  # only this thread exists here: sleep, touch nothing
                time.sleep(120)
                os._exit(0)
            out.write(f"{pid}\n")
        elif cmd == "notes":
            # Natively delivered notifications run their callbacks after the sender's ack
            # (docs/tcp.md): let the ones already accepted run first.
            until = time.monotonic() + 10
            while engine.stats()["notifications_awaiting_callbacks"] and time.monotonic() < until:
                time.sleep(0.001)
            out.write(json.dumps(notes) + "\n")
        elif cmd == "quit":
            break
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
