"""The soak (benchmarks/soak.py), short: mixed sizes and ops under random faults, every byte accounted for.

Marked slow, but run by the default test command for ``MPCOMM_SOAK_SECONDS``
(default 12 s of faults, after a 2 s warm-up). Longer runs: ``python benchmarks/soak.py --seconds 600``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from support import transports

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import importlib.util  # noqa: E402

# Loaded from its path: benchmarks/ is not a package, and a plain import would read
# as a third-party module to the test-extra audit (tests/newcomer/test_packaging.py).
_spec = importlib.util.spec_from_file_location("mpcomm_soak", Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py")
assert _spec is not None and _spec.loader is not None
_soak = importlib.util.module_from_spec(_spec)
sys.modules["mpcomm_soak"] = _soak
_spec.loader.exec_module(_soak)
run_soak = _soak.run_soak

SECONDS = float(os.environ.get("MPCOMM_SOAK_SECONDS", "12"))
# Faults the soak leaves out per transport (a known gap tested elsewhere). None today: ucx's
# unregister fault (fenced revocation) orphaned one rkey per re-registration on the initiator
# and is bounded since (tests/ucx/test_ucx_security.py, repeated revocations).
SKIP_FAULTS: dict[str, set[str]] = {}


def _runnable() -> list[str]:
    return [p.values[0] for p in transports() if not any(m.args and m.args[0] for m in p.marks)]


@pytest.mark.slow
@pytest.mark.watchdog(SECONDS + 150)
def test_soak_loses_no_byte_and_does_not_drift() -> None:
    report = run_soak(SECONDS, _runnable(), threads=2, skip_faults=SKIP_FAULTS)
    print(report)
    summary = {k: report[k] for k in ("requests", "failures", "faults", "bytes_verified", "bytes_lost", "p99_ms",
                                      "drift")}
    assert report["bytes_lost"] == 0, (report["lost_detail"], summary)
    assert report["stray_bytes"] == 0, (report["lost_detail"], summary)
    assert report["hangs"] == 0, summary
    assert report["late"] == 0, f"requests past deadline + grace + 3 s: {summary}"
    assert report["requests"] > 100 and report["bytes_verified"] > 0, summary
    assert sum(report["faults"].values()) >= 3, f"too few faults were injected: {summary}"
    # The initiator's engines start their worker and notification pools lazily, up to
    # runtime.worker_threads each (bounded, not drift); beyond that, 4 threads of slack.
    pools = 2 * 8 * len(report["transports"])
    for who, d in report["drift"].items():
        allowed = 4 + (pools if who == "initiator" else 0)
        assert d["threads"] <= allowed and d["fds"] <= 8, f"{who} drifted: {d}"
        assert d["rss"] <= 128 << 20, f"{who}'s VmRSS grew by {d['rss'] >> 20} MiB"
