"""A hostile third process: ``python shm_hostile.py ACTION VICTIM TARGET REGION_ID TOKEN``.

It speaks mpcomm's control protocol with a forged identity (node id, epoch,
address and host copied from the handshake of the peer it impersonates) and
prints one JSON line with what it got back:

* ``revoke``: impersonates TARGET towards VICTIM and asks it to drop its
  mapping of region REGION_ID — without keys, with guessed keys, and with a
  key it obtained by attaching to the region itself;
* ``attach``: impersonates VICTIM towards TARGET and attaches to region
  REGION_ID (it holds a leaked descriptor's token), hoping to replace the
  victim's attachment so that the target's revocation misses the victim;
* ``map_rw``: a member holding REGION_ID's token attaches, fetches the
  region's memfd and tries to write through it: a writable shared mapping,
  ``pwrite``, and a writable mapping of the descriptor reopened read-write
  through ``/proc/self/fd`` (VICTIM is unused).
"""

from __future__ import annotations

import json
import secrets
import sys

from mpcomm.control import PeerLink
from mpcomm.errors import MpcommError
from mpcomm.peer import PeerInfo, host_identity


def _link(address: str, me: PeerInfo) -> PeerLink:
    return PeerLink(address, local_info=me, secret="", timeout=5, on_lost=lambda link: None)


def _ask(link: PeerLink, body: dict) -> str:
    try:
        return json.dumps(link.request({"t": "transport", "name": "shm", "body": body}, 5)["body"])
    except MpcommError as exc:
        return f"error {type(exc).__name__}: {exc}"


def main() -> int:
    action, victim, target, rid, token = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    me = PeerInfo(node_id=secrets.token_hex(8), epoch=secrets.token_hex(8), address="127.0.0.1:1",
                  host=host_identity(), transports={})
    out: dict[str, str] = {}
    if action == "revoke":
        t_link = _link(target, me)
        t_info = t_link.info
        # A real grant of our own, to try its key against the victim's mapping.
        own = json.loads(_ask(t_link, {"op": "attach", "region_id": rid, "token": token, "epoch": t_info.epoch}))
        t_link.close()
        forged = PeerInfo(node_id=t_info.node_id, epoch=t_info.epoch, address=t_info.address, host=t_info.host,
                          transports=t_info.transports)
        v = _link(victim, forged)
        out["no_keys"] = _ask(v, {"op": "revoke", "region_id": rid})
        out["guessed"] = _ask(v, {"op": "revoke", "region_id": rid,
                                  "keys": [secrets.token_hex(16) for _ in range(64)]})
        out["own_key"] = _ask(v, {"op": "revoke", "region_id": rid, "keys": [own.get("revoke_key", "")]})
        out["garbage"] = _ask(v, {"op": "revoke", "region_id": "x", "keys": [{"a": 1}]})
        v.close()
    elif action == "attach":
        probe = _link(victim, me)
        v_info = probe.info
        probe.close()
        # The victim's identity, with its own address and with a dead one (so a
        # target that keeps one attachment per node id would revoke nobody).
        for i, address in enumerate((v_info.address, "127.0.0.1:1")):
            forged = PeerInfo(node_id=v_info.node_id, epoch=v_info.epoch, address=address, host=v_info.host,
                              transports=v_info.transports)
            t = _link(target, forged)
            out[f"attach{i}"] = _ask(t, {"op": "attach", "region_id": rid, "token": token, "epoch": t.info.epoch})
            t.close()
    elif action == "map_rw":
        out.update(_map_rw(target, me, rid, token))
    print(json.dumps(out), flush=True)
    return 0


def _try(fn) -> str:  # type: ignore[no-untyped-def]
    try:
        fn()
        return "ok"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror} (errno {exc.errno})"


def _map_rw(target: str, me: PeerInfo, rid: int, token: int) -> dict[str, str]:
    """A member that holds the token fetches the region's memfd and tries to write through it."""
    import mmap
    import os
    import socket

    link = _link(target, me)
    grant = json.loads(_ask(link, {"op": "attach", "region_id": rid, "token": token, "epoch": link.info.epoch}))
    name = link.info.transports["shm"]["socket"]
    link.close()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect("\0" + name)
        s.sendall(json.dumps({"region_id": rid, "token": token, "nonce": grant["nonce"]}).encode())
        msg, fds, _, _ = socket.recv_fds(s, 4096, 1)
    fd = fds[0]
    total = json.loads(msg)["total"]
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    out = {"grant": grant["access"],
           "fd_mode": "O_RDWR" if os.O_RDWR & __import__("fcntl").fcntl(fd, __import__("fcntl").F_GETFL) else "O_RDONLY",
           "map_shared_write": _try(lambda: mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=rw)[:1]),
           "pwrite": _try(lambda: os.pwrite(fd, b"\xee", 0))}

    def reopened() -> None:
        again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            mmap.mmap(again, total, flags=mmap.MAP_SHARED, prot=rw)[0] = 0xEE
        finally:
            os.close(again)

    out["reopen_rw_map_shared_write"] = _try(reopened)
    out["map_shared_read"] = _try(lambda: mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)[:1])
    os.close(fd)
    return out


if __name__ == "__main__":
    sys.exit(main())
