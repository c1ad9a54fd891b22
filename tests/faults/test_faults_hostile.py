"""Generated hostile input: against a serving engine in another process, and as config files.

Hypothesis builds control frames (raw bytes, frames with forged headers, and
JSON messages of every shape, sent before authentication, in place of the
hello, or as requests) and forged region descriptors. The property: the
target survives every one of them, keeps answering a good peer that stays
connected throughout, and a forged descriptor never writes outside what the
target registered — a write the target accepted is exactly where it says.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from core_support import Target
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rawpeer import RawPeer, fake_info

import mpcomm
from mpcomm import wire
from mpcomm.control import PeerLink
from mpcomm.peer import PeerInfo, parse_endpoint
from mpcomm.testing.patterns import pattern

REGION = 64 << 10
FILL = 77


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    t = Target({"kv": [REGION, "buffer"], "ro": [4096, "readonly"]})
    yield t
    t.close()


@pytest.fixture(scope="module")
def keeper(target: Target) -> Iterator[PeerLink]:
    """A good peer, connected before the attacks start and expected to be served throughout."""
    link = PeerLink(target.address, local_info=PeerInfo.from_dict(fake_info()), secret="", timeout=5,
                    on_lost=lambda _l: None)
    yield link
    link.close()


def still_served(target: Target, keeper: PeerLink) -> None:
    assert target.alive, "the target process died"
    assert keeper.request({"t": "ping"}, 5)["t"] == "pong"


# -- strategies ------------------------------------------------------------------------------

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=24))
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(
    st.text(max_size=8), c, max_size=4), max_leaves=16)
ids = st.one_of(st.integers(-5, 2**64), st.text(max_size=4), st.none(), st.booleans(), st.lists(st.integers(), max_size=2))
infos = st.one_of(
    st.builds(fake_info),
    st.fixed_dictionaries({}, optional={"node_id": json_values, "epoch": json_values, "address": json_values,
                                        "host": json_values, "transports": json_values, "protocol": json_values}),
    json_values,
)
messages = st.fixed_dictionaries(
    {"t": st.sampled_from(["hello", "lookup", "notify", "transport", "ping", "keepalive", "welcome", "error",
                           "region", "", "x" * 40])},
    optional={
        "id": ids, "proto": st.one_of(st.just(1), json_values), "info": infos,
        "name": st.one_of(st.sampled_from(["kv", "ro", "tcp", "shm", "nope"]), json_values),
        "region": st.one_of(st.just("kv"), json_values),
        "data": st.one_of(st.binary(max_size=64).map(bytes.hex), st.text(max_size=16), json_values),
        "body": st.one_of(json_values, st.dictionaries(st.sampled_from(["t", "op", "region_id", "offset", "length",
                                                                        "name", "token", "epoch"]),
                                                       json_values, max_size=5)),
        "self": st.one_of(st.text(max_size=64), json_values),
    },
)


def _frame(magic: bytes, version: int, ftype: int, flags: int, declared: int | None, payload: bytes) -> bytes:
    length = len(payload) if declared is None else declared
    return wire.HEADER.pack(magic, version, ftype, flags, 0, length) + payload


frames = st.one_of(
    st.binary(min_size=1, max_size=200),
    messages.map(lambda m: wire.encode_json(m)),
    st.builds(_frame, st.sampled_from([b"MC", b"MA", b"MD", b"\x00\x00"]), st.integers(0, 3), st.integers(0, 5),
              st.integers(0, 0xFFFF), st.one_of(st.none(), st.integers(0, 2**32 - 1)), st.binary(max_size=80)),
)


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(stage=st.sampled_from(["pre-auth", "hello", "request"]), payload=st.lists(frames, min_size=1, max_size=4))
def test_generated_control_frames_never_hurt_the_target(target: Target, keeper: PeerLink, stage: str,
                                                         payload: list[bytes]) -> None:
    with RawPeer(target.address) as p:
        if stage != "pre-auth":
            p.authenticate()
        if stage == "request":
            assert p.hello()["t"] == "welcome"
        try:
            for chunk in payload:
                p.sock.sendall(chunk)
            p.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the target hung up on us: allowed
        # Whatever comes back is framed; the target closes within its frame/handshake deadline.
        p.sock.settimeout(0.5)
        try:
            while p.sock.recv(65536):
                pass
        except (OSError, TimeoutError):
            pass
    still_served(target, keeper)


# -- forged descriptors --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def initiator() -> Iterator[mpcomm.Engine]:
    with mpcomm.Engine({"runtime": {"abort_grace_ms": 500}}, transports=["tcp"]) as e:
        yield e


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_forged_descriptors_never_write_outside_the_registered_region(
        target: Target, keeper: PeerLink, initiator: mpcomm.Engine, data: Any) -> None:
    real = initiator.open(target.address, data.draw(st.sampled_from(["kv", "ro"]), label="region"))
    d = real.to_dict()
    forged = dict(d)
    for key, strat in {
        "region_id": st.one_of(st.just(d["region_id"]), st.integers(0, 2**64 - 1)),
        "token": st.one_of(st.just(d["token"]), st.integers(0, 2**63 - 1), st.just(d["token"] ^ 1)),
        "epoch": st.one_of(st.just(d["epoch"]), st.binary(min_size=8, max_size=8).map(bytes.hex)),
        "size": st.one_of(st.just(d["size"]), st.integers(1, 4 * REGION)),
        "access": st.sampled_from(["rw", "r", "w", d["access"]]),
        "base_address": st.one_of(st.just(d["base_address"]), st.integers(0, 2**64 - 1)),
    }.items():
        if data.draw(st.booleans(), label=f"forge {key}"):
            forged[key] = data.draw(strat, label=key)
    remote = mpcomm.RemoteRegion.from_dict(forged)
    offset = data.draw(st.integers(0, 2 * REGION), label="offset")
    length = data.draw(st.integers(1, 8192), label="length")
    if real.name == "kv":
        target.cmd(f"fill kv {FILL}")
    background = pattern(FILL, real.size) if real.name == "kv" else bytes(real.size)  # ro is zeros
    before = target.cmd(f"sha {real.name} 0 {real.size}")
    payload = pattern(offset + length, length)
    start = time.monotonic()
    try:
        initiator.write(payload, remote, offset, length, timeout=2).result(10)
        accepted = True
    except mpcomm.MpcommError:
        accepted = False
    assert time.monotonic() - start < 2 + 0.5 + 3, "a forged request outlived its deadline"
    if accepted:
        # Only a descriptor the target itself would issue, in bounds of what it registered, may write.
        assert (forged["region_id"], forged["token"], forged["epoch"]) == (d["region_id"], d["token"], d["epoch"])
        assert "w" in d["access"] and offset + length <= d["size"], (forged, offset, length)
        expected = bytearray(background)
        expected[offset : offset + length] = payload
        assert target.cmd(f"sha {real.name} 0 {real.size}") == hashlib.sha256(expected).hexdigest()
    else:
        assert target.cmd(f"sha {real.name} 0 {real.size}") == before, "a refused write changed the region"
    still_served(target, keeper)


def test_connection_flood_then_a_good_peer(target: Target, keeper: PeerLink) -> None:
    """200 silent connections from one peer (127.0.0.2): other peers (127.0.0.1) are still served.

    The first limits.max_connections_per_peer hold handshake slots until the
    handshake deadline cuts them; the rest are closed at accept.
    """
    base = resources(target.pid)
    socks = []
    for _ in range(200):
        try:
            socks.append(socket.create_connection(parse_endpoint(target.address), timeout=5,
                                                  source_address=("127.0.0.2", 0)))
        except OSError:
            break
    try:
        still_served(target, keeper)
        with mpcomm.Engine(transports=["tcp"]) as e:
            e.write(b"ok", e.open(target.address, "kv", timeout=10)).result(10)
    finally:
        for s in socks:
            s.close()
    assert len(socks) >= 64
    # Threads and descriptors go back to where they were once the flood is gone.
    deadline = time.monotonic() + 10
    while (now := resources(target.pid)) != base:
        assert time.monotonic() < deadline, f"target did not return to baseline: {base} -> {now}"
        time.sleep(0.1)


def resources(pid: int) -> tuple[int, int]:
    """(threads, open descriptors) of process ``pid``."""
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


# -- config files -------------------------------------------------------------------------------

_SECTION_KEYS = {
    "transport": ["name", "order", "mode", "endpoint", "advertise", "secret", "handshake_timeout_ms", "tls", "bogus"],
    "memory": ["types", "registration", "alignment"],
    "runtime": ["worker_threads", "queue_depth", "request_timeout_ms", "backpressure", "abort_grace_ms"],
    "limits": list(mpcomm.Config().limits.__dataclass_fields__),
    "tls": ["cert", "key", "ca", "require_client_cert", "check_hostname"],
    "observability": ["metrics", "trace_transfers"],
    "bogus": ["x"],
}
config_values = st.one_of(
    st.integers(-(2**64), 2**64), st.sampled_from([0, 1, -1, 2**63 - 1, 2**31]), st.booleans(),
    st.floats(allow_nan=True), st.text(max_size=40), st.lists(st.text(max_size=8), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
configs = st.dictionaries(
    st.sampled_from(sorted(_SECTION_KEYS)),
    st.just(None), max_size=4,
).flatmap(lambda secs: st.fixed_dictionaries({
    s: st.dictionaries(st.sampled_from(_SECTION_KEYS[s]), config_values, max_size=4) for s in secs}))


@settings(max_examples=300, deadline=None, database=None)
@given(cfg=configs)
def test_generated_configs_are_accepted_in_range_or_refused_with_config_error(cfg: dict[str, Any]) -> None:
    try:
        c = mpcomm.Config.from_dict(cfg)
    except mpcomm.ConfigError as exc:
        assert str(exc).startswith("<dict>: "), exc  # names the source, and the key after it
        return
    from mpcomm.config import RANGES

    for (section, key), (lo, hi) in RANGES.items():
        assert lo <= getattr(getattr(c, section), key) <= hi


@settings(max_examples=200, deadline=None, database=None)
@given(text=st.text(max_size=200))
def test_generated_toml_text_never_escapes_as_anything_but_config_error(text: str, tmp_path_factory: Any) -> None:
    p = tmp_path_factory.mktemp("cfg") / "mpcomm.toml"
    p.write_bytes(text.encode("utf-8", "surrogatepass"))  # invalid UTF-8 included
    try:
        mpcomm.Config.load(p)
    except mpcomm.ConfigError:
        pass
