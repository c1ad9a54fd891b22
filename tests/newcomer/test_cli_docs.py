"""docs/cli.md's examples, run as a user would: every fenced ``sh`` block is one bash script.

``$ `` lines are the commands; the other lines show output. Of the output, the
``exit N`` lines and the ``error: <Class>`` prefix of error lines must appear,
in order, in what the script really printed: the docs say which command fails
and how, and the test holds them to it. ``$ADDR`` is a real ``mpcomm serve``
that the test starts (one 1 MiB region ``kv``).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from newcomer_support import ROOT, cli_env

DOC = ROOT / "docs" / "cli.md"


def _blocks() -> list[tuple[int, list[str], list[str]]]:
    """(line number, commands, expected markers) of every ```sh block."""
    out = []
    lines = DOC.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```sh":
            start, body = i + 1, []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            commands = [ln[2:] for ln in body if ln.startswith("$ ")]
            markers = []
            for ln in body:
                if ln.startswith("$ "):
                    continue
                if re.fullmatch(r"exit \d+", ln.strip()):
                    markers.append(ln.strip())
                elif ln.startswith("error: "):
                    markers.append(ln.split(":", 2)[0] + ":" + ln.split(":", 2)[1])
            if commands:
                out.append((start, commands, markers))
        i += 1
    return out


BLOCKS = _blocks()


def test_the_docs_have_runnable_examples() -> None:
    assert len(BLOCKS) >= 8
    text = " ".join(c for _, cmds, _ in BLOCKS for c in cmds)
    for command in ("mpcomm serve", "mpcomm put", "mpcomm get", "mpcomm bench --target", "mpcomm doctor --manifest",
                    "mpcomm plugins --json", "mpcomm demo"):
        assert command in text, f"docs/cli.md has no runnable example of {command}"


@pytest.mark.parametrize("lineno,commands,markers", BLOCKS, ids=[f"cli.md:{b[0]}" for b in BLOCKS])
def test_example_block(lineno: int, commands: list[str], markers: list[str], serve: Any, tmp_path: Path) -> None:
    script = "\n".join(["set -u", *commands, ""])
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300, env=cli_env(ADDR=serve.address))
    output = proc.stdout
    assert proc.returncode == 0, f"docs/cli.md:{lineno}: the example failed (exit {proc.returncode}):\n{output}"
    assert "Traceback" not in output, output
    pos = 0
    for marker in markers:
        found = output.find(marker, pos)
        assert found >= 0, f"docs/cli.md:{lineno}: expected {marker!r} (in this order) in:\n{output}"
        pos = found + len(marker)
    errors = [ln for ln in output.splitlines() if ln.startswith("error: ")]
    assert len(errors) == sum(m.startswith("error: ") for m in markers), \
        f"docs/cli.md:{lineno}: errors the docs do not show:\n{output}"
