"""A target engine in its own process with CUDA and pinned-host regions (tests/device, benchmarks).

    python device_target.py TRANSPORT SIZE

Prints one JSON line: {"dev": descriptor, "host": descriptor}; then answers one
line per command read from stdin:

    sha NAME OFF LEN     sha256 of the bytes (copied to the CPU)
    sum OFF LEN          sum of dev[OFF:OFF+LEN] as int64, computed by a kernel on
                         torch's current stream right away (no synchronize first)
    fill NAME BYTE       set every byte, synchronize, "ok"
    unregister NAME      Engine.unregister, "ok"
    quit

CUDA IPC cannot map memory into the process that owns it: a separate process
is what the transports' device paths are for.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

import mpcomm


def main() -> None:
    transport, size = sys.argv[1], int(sys.argv[2])
    engine = mpcomm.Engine(transports=[transport], endpoint="127.0.0.1:0")
    tensors = {"dev": torch.zeros(size, dtype=torch.uint8, device="cuda"),
               "host": torch.zeros(size, dtype=torch.uint8).pin_memory()}
    torch.cuda.synchronize()
    regions = {n: engine.register(t, n) for n, t in tensors.items()}
    print(json.dumps({n: json.loads(engine.describe(r).to_bytes()) for n, r in regions.items()}), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "sha":
            t = tensors[args[0]][int(args[1]) : int(args[1]) + int(args[2])]
            out = hashlib.sha256(t.cpu().numpy().tobytes()).hexdigest()
        elif cmd == "sum":
            part = tensors["dev"][int(args[0]) : int(args[0]) + int(args[1])]
            out = str(int(part.to(torch.int64).sum().item()))
        elif cmd == "fill":
            tensors[args[0]].fill_(int(args[1]))
            torch.cuda.synchronize()
            out = "ok"
        elif cmd == "unregister":
            engine.unregister(regions[args[0]])
            out = "ok"
        else:
            break
        print(out, flush=True)
    engine.close()


if __name__ == "__main__":
    main()
