"""Issue 30, item 1: a member that dials an impostor cannot be used to log the impostor in elsewhere.

Three real processes: the target (a secret, a region ``kv``), a member with
the same secret that dials the attacker's address, and the attacker, which
relays the target's challenge to the member and the member's proof to the
target (tests/core/relay_attacker.py). Proofs are bound to the address the
member dialled (and to the target's identity), so the target refuses the
relayed proof, the attacker never gets a session, and the member is told.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from core_support import Target

SECRET = "4b1d9e2f7a3c5e8061d2c3b4a5968778"

MEMBER = textwrap.dedent("""
    import sys, mpcomm
    with mpcomm.Engine(transports=["tcp"], secret=sys.argv[2]) as e:
        try:
            e.open(sys.argv[1], "kv", timeout=5)
            print("opened")
        except mpcomm.MpcommError as exc:
            print(type(exc).__name__, exc)
""")


def test_a_relayed_proof_is_refused_by_the_target() -> None:
    target = Target({"kv": [4096, "buffer"]}, config={"transport": {"secret": SECRET}})
    attacker = subprocess.Popen([sys.executable, str(Path(__file__).with_name("relay_attacker.py")), target.address],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert attacker.stdout is not None
        lure = attacker.stdout.readline().strip()
        member = subprocess.run([sys.executable, "-c", MEMBER, lure, SECRET], capture_output=True, text=True,
                                timeout=60)
        out, _ = attacker.communicate(timeout=30)
        got: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        assert got["relayed"], got  # the attack really ran: the proof reached the target
        assert not got["authenticated"], f"the target accepted a relayed proof: {got}"
        assert "welcome" not in got and "lookup" not in got
        assert target.cmd("notes") == "[]"  # nothing the attacker sent was served
        # The member learns it did not reach the node it dialled.
        assert member.stdout.startswith("AuthenticationError"), member.stdout + member.stderr
        # The target still serves its real members directly.
        with __import__("mpcomm").Engine(transports=["tcp"], secret=SECRET) as e:
            e.write(b"ok", e.open(target.address, "kv", timeout=5)).result(5)
    finally:
        attacker.kill()
        attacker.wait()
        target.close()


def test_an_undeclared_proxy_is_refused_and_a_declared_one_works(make_engine: Any) -> None:
    """A proxy is a relay too: with a secret it works only once the target says it is reachable there."""
    from core_support import RecordingProxy

    import mpcomm
    from mpcomm.peer import parse_endpoint

    proxy = RecordingProxy(("127.0.0.1", 1))
    try:
        plain = make_engine(secret=SECRET)
        proxy.upstream = parse_endpoint(plain.address)
        plain.register(bytearray(64), name="kv")
        member = make_engine(secret=SECRET)
        try:
            member.open(proxy.address, "kv", timeout=5)
            raise AssertionError("opened through an undeclared proxy")
        except mpcomm.AuthenticationError as exc:
            assert "reachable_at" in str(exc) and proxy.address in str(exc)
        declared = make_engine({"transport": {"reachable_at": [proxy.address]}}, secret=SECRET)
        declared.register(bytearray(64), name="kv")
        proxy.upstream = parse_endpoint(declared.address)
        member.open(proxy.address, "kv", timeout=5)
    finally:
        proxy.close()


def test_the_welcome_must_be_the_identity_the_servers_proof_covered() -> None:
    """A server (holding the secret) whose welcome names another node than its challenge did is refused."""
    import socket
    import threading
    import time

    import pytest

    import mpcomm
    from mpcomm import auth, wire
    from mpcomm.control import CONTROL_CONTEXT, PeerLink
    from mpcomm.peer import PeerInfo

    lsock = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = lsock.accept()
        with conn:
            auth.server_exchange(conn, SECRET, time.monotonic() + 5, CONTROL_CONTEXT,
                                 identity=auth.identity_digest("node-a", "epoch-a"))
            wire.read_json(conn)  # the hello
            other = {"node_id": "node-b", "epoch": "epoch-b", "address": "127.0.0.1:1", "host": {},
                     "transports": {}, "protocol": 1}
            wire.send_json(conn, {"t": "welcome", "info": other, "idle_ms": 60000})
            time.sleep(0.5)

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    me = PeerInfo(node_id="me", epoch="e" * 16, address="127.0.0.1:1", host={}, transports={})
    try:
        with pytest.raises(mpcomm.AuthenticationError, match="not the identity its proof was bound to"):
            PeerLink(f"127.0.0.1:{lsock.getsockname()[1]}", local_info=me, secret=SECRET, timeout=5,
                     on_lost=lambda link: None)
    finally:
        th.join(5)
        lsock.close()
