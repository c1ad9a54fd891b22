"""serve / put / get against a real ``mpcomm serve`` subprocess."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import socket
from typing import Any

import pytest
from mpcomm_cli_helpers import Server, start_server

from mpcomm import RemoteRegion
from mpcomm.cli import transfer
from mpcomm.cli._common import EXIT_PEER, EXIT_USAGE, EXIT_VERIFY


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_prints_address_and_stops_cleanly_on_sigterm(server: Server) -> None:
    host, port = server.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert {r["name"] for r in server.info["regions"]} == {"kv", "small"}
    assert server.region("kv")["size"] == 1 << 20 and server.region("kv")["token"]
    code, err = server.stop(signal.SIGTERM)
    assert code == 0, err
    assert "stopped" in err and "Traceback" not in err


def test_serve_plain_address_line_and_sigint() -> None:
    srv = start_server("--region", "a=4KiB", json_out=False)
    assert srv.address.startswith("127.0.0.1:")
    code, err = srv.stop(signal.SIGINT)
    assert code == 0, err


def test_put_get_roundtrip_with_verify(invoke: Any, server: Server, data_file: Any, tmp_path: Any) -> None:
    put = invoke("put", data_file, server.address, "kv", "--offset", "4096", "--verify", "--chunk", "64KiB", "--json",
                 "-t", "tcp")
    assert put.exit_code == 0, put.output
    summary = json.loads(put.stdout)
    assert summary["verified"] is True and summary["bytes"] == 300_000 and summary["throughput"] > 0
    assert summary["sha256"] == hashlib.sha256(data_file.read_bytes()).hexdigest()
    out = tmp_path / "out.bin"
    get = invoke("get", server.address, "kv", out, "--offset", "4096", "--length", "300000", "--verify", "--json")
    assert get.exit_code == 0, get.output
    assert out.read_bytes() == data_file.read_bytes()
    assert json.loads(get.stdout)["verified"] is True
    whole = invoke("get", server.address, "small", tmp_path / "small.bin")
    assert whole.exit_code == 0 and (tmp_path / "small.bin").stat().st_size == 4096
    assert "B/s" in whole.output  # throughput at the end (stderr)


def test_unknown_peer(invoke: Any, data_file: Any) -> None:
    result = invoke("put", data_file, f"127.0.0.1:{_free_port()}", "kv")
    assert result.exit_code == EXIT_PEER
    assert "PeerConnectionError" in result.output


def test_bad_address_and_missing_file_are_usage_errors(invoke: Any, data_file: Any, tmp_path: Any) -> None:
    assert invoke("put", data_file, "no-port-here", "kv").exit_code == EXIT_USAGE
    result = invoke("put", tmp_path / "nope.bin", "127.0.0.1:1", "kv")
    assert result.exit_code == EXIT_USAGE and "nope.bin" in result.output
    assert invoke("put", data_file).exit_code == EXIT_USAGE  # neither ADDRESS/REGION nor --descriptor


def test_unknown_region(invoke: Any, server: Server, data_file: Any) -> None:
    result = invoke("put", data_file, server.address, "nosuch")
    assert result.exit_code == EXIT_PEER and "UnknownRegionError" in result.output


def test_out_of_bounds_moves_nothing(invoke: Any, server: Server, data_file: Any, tmp_path: Any) -> None:
    result = invoke("put", data_file, server.address, "small")
    assert result.exit_code == EXIT_PEER and "OutOfBoundsError" in result.output
    result = invoke("get", server.address, "small", tmp_path / "x", "--offset", "4000", "--length", "200")
    assert result.exit_code == EXIT_PEER and "outside region" in result.output


def test_wrong_token_through_a_descriptor(invoke: Any, server: Server, data_file: Any, tmp_path: Any) -> None:
    desc = RemoteRegion.from_dict(server.region("kv"))
    good = tmp_path / "good.json"
    good.write_bytes(desc.to_bytes())
    ok = invoke("put", data_file, "--descriptor", good)
    assert ok.exit_code == 0, ok.output
    bad = tmp_path / "bad.json"
    bad.write_bytes(dataclasses.replace(desc, token=desc.token ^ 1).to_bytes())
    result = invoke("put", data_file, "--descriptor", bad)
    assert result.exit_code == EXIT_PEER and "wrong token" in result.output
    result = invoke("get", "-", "-", tmp_path / "o", "--descriptor", bad, "--length", "10")
    assert result.exit_code == EXIT_PEER and "wrong token" in result.output
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    assert invoke("put", data_file, "--descriptor", garbage).exit_code == EXIT_USAGE


def test_wrong_secret(invoke: Any, data_file: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    right, wrong = "a1" * 32, "b2" * 32  # serve takes its secret from the environment (never argv)
    srv = start_server("--region", "kv=1MiB", env={"MPCOMM_SECRET": right})
    try:
        result = invoke("put", data_file, srv.address, "kv", "--secret", wrong)
        assert result.exit_code == EXIT_PEER and "AuthenticationError" in result.output
        monkeypatch.setenv("MPCOMM_SECRET", right)
        assert invoke("put", data_file, srv.address, "kv").exit_code == 0
    finally:
        assert srv.stop()[0] == 0


def test_readonly_file_backed_region(invoke: Any, data_file: Any, tmp_path: Any) -> None:
    backing = tmp_path / "weights.bin"
    backing.write_bytes(os.urandom(64 << 10))
    srv = start_server("--region", f"w=@{backing}", "--readonly")
    try:
        assert srv.region("w")["access"] == "r"
        result = invoke("put", data_file, srv.address, "w")
        assert result.exit_code == EXIT_PEER and "read-only" in result.output
        out = tmp_path / "copy.bin"
        assert invoke("get", srv.address, "w", out, "--verify").exit_code == 0
        assert out.read_bytes() == backing.read_bytes()
    finally:
        assert srv.stop()[0] == 0


def test_writable_file_backed_region_lands_in_the_file(invoke: Any, data_file: Any, tmp_path: Any) -> None:
    backing = tmp_path / "pool.bin"
    backing.write_bytes(bytes(400_000))
    srv = start_server("--region", f"pool=@{backing}")
    try:
        assert invoke("put", data_file, srv.address, "pool", "--offset", "100").exit_code == 0
    finally:
        assert srv.stop()[0] == 0
    assert backing.read_bytes()[100:300_100] == data_file.read_bytes()


def test_serve_usage_errors(invoke: Any, tmp_path: Any) -> None:
    assert invoke("serve", "--region", "nosize").exit_code == EXIT_USAGE
    assert invoke("serve", "--region", "a=lots").exit_code == EXIT_USAGE
    assert invoke("serve", "--region", "a=1KiB", "--region", "a=2KiB").exit_code == EXIT_USAGE
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    result = invoke("serve", "--region", f"e=@{empty}")
    assert result.exit_code == EXIT_USAGE and "empty" in result.output
    assert invoke("serve", "--region", f"m=@{tmp_path / 'missing'}").exit_code == EXIT_USAGE


def test_verify_mismatch_exits_4(invoke: Any, server: Server, data_file: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer, "_digest_remote", lambda *a, **k: "0" * 64)
    result = invoke("put", data_file, server.address, "kv", "--verify")
    assert result.exit_code == EXIT_VERIFY and "sha256" in result.output
