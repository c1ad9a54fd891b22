"""``mpcomm bench``: record format, JSON, plot, skipped device memory, faults, errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest

from mpcomm.cli._common import EXIT_USAGE

SEED_KEYS = ["transport", "mode", "memory", "message_size", "concurrency", "numa_binding", "throughput",
             "p50_latency", "p99_latency", "cpu_utilization"]


def _fields(line: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line))


def _jsonl(stdout: str) -> list[dict[str, Any]]:
    """--json is JSON Lines: every line one record."""
    return [json.loads(line) for line in stdout.splitlines()]


def test_latency_and_throughput_records_in_seed_format(invoke: Any, tmp_path: Any) -> None:
    png = tmp_path / "bench.png"
    result = invoke("bench", "--quick", "-t", "tcp", "--case", "latency", "--case", "throughput",
                    "--seconds", "0.03", "--plot", png)
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("transport=")]
    assert len(lines) == 2 * 2 + 3 * 2
    for line in lines:
        assert list(_fields(line))[: len(SEED_KEYS)] == SEED_KEYS
        f = _fields(line)
        assert f["transport"] == "tcp" and f["memory"] == "host" and f["numa_binding"] == "none"
        assert f["throughput"].endswith("B/s") and f["cpu_utilization"].endswith("%")
    assert png.stat().st_size > 1000


def test_json_memory_kinds_and_modes(invoke: Any) -> None:
    result = invoke("bench", "--quick", "-t", "tcp", "--case", "memory", "--case", "modes", "--seconds", "0.03",
                    "--json")
    assert result.exit_code == 0, result.output
    records = _jsonl(result.stdout)
    memory = {r["memory"]: r for r in records if r["case"] == "memory"}
    assert set(memory) == {"host->host", "host->cuda", "cuda->host", "cuda->cuda"}  # the seed's matrix
    assert all(r["status"] == "skipped" and r["reason"] for r in memory.values())  # tcp: host only
    from mpcomm import cuda_runtime

    # tcp moves local CUDA memory only where cuda-python and a GPU are, and never a remote CUDA region
    why = cuda_runtime.unavailable_reason()
    assert memory["cuda->cuda"]["reason"] == (why or "tcp moves local cuda,host, remote host")
    assert {r["mode"] for r in records if r["case"] == "modes"} == {"zero-copy", "copy"}


def test_memory_option_per_side(invoke: Any) -> None:
    """--memory picks the pairs (and implies the memory case); without CUDA each says why."""
    result = invoke("bench", "--quick", "-t", "shm", "--memory", "host:cuda", "--memory", "cuda", "--json")
    assert result.exit_code == 0, result.output
    records = [r for r in _jsonl(result.stdout) if r["case"] == "memory"]
    assert [r["memory"] for r in records] == ["host->cuda", "cuda->cuda"]
    from mpcomm import cuda_runtime

    why = cuda_runtime.unavailable_reason()
    if why:  # no GPU here: shm declares cuda and says what it lacks
        assert all(r["status"] == "skipped" and r["reason"] == why for r in records)
    bad = invoke("bench", "-t", "tcp", "--memory", "tpu")
    assert bad.exit_code != 0 and "unknown memory kind 'tpu'" in bad.output


def test_fault_scenarios_record_errors(invoke: Any) -> None:
    result = invoke("bench", "--quick", "-t", "tcp", "--case", "fault", "--json")
    assert result.exit_code == 0, result.output
    records = {r["case"]: r for r in _jsonl(result.stdout)}
    stopped, killed = records["fault_peer_stopped"], records["fault_peer_killed"]
    assert stopped["errors"] and "ok" not in stopped["errors"]  # nothing succeeds against a stopped peer
    assert killed["errors"].get("connection", 0) >= 1
    assert killed["extra"]["detect"] < 2.0


def test_bad_transport_and_missing_matplotlib(invoke: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    result = invoke("bench", "-t", "nosuch")
    assert result.exit_code == EXIT_USAGE and "no such transport" in result.output
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = invoke("bench", "-t", "tcp", "--plot", tmp_path / "x.png")
    assert result.exit_code == EXIT_USAGE and "mpcomm[plot]" in result.output


def test_otel_overhead_case_runs_in_its_own_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mpcomm.cli", "bench", "-t", "tcp", "--case", "otel", "--quick", "--seconds", "0.1"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr
    settings = [_fields(ln)["otel"] for ln in proc.stdout.splitlines() if "case=otel_overhead" in ln]
    assert settings == ["off", "metrics", "traces+metrics"]
