"""Generated hostile input for the tcp data port and for descriptors, plus bounded atheris runs.

tcp data frames are built from ``support.DATA_FRAME``, a description of the
header as plugins/tcp/transport.py reads it today. The tcp plugin's wire
format is being changed: update the table (field, struct code, what a valid
value is), not the test. The property stays: the target survives, keeps
serving a good peer, and no byte changes outside the range of a frame that
named a real writable region with its real token and epoch, in bounds (a
read-only region never changes).

Descriptors (RemoteRegion JSON) come out of :meth:`RemoteRegion.from_bytes`
as a descriptor or an MpcommError, nothing else; forged descriptors used for
writes are in test_faults_hostile.py. Config files are in
test_faults_hostile.py too.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import DATA_FRAME, DATA_HEADER, DATA_MAGIC, OP_WRITE, HostProcess, outside_untouched, sha

import mpcomm
from mpcomm.peer import parse_endpoint
from mpcomm.testing.patterns import pattern
from mpcomm.wire import PROTOCOL_VERSION

KV, RO = 64 << 10, 4096
FILL, RO_FILL = 909, 910

# The tcp data frame description (support.DATA_FRAME): field, struct code, valid value. Update it
# there when the tcp wire format changes; the strategy below is built from it.
HEADER = DATA_HEADER


def _any_of(code: str) -> st.SearchStrategy[Any]:
    if code.endswith("s"):
        n = int(code[:-1] or 1)
        return st.binary(min_size=n, max_size=n)
    if code == "d":
        return st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -1.0, 1e300, math.nan])
    bits = struct.calcsize(code) * 8
    return st.integers(0, 2**bits - 1) | st.sampled_from([0, 1, 2**bits - 1, 2 ** (bits - 1)])


@pytest.fixture(scope="module")
def target() -> Iterator[HostProcess]:
    t = HostProcess("tcp", {"kv": [KV, "buffer", FILL], "ro": [RO, "readonly", RO_FILL]},
                    config={"transport": {"handshake_timeout_ms": 1000}})
    yield t
    t.close()


@pytest.fixture(scope="module")
def good(target: HostProcess) -> Iterator[tuple[mpcomm.Engine, mpcomm.RemoteRegion, mpcomm.RemoteRegion]]:
    with mpcomm.Engine(transports=["tcp"]) as e:
        yield e, e.open(target.address, "kv"), e.open(target.address, "ro")


def valid_values(kv: mpcomm.RemoteRegion, ro: mpcomm.RemoteRegion) -> dict[str, st.SearchStrategy[Any]]:
    real = st.sampled_from([kv, ro])
    return {
        "op": st.sampled_from([1, 2]),
        "region_id": real.map(lambda r: r.region_id),
        "token": real.map(lambda r: r.token),
        "epoch": st.just(int(kv.epoch, 16)),
        "offset": st.integers(0, KV),
        "length": st.integers(0, 2 * 4096),
        "deadline": st.floats(1.0, 5.0).map(lambda d: time.time() + d),
    }


@st.composite
def data_frames(draw: Any, kv: mpcomm.RemoteRegion, ro: mpcomm.RemoteRegion) -> tuple[bytes, dict[str, Any]]:
    valid = valid_values(kv, ro)
    fields: dict[str, Any] = {}
    for name, code, want in DATA_FRAME:
        good_value = valid[want] if isinstance(want, str) else st.just(want)
        fields[name] = draw(st.one_of(good_value, good_value, _any_of(code)), label=name)
    head = HEADER.pack(*fields.values())
    payload = draw(st.one_of(
        st.binary(max_size=256),
        st.integers(0, 2 * 4096).map(lambda n: pattern(n, n)),
        st.just(b"").map(lambda _: pattern(7, min(int(fields["length"]), 16384))),
    ), label="payload")
    cut = draw(st.one_of(st.none(), st.integers(0, len(head))), label="cut header at")
    frame = head[:cut] + (payload if cut is None else b"")
    return frame, fields


def may_write(fields: dict[str, Any], kv: mpcomm.RemoteRegion) -> tuple[int, int] | None:
    """The only range a frame may change: a write naming kv with its token and epoch, in bounds."""
    if fields.get("magic") != DATA_MAGIC or fields.get("op") != OP_WRITE or fields.get("version") != PROTOCOL_VERSION:
        return None
    if (fields["region_id"], fields["token"], fields["epoch"]) != (kv.region_id, kv.token, int(kv.epoch, 16)):
        return None
    if fields["offset"] + fields["length"] > KV:
        return None
    return fields["offset"], fields["length"]


@settings(max_examples=120, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
@given(data=st.data())
def test_generated_tcp_data_frames_never_hurt_the_target(target: HostProcess, good: Any, data: Any) -> None:
    e, kv, ro = good
    frames = data.draw(st.lists(data_frames(kv, ro), min_size=1, max_size=3), label="frames")
    host, _ = parse_endpoint(target.address)
    port = int(target.transport_info["tcp"]["port"])
    with socket.create_connection((host, port), timeout=5) as s:
        try:
            for frame, _ in frames:
                s.sendall(frame)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the target hung up: allowed
        s.settimeout(1.0)
        try:
            while s.recv(65536):
                pass
        except OSError:
            pass
    spans = [span for _, f in frames if (span := may_write(f, kv)) is not None]
    assert target.alive, "the target died"
    outside_untouched(target, "kv", FILL, KV, spans)
    outside_untouched(target, "ro", RO_FILL, RO, [])
    # Still serving a good peer, and the bytes it writes are exact.
    e.write(pattern(11, 4096), kv, KV - 4096, timeout=5).result(10)
    assert target.sha("kv", KV - 4096, 4096) == sha(pattern(11, 4096))
    target.cmd(f"fill kv {FILL}")


# -- descriptors -------------------------------------------------------------------------------

_REAL = {"address": "127.0.0.1:7000", "node_id": "n1", "epoch": "00ff00ff00ff00ff", "name": "kv",
         "region_id": 3, "size": 4096, "base_address": 140000000000, "access": "rw", "token": 12345,
         "kind": "host", "transports": {"tcp": {}}}
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**80), 2**80), st.floats(), st.text(max_size=30))
json_value = st.recursive(json_scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c,
                                                                                         max_size=3), max_leaves=12)
descriptor_dicts = st.builds(
    lambda drop, changes: {**{k: v for k, v in _REAL.items() if k not in drop}, **changes},
    st.sets(st.sampled_from(sorted(_REAL)), max_size=3),
    st.dictionaries(st.sampled_from([*_REAL, "regions", "extra"]), json_value, max_size=3),
)
descriptor_bytes = st.one_of(
    descriptor_dicts.map(lambda d: json.dumps(d).encode()),
    json_value.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=300),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.integers(1, 500).map(lambda n: b"[" * n + b"]" * n),  # nesting well under the recursion limit
)


@settings(max_examples=400, deadline=None, database=None)
@given(blob=descriptor_bytes)
def test_generated_descriptors_parse_or_raise_mpcomm_error(blob: bytes) -> None:
    try:
        r = mpcomm.RemoteRegion.from_bytes(blob)
    except mpcomm.MpcommError as exc:
        assert str(exc).startswith("malformed RemoteRegion descriptor"), exc
        return
    # Accepted: every field has its documented type, and it survives a round trip.
    assert isinstance(r.region_id, int) and isinstance(r.token, int) and r.size > 0 and r.base_address >= 0
    assert r.access in ("r", "w", "rw")
    parse_endpoint(r.address)
    assert mpcomm.RemoteRegion.from_bytes(r.to_bytes()) == r


def test_deeply_nested_descriptor_is_a_clear_error() -> None:
    with pytest.raises(mpcomm.MpcommError):
        mpcomm.RemoteRegion.from_bytes(b"[" * 100_000 + b"]" * 100_000)


# -- atheris ---------------------------------------------------------------------------------

FUZZ = Path(__file__).with_name("fuzz_atheris.py")


def _atheris_missing() -> str:
    try:
        import atheris  # noqa: F401
    except ImportError as exc:
        return f"atheris is not installed (pip install atheris; it has wheels for CPython <= 3.11 on x86-64): {exc}"
    return ""


@pytest.mark.skipif(bool(_atheris_missing()), reason=_atheris_missing() or "ok")
@pytest.mark.parametrize("what", ["frame", "descriptor"])
def test_atheris_fuzz_run(what: str, tmp_path: Path) -> None:
    seconds = int(os.environ.get("MPCOMM_FUZZ_SECONDS", "2"))
    r = subprocess.run([sys.executable, str(FUZZ), what, f"-max_total_time={seconds}", "-rss_limit_mb=2048",
                        f"-artifact_prefix={tmp_path}/"], capture_output=True, text=True, timeout=seconds + 60)
    assert r.returncode == 0, f"atheris found a crash in {what}:\n{r.stderr[-4000:]}"
    assert "Done" in r.stderr, r.stderr[-2000:]
