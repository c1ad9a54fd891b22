"""An engine in its own process that publishes one region to etcd.

Usage: engine_proc.py METADATA_URL REGION SIZE TTL [ENDPOINT]. Prints one JSON line
({"address", "token", "node_id"}) once the region is published, then serves
until stdin closes (or it is killed).
"""

from __future__ import annotations

import json
import sys

import mpcomm


def main() -> None:
    url, name, size, ttl = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    endpoint = sys.argv[5] if len(sys.argv) > 5 else None
    with mpcomm.Engine({"cluster": {"metadata": url, "lease_ttl_s": ttl}}, endpoint=endpoint) as engine:
        region = engine.allocate(size, name)
        for i in range(size):
            region.view[i] = i % 251
        print(json.dumps({"address": engine.address, "token": region.token, "node_id": engine.node_id}), flush=True)
        sys.stdin.read()


if __name__ == "__main__":
    main()
