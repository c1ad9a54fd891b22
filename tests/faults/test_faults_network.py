"""Real network faults between engines on three "hosts" (network namespaces on a bridge).

h0 runs an initiator (driver.py), h1 and h2 each run the kit's target engine on tcp.
Faults are real: nftables drops packets, tc shapes or (where the kernel has
sch_netem) delays and reorders them, and links go down and up mid-transfer.

For every case: each request ends within its deadline plus the abort grace
(success or a clear error, never a hang); every byte of a request reported
complete is present (sha256 on the target); no byte lands outside the range
the request was given; the other target keeps serving.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from mpcomm.testing.patterns import pattern

from netns import Network, netem_unavailable, nft_unavailable, unavailable

pytestmark = [pytest.mark.netns, pytest.mark.skipif(bool(unavailable()), reason=unavailable() or "ok")]

MiB = 1 << 20
SIZE = 24 * MiB
FILL = 4242  # the target regions' background pattern: any byte outside a request must still match it
GRACE = 1.0  # runtime.abort_grace_ms of the driver
SLACK = 3.0  # a loaded 2-core machine
CLEAN = ("TransferTimeout", "PeerConnectionError", "HandshakeTimeout")


@pytest.fixture(scope="module")
def net() -> Iterator[dict[str, Any]]:
    with Network(3) as network:
        regions = {"kv": [SIZE, "buffer"]}
        env = {
            "net": network,
            "t1": network.target(1, regions),
            "t2": network.target(2, regions),
            "d": network.driver(0, {"runtime": {"abort_grace_ms": int(GRACE * 1000), "request_timeout_ms": 15000}}),
        }
        yield env


@pytest.fixture
def clean(net: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for t in (net["t1"], net["t2"]):
        t.cmd(f"fill kv {FILL}")
    yield net
    for i in range(3):
        net["net"].clear(i)


def background(offset: int, length: int) -> str:
    return hashlib.sha256(pattern(FILL, SIZE)[offset : offset + length]).hexdigest()


def run(d: Any, t: Any, kind: str, offset: int, length: int, seed: int, timeout: float) -> dict[str, Any]:
    return d.call(wait=timeout + GRACE + 60, op="run", kind=kind, addr=t.address, region="kv",
                  offset=offset, length=length, seed=seed, timeout=timeout)


def check_outcome(out: dict[str, Any], timeout: float, what: str) -> None:
    assert out["elapsed"] <= timeout + GRACE + SLACK, f"{what}: took {out['elapsed']:.1f}s for a {timeout}s deadline"
    if not out["ok"]:
        assert out["error"] in CLEAN, f"{what}: unclear error {out['error']}: {out['message']}"


def outside_untouched(t: Any, spans: list[tuple[int, int]]) -> None:
    """Every byte outside ``spans`` (offset, length) still holds the background pattern."""
    edges = sorted(spans)
    pos = 0
    for off, ln in [*edges, (SIZE, 0)]:
        if off > pos:
            assert t.sha("kv", pos, off - pos) == background(pos, off - pos), f"bytes changed in [{pos}, {off})"
        pos = max(pos, off + ln)


def mixed_writes(d: Any, t: Any, seed: int, timeout: float, count: int = 6) -> list[tuple[dict[str, Any], int, int]]:
    rng = random.Random(seed)
    results = []
    slots = sorted(rng.sample(range(SIZE // (3 * MiB)), count))  # disjoint 3 MiB slots
    for k, slot in enumerate(slots):
        length = rng.choice([4096, 65537, 512 << 10, 2 * MiB + 3])
        offset = slot * 3 * MiB + rng.randrange(0, MiB)
        out = run(d, t, "write", offset, length, seed * 100 + k, timeout)
        check_outcome(out, timeout, f"write {length}B @ {offset}")
        if out["ok"]:
            assert t.sha("kv", offset, length) == out["sha"], f"write {length}B @ {offset} reported done, bytes differ"
        results.append((out, offset, length))
    return results


def test_clean_network_baseline(clean: dict[str, Any]) -> None:
    res = mixed_writes(clean["d"], clean["t1"], seed=1, timeout=10)
    assert all(o["ok"] for o, _, _ in res)
    back = run(clean["d"], clean["t1"], "read", res[0][1], res[0][2], 0, 10)
    assert back["ok"] and back["sha"] == res[0][0]["sha"]
    outside_untouched(clean["t1"], [(off, ln) for _, off, ln in res])


@pytest.mark.skipif(bool(nft_unavailable()), reason=nft_unavailable() or "ok")
@pytest.mark.parametrize("percent", [1, 10])
def test_packet_loss(clean: dict[str, Any], percent: int) -> None:
    net = clean["net"]
    net.loss(0, percent)
    net.loss(1, percent)
    res = mixed_writes(clean["d"], clean["t1"], seed=10 + percent, timeout=12)
    back = run(clean["d"], clean["t1"], "read", res[-1][1], res[-1][2], 0, 12)  # reads under loss too
    check_outcome(back, 12, "read under loss")
    assert sum(o["ok"] for o, _, _ in res) >= len(res) - 1, [o for o, _, _ in res if not o["ok"]]
    if back["ok"] and res[-1][0]["ok"]:
        assert back["sha"] == res[-1][0]["sha"], "a read under loss returned wrong bytes"
    # At 1 % a short workload can pass without a single drop (it is a handful of GSO segments):
    # rewrite the last slot until the rule has dropped something, checking each write as above.
    for k in range(40):
        if net.dropped(0) + net.dropped(1) > 0:
            break
        out = run(clean["d"], clean["t1"], "write", res[-1][1], res[-1][2], 900 + k, 12)
        check_outcome(out, 12, "extra write under loss")
        if out["ok"]:
            assert clean["t1"].sha("kv", res[-1][1], res[-1][2]) == out["sha"], "extra write reported done, bytes differ"
    assert net.dropped(0) + net.dropped(1) > 0, "the loss rules dropped nothing: the fault was not injected"
    outside_untouched(clean["t1"], [(off, ln) for _, off, ln in res])
    # The other host is served too (through the same lossy h0 link; its own link is clean).
    other = run(clean["d"], clean["t2"], "write", 0, 65536, 3, 10)
    check_outcome(other, 10, "write to the other host during the loss")


@pytest.mark.skipif(bool(netem_unavailable()), reason=netem_unavailable() or "ok")
@pytest.mark.parametrize("spec", ["delay 1ms", "delay 50ms", "delay 10ms reorder 25% 50%", "loss 10%"])
def test_netem(clean: dict[str, Any], spec: str) -> None:
    clean["net"].netem(0, spec)
    res = mixed_writes(clean["d"], clean["t1"], seed=hash(spec) % 1000, timeout=15, count=4)
    assert all(o["ok"] for o, _, _ in res), res
    outside_untouched(clean["t1"], [(off, ln) for _, off, ln in res])


def test_bandwidth_cap_turns_into_clean_timeouts(clean: dict[str, Any]) -> None:
    """8 MiB at 16 Mbit/s needs ~4 s: a 0.5 s deadline ends in TransferTimeout, in time, and nothing strays."""
    net, d, t = clean["net"], clean["d"], clean["t1"]
    run(d, t, "write", 0, 4096, 1, 10)  # connections up before the cap
    net.rate(0, "16mbit")
    out = run(d, t, "write", MiB, 8 * MiB, 7, 0.5)
    check_outcome(out, 0.5, "capped write")
    assert not out["ok"] and out["error"] == "TransferTimeout", out
    net.clear(0)
    outside_untouched(t, [(0, 4096), (MiB, 8 * MiB)])
    again = run(d, t, "write", MiB, 8 * MiB, 8, 15)
    assert again["ok"] and t.sha("kv", MiB, 8 * MiB) == again["sha"]


def test_link_down_mid_transfer_then_up(clean: dict[str, Any]) -> None:
    net, d, t = clean["net"], clean["d"], clean["t1"]
    run(d, t, "write", 0, 4096, 1, 10)
    net.rate(0, "16mbit")  # keep it in flight long enough to pull the cable under it
    started = d.call(op="start", kind="write", addr=t.address, region="kv", offset=2 * MiB, length=8 * MiB,
                     seed=21, timeout=3.0)
    time.sleep(0.5)
    net.link(0, up=False)
    out = d.call(wait=60, op="wait", id=started["id"])
    check_outcome(out, 3.0, "write across a link failure")
    assert not out["ok"], "an 8 MiB write at 16 Mbit/s cannot have finished in 0.5 s"
    net.clear(0)
    outside_untouched(t, [(0, 4096), (2 * MiB, 8 * MiB)])  # partial landing only inside its own range
    deadline = time.monotonic() + 20
    while True:  # the link is back: a fresh request goes through (the old connection may need to be noticed dead)
        again = run(d, t, "write", 12 * MiB, MiB, 22, 5)
        if again["ok"]:
            break
        check_outcome(again, 5, "write after the link came back")
        assert time.monotonic() < deadline, again
    assert t.sha("kv", 12 * MiB, MiB) == again["sha"]


def test_a_partitioned_host_does_not_hold_up_the_others(clean: dict[str, Any]) -> None:
    net, d, t1, t2 = clean["net"], clean["d"], clean["t1"], clean["t2"]
    run(d, t2, "write", 0, 4096, 1, 10)
    net.link(2, up=False)
    lost = d.call(op="start", kind="write", addr=t2.address, region="kv", offset=MiB, length=MiB, seed=31,
                  timeout=2.0)
    res = mixed_writes(d, t1, seed=32, timeout=10, count=3)  # meanwhile h1 is served as usual
    assert all(o["ok"] for o, _, _ in res)
    out = d.call(wait=60, op="wait", id=lost["id"])
    check_outcome(out, 2.0, "write to a partitioned host")
    assert not out["ok"]
    net.clear(2)
    outside_untouched(t2, [(0, 4096), (MiB, MiB)])


def test_target_killed_mid_transfer_and_restarted(net: dict[str, Any]) -> None:
    """SIGKILL on h2's target under a write: a clean error in time; its restart (new epoch) serves again."""
    network, d = net["net"], net["d"]
    victim = network.target(2, {"kv": [SIZE, "buffer"]})
    try:
        run(d, victim, "write", 0, 4096, 1, 10)
        network.rate(0, "16mbit")
        started = d.call(op="start", kind="write", addr=victim.address, region="kv", offset=MiB, length=8 * MiB,
                         seed=41, timeout=4.0)
        time.sleep(0.5)
        victim.kill()
        out = d.call(wait=60, op="wait", id=started["id"])
        check_outcome(out, 4.0, "write to a killed target")
        assert not out["ok"]
    finally:
        network.clear(0)
        victim.kill()
    reborn = network.target(2, {"kv": [SIZE, "buffer"]})
    out = run(d, reborn, "write", MiB, MiB, 42, 10)
    assert out["ok"] and reborn.sha("kv", MiB, MiB) == out["sha"]
    reborn.close()


def test_target_stopped_past_the_deadline(net: dict[str, Any]) -> None:
    """SIGSTOP on h1's target: the request ends at its deadline; after SIGCONT nothing lands outside its range."""
    d, t = net["d"], net["t1"]
    t.cmd(f"fill kv {FILL}")
    run(d, t, "write", 0, 4096, 1, 10)
    t.stop()
    try:
        out = run(d, t, "write", 4 * MiB, 2 * MiB, 51, 1.0)
    finally:
        t.cont()
    check_outcome(out, 1.0, "write to a stopped target")
    assert not out["ok"] and out["error"] == "TransferTimeout", out
    time.sleep(0.5)  # whatever was still queued to the target lands now, if anywhere
    outside_untouched(t, [(0, 4096), (4 * MiB, 2 * MiB)])
    again = run(d, t, "write", 8 * MiB, MiB, 52, 10)
    assert again["ok"] and t.sha("kv", 8 * MiB, MiB) == again["sha"]
