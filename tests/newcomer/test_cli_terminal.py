"""The CLI as people read it: the terminal's width, one unit family, results on stdout, diagnostics on stderr."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from newcomer_support import Serve, cli_env, mpcomm

SIZE = re.compile(r"\d(?:\.\d+)?\s?(B|KiB|MiB|GiB|kB|KB|MB|GB)(?!/s)\b")
RATE = re.compile(r"\d(?:\.\d+)?\s?(B/s|KB/s|MB/s|GB/s|KiB/s|MiB/s|GiB/s|kB/s)")


@pytest.mark.parametrize("columns", [60, 80, 132])
@pytest.mark.parametrize("args", [("plugins",), ("doctor",), ("demo", "--size", "64KiB", "--reps", "1")])
def test_tables_follow_the_terminal_width_on_stdout(args: tuple[str, ...], columns: int) -> None:
    proc = mpcomm(*args, env=cli_env(COLUMNS=str(columns), MPCOMM_PLUGINS="tcp"))
    assert proc.returncode in (0, 1), proc.stderr  # doctor: 1 when a check FAILs on this machine
    # The table is the result: stdout (`mpcomm demo > out.txt` keeps it).
    widths = [len(line) for line in proc.stdout.splitlines()]
    assert widths and max(widths) <= columns, proc.stdout


def test_progress_bar_and_summary_use_one_unit_family_and_agree(serve: Serve, tmp_path: Path) -> None:
    data = tmp_path / "data.bin"
    data.write_bytes(os.urandom(700_000))
    for args in (("put", data, serve.address, "kv"), ("get", serve.address, "kv", tmp_path / "o.bin", "--length",
                                                      "700000")):
        proc = mpcomm(*args, env=cli_env(COLUMNS="100"))
        assert proc.returncode == 0, proc.stderr
        bar = proc.stderr.strip().splitlines()[-1]  # the progress bar: a diagnostic
        (summary,) = proc.stdout.strip().splitlines()  # the summary: the result
        both = proc.stderr + proc.stdout
        assert {u for u in SIZE.findall(both)} <= {"B", "KiB", "MiB", "GiB"}, both
        assert {u for u in RATE.findall(both)} <= {"B/s", "KB/s", "MB/s", "GB/s"}, both
        assert "683.6KiB/683.6KiB" in bar and "683.6KiB in" in summary
        # The bar's rate is bytes so far over time so far: the summary's figure.
        assert RATE.search(bar).group(0) == RATE.search(summary).group(0), (bar, summary)  # type: ignore[union-attr]


def test_json_outputs_are_json_lines(serve: Serve, tmp_path: Path) -> None:
    import json

    data = tmp_path / "d.bin"
    data.write_bytes(b"y" * 5000)
    for args in (("plugins", "--json"), ("doctor", "--manifest", "--json"), ("put", data, serve.address, "kv", "--json"),
                 ("bench", "--target", serve.address, "kv", "--case", "latency", "--quick", "--duration", "0.02",
                  "--json")):
        proc = mpcomm(*args)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines and all(isinstance(json.loads(line), dict) for line in lines), proc.stdout
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(records) == 4  # 8 B and 4 KiB, write and read: one line each
    for r in records:
        assert isinstance(r["cpu_utilization"], float) and isinstance(r["extra"]["cpu_initiator"], float)
        assert isinstance(r["p999_latency"], float) and isinstance(r["throughput"], float)
