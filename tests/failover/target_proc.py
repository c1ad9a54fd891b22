"""A target engine in its own process that counts the handshakes it answers.

Usage: target_proc.py ENDPOINT COUNTS_FILE [CONFIG_JSON]. Allocates region
"kv" (8 MiB), prints one JSON line ({"address", "epoch", "node_id"}), then
serves until stdin closes or it is killed. After every successful control
handshake it rewrites COUNTS_FILE (atomically) with {initiator node_id: n}.

The count is taken by wrapping ``ControlServer._handshake`` in this process
only: it observes the real server, it changes nothing of what it does.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import mpcomm
from mpcomm.control import ControlServer


def main() -> None:
    endpoint, counts_file = sys.argv[1], sys.argv[2]
    cfg = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    counts: dict[str, int] = {}
    lock = threading.Lock()
    real = ControlServer._handshake

    def counting(self: ControlServer, c: object) -> object:
        peer = real(self, c)
        with lock:
            counts[peer.node_id] = counts.get(peer.node_id, 0) + 1
            tmp = f"{counts_file}.tmp"
            with open(tmp, "w") as f:
                json.dump(counts, f)
            os.replace(tmp, counts_file)
        return peer

    ControlServer._handshake = counting  # type: ignore[method-assign]
    with mpcomm.Engine(cfg, endpoint=endpoint) as engine:
        engine.allocate(8 << 20, "kv")
        print(json.dumps({"address": engine.address, "epoch": engine.epoch, "node_id": engine.node_id}), flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
