"""CliRunner tests for the commands that need no peer: help, plugins, demo, doctor, usage errors."""

from __future__ import annotations

import json
from importlib import metadata
from typing import Any

import pytest

from mpcomm import __version__
from mpcomm.cli import _common
from mpcomm.cli._common import EXIT_PEER, EXIT_USAGE, format_size, parse_size


def test_help_documents_exit_codes_and_every_command(invoke: Any) -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for word in ("plugins", "demo", "doctor", "serve", "put", "get", "bench", "Exit codes", "--otel", "--config"):
        assert word in result.output


def test_version(invoke: Any) -> None:
    result = invoke("--version")
    assert result.exit_code == 0 and __version__ in result.output


def test_unknown_command_is_a_usage_error(invoke: Any) -> None:
    assert invoke("frobnicate").exit_code == EXIT_USAGE


def test_sizes() -> None:
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("4k") == 4096
    assert parse_size("1GB") == 10**9
    assert format_size(4 << 20) == "4MiB" and format_size(8) == "8B"
    with pytest.raises(_common.CliError):
        parse_size("lots")


def test_plugins_json_lists_tcp_with_distribution_and_capabilities(invoke: Any) -> None:
    result = invoke("plugins", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    tcp = next(t for t in data["transports"] if t["name"] == "tcp")
    assert tcp["available"] is True and tcp["distribution"] == "mpcomm"
    assert tcp["version"] == metadata.version("mpcomm")
    assert "host" in tcp["capabilities"]["memory_kinds"]
    assert tcp["reason"]


def test_plugins_table_and_broken_plugin(invoke: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import mpcomm.registry as registry

    real = registry._entry_points
    broken = metadata.EntryPoint(name="broken", value="mpcomm_no_such_module_xyz", group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "_entry_points", lambda: [*real(), broken])
    result = invoke("plugins")
    assert result.exit_code == 0, result.output
    # The table is the result: on stdout (docs/cli.md); the loader's warning is a diagnostic: stderr.
    assert "tcp" in result.stdout and "broken plugins" in result.stdout and "mpcomm_no_such_module_xyz" in result.stdout
    assert "mpcomm transports" not in result.stderr and "failed to load" in result.stderr
    data = json.loads(invoke("plugins", "--json").stdout)
    assert any(f["name"] == "broken" and "import failed" in f["reason"] for f in data["failures"])


def test_demo_moves_data_through_tcp(invoke: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPCOMM_PLUGINS", "tcp")
    result = invoke("demo", "--size", "1MiB", "--reps", "2", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["best"] == "tcp"
    (r,) = data["results"]
    assert r["write_throughput"] > 0 and r["read_throughput"] > 0 and r["carried_by"] == "tcp"
    table = invoke("demo", "--size", "256KiB", "--reps", "1")
    assert table.exit_code == 0 and "tcp (best)" in table.stdout and "tcp (best)" not in table.stderr


def test_demo_bad_size_is_usage_error(invoke: Any) -> None:
    result = invoke("demo", "--size", "huge")
    assert result.exit_code == EXIT_USAGE and "not a size" in result.output


def test_demo_without_transports_fails_with_peer_code(invoke: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPCOMM_PLUGINS", "nothing")
    result = invoke("demo", "--size", "4KiB")
    assert result.exit_code == EXIT_PEER and "TransportUnavailable" in result.output


def test_config_errors_exit_2_and_name_the_file(invoke: Any, tmp_path: Any) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[runtime]\nqueue_dept = 3\n")
    result = invoke("--config", bad, "demo", "--size", "4KiB")
    assert result.exit_code == EXIT_USAGE
    assert "queue_dept" in result.output and "bad.toml" in result.output
    result = invoke("demo", "--config", tmp_path / "missing.toml")
    assert result.exit_code == EXIT_USAGE and "not found" in result.output


def test_config_via_envvar(invoke: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[transport]\nname = "tcp"\nmode = "copy"\n')
    monkeypatch.setenv("MPCOMM_CONFIG", str(cfg))
    result = invoke("demo", "--size", "64KiB", "--reps", "1", "--json")
    assert result.exit_code == 0, result.output
    assert [r["transport"] for r in json.loads(result.stdout)["results"]] == ["tcp"]


def test_doctor_json_has_sections_and_plugins(invoke: Any) -> None:
    result = invoke("doctor", "--json")
    assert result.exit_code in (0, 1)
    data = json.loads(result.stdout)
    sections = {c["section"] for c in data["checks"]}
    assert {"cpu", "network", "rdma", "hugepages", "memory", "cma", "plugins"} <= sections
    assert any(c["section"] == "plugins" and c["name"] == "tcp" and c["status"] == "pass" for c in data["checks"])
    assert result.exit_code == (1 if data["status"] == "fail" else 0)


def test_doctor_fails_when_no_transport_is_available(invoke: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPCOMM_PLUGINS", "nothing")
    result = invoke("doctor")
    assert result.exit_code == 1
    assert "FAIL" in result.stdout and "usable_transport" in result.stdout


def test_doctor_manifest(invoke: Any) -> None:
    result = invoke("doctor", "--manifest", "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["mpcomm"] == metadata.version("mpcomm")
    assert data["plugin:tcp"].startswith("mpcomm ")
    for key in ("python", "rdma-core", "libucx", "pyverbs"):
        assert key in data
    text = invoke("doctor", "--manifest")
    assert text.exit_code == 0 and "plugin:tcp" in text.stdout


def test_otel_console_prints_spans_and_metrics_on_stderr(tmp_path: Any) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "mpcomm.cli", "--otel", "console", "demo", "--size", "64KiB", "--reps", "1", "--json"],
        capture_output=True, text=True, timeout=60, env={**__import__("os").environ, "MPCOMM_PLUGINS": "tcp"},
    )
    assert proc.returncode == 0, proc.stderr
    json.loads(proc.stdout)  # stdout stays data
    # A span per command and operation, per-request detail as metrics: readable, not one span per request.
    assert '"name": "mpcomm demo"' in proc.stderr and '"name": "mpcomm.demo.pair"' in proc.stderr
    assert '"name": "mpcomm.write"' not in proc.stderr
    assert "mpcomm.transfer.bytes" in proc.stderr and "mpcomm.transfer.duration" in proc.stderr


def test_otel_otlp_missing_exporter_is_a_clear_usage_error(invoke: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    result = invoke("--otel", "otlp", "plugins", "--json")
    assert result.exit_code == EXIT_USAGE
    assert "mpcomm[otlp]" in result.output
