"""Measured bandwidth classes: ``mpcomm topology --calibrate`` and the default route that reads its file.

Real processes and real transports: the calibration spawns a ``mpcomm serve``
target per transport and writes through it; the route checks use two real
engines and a real request's ``transfer.route``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import mpcomm
from mpcomm import calibration
from mpcomm.registry import load_plugins
from mpcomm.transport import BANDWIDTH_CLASSES


def mpcomm_cli(*args: str, cal: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MPCOMM_CONFIG", "MPCOMM_METADATA")}
    env[calibration.ENV_VAR] = str(cal)
    return subprocess.run([sys.executable, "-m", "mpcomm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _running() -> dict[str, Any]:
    """Transports an engine starts here, with their registry entries."""
    entries = load_plugins().transports
    with mpcomm.Engine() as e:
        return {n: entries[n] for n in e.transports}


def _measurement(name: str, entry: Any, klass: str, gbps: float) -> dict[str, Any]:
    version, native = calibration.transport_versions(entry)
    return calibration.Measurement(
        transport=name, same_host=True, gbps=gbps, rounds_gbps=(gbps,), p50_us=10.0, bandwidth_class=klass,
        declared_class=entry.cls.capabilities.bandwidth_class, version=version, native_version=native,
        measured_at=time.time()).to_dict()


def _file(path: Path, measurements: list[dict[str, Any]], node: dict[str, str] | None = None) -> Path:
    node = node or calibration.node_identity()
    entry = {"node": node, "measured_at": time.time(), "mpcomm_version": mpcomm.__version__,
             "measurements": measurements}
    path.write_text(json.dumps({"format": calibration.FORMAT,
                                "nodes": {f"{node['hostname']}/{node['boot_id']}": entry}}))
    return path


@pytest.fixture
def cal_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache" / "bandwidth.json"
    monkeypatch.setenv(calibration.ENV_VAR, str(path))
    return path


@pytest.fixture
def cal_log() -> Iterator[list[logging.LogRecord]]:
    """What mpcomm.calibration logs (a handler of its own: the CLI may have stopped propagation)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("mpcomm.calibration")
    handler, level = Keep(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def _inverted(running: dict[str, Any]) -> list[dict[str, Any]]:
    """tcp measured as "memory", everything else as "low": the declared order turned round."""
    return [_measurement(n, e, "memory" if n == "tcp" else "low", 20.0 if n == "tcp" else 0.1)
            for n, e in running.items()]


def _same_host_write(cfg: Any = None) -> mpcomm.Transfer:
    with mpcomm.Engine(cfg) as target, mpcomm.Engine(cfg) as initiator:
        target.allocate(1 << 20, "kv")
        remote = initiator.open(target.address, "kv")
        t = initiator.write(b"m" * 65536, remote)
        assert t.result(10) == 65536
        back = bytearray(65536)
        initiator.read(back, remote).result(10)
        assert back == b"m" * 65536
        return t


# -- the calibration, measured -------------------------------------------------------


def test_calibrate_measures_every_running_transport(tmp_path: Path) -> None:
    cal = tmp_path / "xdg" / "mpcomm" / "bandwidth.json"
    p = mpcomm_cli("topology", "--calibrate", "--seconds", "0.3", "--rounds", "3", "--json", cal=cal)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    raw = json.loads(cal.read_text())
    assert raw["format"] == calibration.FORMAT
    node = calibration.node_identity()
    entry = raw["nodes"][f"{node['hostname']}/{node['boot_id']}"]
    assert entry["node"] == node and entry["mpcomm_version"] == mpcomm.__version__
    assert entry["thresholds_gbps"] == {"memory": 8.0, "high": 3.0, "medium": 0.8}
    by_name = {m["transport"]: m for m in entry["measurements"]}
    entries = load_plugins().transports
    available = {t["name"] for t in out["transports"] if t["available"] and t["intra_node"]}
    assert available and set(by_name) == available, (by_name, out["calibration"])
    for name, m in by_name.items():
        assert m["same_host"] is True and m["mode"] == "zero-copy"
        assert m["gbps"] > 0 and len(m["rounds_gbps"]) == 3 and all(r > 0 for r in m["rounds_gbps"])
        assert m["gbps"] == sorted(m["rounds_gbps"])[1]  # the median round
        assert m["class"] in BANDWIDTH_CLASSES and m["class"] == calibration.classify(m["gbps"])
        assert m["p50_us"] > 0 and m["message_size"] == 4 << 20 and m["latency_size"] == 4096
        assert (m["version"], m["native_version"]) == calibration.transport_versions(entries[name])
        assert m["declared_class"] == entries[name].cls.capabilities.bandwidth_class
        assert abs(m["measured_at"] - time.time()) < 600
    # What topology shows after calibrating is what it measured.
    assert out["calibration"]["in_use"] is True and out["calibration"]["path"] == str(cal)
    for row in out["transports"]:
        if row["name"] in by_name:
            assert row["measured"]["class"] == by_name[row["name"]]["class"]
            assert row["measured"]["gbps"] == by_name[row["name"]]["gbps"]
    # The figures, for the record (pytest -s shows them).
    for name, m in sorted(by_name.items()):
        print(f"calibration {name}: {m['gbps']:.2f} GB/s rounds={m['rounds_gbps']} p50={m['p50_us']:.1f}us "
              f"class={m['class']} declared={m['declared_class']}")

    # A second run measuring one transport keeps the others' figures.
    keep = next(n for n in by_name if n != "tcp") if len(by_name) > 1 else None
    p = mpcomm_cli("topology", "--calibrate", "-t", "tcp", "--seconds", "0.2", "--rounds", "1", cal=cal)
    assert p.returncode == 0, p.stderr
    again = {m["transport"]: m for m in json.loads(cal.read_text())["nodes"][
        f"{node['hostname']}/{node['boot_id']}"]["measurements"]}
    assert set(again) == set(by_name)
    assert len(again["tcp"]["rounds_gbps"]) == 1
    if keep:
        assert again[keep] == by_name[keep]
    assert "declared low" in p.stdout and f"measured {again['tcp']['class']} (" in p.stdout


def test_transport_without_calibrate_is_a_usage_error(tmp_path: Path) -> None:
    p = mpcomm_cli("topology", "-t", "tcp", cal=tmp_path / "c.json")
    assert p.returncode == 2 and "add --calibrate" in p.stderr


# -- the default route reads it --------------------------------------------------------


def test_engine_ranks_its_default_route_by_measured_classes(cal_path: Path) -> None:
    running = _running()
    if "tcp" not in running or len(running) < 2:
        pytest.skip(f"needs tcp and another transport running here (running: {list(running)})")
    cal_path.parent.mkdir(parents=True)
    _file(cal_path, _inverted(running))
    declared = _same_host_write({"transport": {"bandwidth": "declared"}})
    assert declared.route[0] != "tcp" and declared.route_rule == "default"

    t = _same_host_write()
    assert t.route_rule == "default"
    assert t.route[0] == "tcp" and t.transport == "tcp"
    assert set(t.route) == {n for n in running if running[n].cls.capabilities.intra_node}
    with mpcomm.Engine() as e:
        policy = e.route_policy
        assert policy.classes(True)["tcp"] == "memory"
        assert all(c == "low" for n, c in policy.classes(True).items() if n != "tcp")
        # A same-host calibration says nothing about routes to other hosts.
        assert policy.classes(False) == {n: running[n].cls.capabilities.bandwidth_class for n in e.transports}


def test_topology_shows_declared_and_measured_and_the_measured_route(cal_path: Path) -> None:
    running = _running()
    if "tcp" not in running or len(running) < 2:
        pytest.skip(f"needs tcp and another transport running here (running: {list(running)})")
    cal_path.parent.mkdir(parents=True)
    _file(cal_path, _inverted(running))
    p = mpcomm_cli("topology", "--json", cal=cal_path)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    rows = {r["name"]: r for r in out["transports"]}
    assert rows["tcp"]["bandwidth_class"] == "low" and rows["tcp"]["measured"]["class"] == "memory"
    cases = {r["case"]: r for r in out["routes"]}
    assert cases["same host"]["transports"][0] == "tcp" and cases["same host"]["rule"] == "default"
    text = mpcomm_cli("topology", cal=cal_path).stdout
    assert "declared low     measured memory (20.00 GB/s, p50 10.0 us, same host)" in text
    assert "default from capabilities and measured classes" in text
    assert "same host:\n    tcp, " in text


# -- files that must not be used -----------------------------------------------------------


def _bad_files(running: dict[str, Any]) -> list[tuple[str, Any, str, int]]:
    me = calibration.node_identity()
    good = _inverted(running)
    return [
        ("not-json", "{oops", "not valid JSON", logging.WARNING),
        ("old-format", {"format": 99, "nodes": {}}, "format 99, this mpcomm reads format 1", logging.WARNING),
        ("bad-class", [dict(good[0], **{"class": "warp"})], "class 'warp' is not one of", logging.WARNING),
        ("bad-gbps", [dict(good[0], gbps=-1)], "gbps must be a positive number", logging.WARNING),
        ("other-node", ({"hostname": "elsewhere", "boot_id": "b"}, good),
         "it has no entry for this node", logging.INFO),
        ("earlier-boot", ({"hostname": me["hostname"], "boot_id": "0" * 8}, good),
         "measured before this node last booted", logging.INFO),
    ]


@pytest.mark.parametrize("case", ["not-json", "old-format", "bad-class", "bad-gbps", "other-node", "earlier-boot"])
def test_a_bad_or_foreign_file_is_ignored_with_the_reason(case: str, cal_path: Path,
                                                          cal_log: list[logging.LogRecord]) -> None:
    running = _running()
    if "tcp" not in running or len(running) < 2:
        pytest.skip(f"needs tcp and another transport running here (running: {list(running)})")
    _, content, reason, level = next(c for c in _bad_files(running) if c[0] == case)
    cal_path.parent.mkdir(parents=True)
    if isinstance(content, str):
        cal_path.write_text(content)
    elif isinstance(content, dict):
        cal_path.write_text(json.dumps(content))
    elif isinstance(content, tuple):
        _file(cal_path, content[1], node=content[0])
    else:
        _file(cal_path, content)
    t = _same_host_write()
    assert t.route[0] != "tcp"  # the declared order
    hits = [r for r in cal_log if reason in r.getMessage()]
    assert hits, [r.getMessage() for r in cal_log]
    assert hits[0].levelno == level and str(cal_path) in hits[0].getMessage()
    assert "using declared bandwidth classes" in hits[0].getMessage()


def test_a_measurement_of_another_version_is_ignored(cal_path: Path, cal_log: list[logging.LogRecord]) -> None:
    running = _running()
    if "tcp" not in running or len(running) < 2:
        pytest.skip(f"needs tcp and another transport running here (running: {list(running)})")
    ms = _inverted(running)
    for m in ms:
        if m["transport"] == "tcp":
            m["version"] = "0.0.0-old"
    cal_path.parent.mkdir(parents=True)
    _file(cal_path, ms)
    with mpcomm.Engine() as e:
        classes = e.route_policy.classes(True)
    assert classes["tcp"] == "low"  # declared: its measurement is stale
    assert all(c == "low" for c in classes.values())  # the others' measurements still count
    msgs = [r.getMessage() for r in cal_log]
    assert any("calibration of tcp ignored: measured with version 0.0.0-old" in m for m in msgs), msgs


def test_a_missing_file_is_silent_and_declared_is_used(cal_path: Path, cal_log: list[logging.LogRecord]) -> None:
    with mpcomm.Engine() as e:
        assert e.route_policy.measured == {True: {}, False: {}}
    assert all(r.levelno < logging.INFO for r in cal_log)


# -- the file, the path, the config keys ---------------------------------------------------


def test_save_keeps_other_nodes_and_drops_an_earlier_boot(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "bandwidth.json"
    me = calibration.node_identity()
    m = calibration.Measurement("tcp", True, 2.0, (2.0,), 100.0, "medium", "low", "1", "", measured_at=1.0)
    other = calibration.Calibration({"hostname": "elsewhere", "boot_id": "x"}, (m,), 1.0, "0.1.0")
    stale = calibration.Calibration({"hostname": me["hostname"], "boot_id": "old"}, (m,), 1.0, "0.1.0")
    calibration.save(path, other)
    calibration.save(path, stale)
    calibration.save(path, calibration.Calibration(me, (m,), 2.0, "0.1.0"))
    nodes = json.loads(path.read_text())["nodes"]
    assert set(nodes) == {"elsewhere/x", f"{me['hostname']}/{me['boot_id']}"}
    assert oct(path.parent.stat().st_mode & 0o777) == oct(0o700)
    loaded = calibration.load(path)
    assert loaded is not None and loaded.classes(True) == {"tcp": "medium"} and loaded.classes(False) == {}
    assert not list(path.parent.glob(".bandwidth-*"))  # the temporary file was renamed, not left


def test_classes_and_thresholds() -> None:
    assert [calibration.classify(g) for g in (30.0, 8.0, 7.99, 3.0, 0.8, 0.79, 0.001)] == [
        "memory", "memory", "high", "high", "medium", "low", "low"]


def test_path_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(calibration.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert calibration.calibration_path(mpcomm.Config()) == tmp_path / "xdg" / "mpcomm" / "bandwidth.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert calibration.calibration_path(mpcomm.Config()) == Path.home() / ".cache" / "mpcomm" / "bandwidth.json"
    monkeypatch.setenv(calibration.ENV_VAR, str(tmp_path / "env.json"))
    assert calibration.calibration_path(mpcomm.Config()) == tmp_path / "env.json"
    cfg = mpcomm.Config.from_dict({"transport": {"calibration_file": str(tmp_path / "cfg.json")}})
    assert calibration.calibration_path(cfg) == tmp_path / "cfg.json"


def test_bandwidth_key_is_checked() -> None:
    with pytest.raises(mpcomm.ConfigError, match=r"transport\.bandwidth must be one of measured, declared"):
        mpcomm.Config.from_dict({"transport": {"bandwidth": "fastest"}})
    with pytest.raises(mpcomm.ConfigError, match=r"transport\.calibration_file must be a string"):
        mpcomm.Config.from_dict({"transport": {"calibration_file": 3}})
