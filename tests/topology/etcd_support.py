"""A real etcd server on loopback for the metadata tests (Debian's etcd-server).

Random free ports, a temporary data dir, killed at teardown. Only 127.0.0.1 is
ever dialled.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def etcd_binary() -> str | None:
    return shutil.which("etcd") or next((p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if os.access(p, os.X_OK)), None)


class EtcdServer:
    def __init__(self, workdir: Path) -> None:
        binary = etcd_binary()
        assert binary is not None
        self.binary = binary
        self.workdir = workdir
        self.data_dir = workdir / "data"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "etcd.log"

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 30.0) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            self.binary, "--name", "mpcomm-test", "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.http, "--advertise-client-urls", self.http,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"mpcomm-test={peer}", "--initial-cluster-state", "new",
            "--heartbeat-interval", "50", "--election-timeout", "500",
        ]
        # Our flags only: an ETCD_* variable in the environment would shadow them.
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        if platform.machine() in ("aarch64", "arm64"):
            env["ETCD_UNSUPPORTED_ARCH"] = "arm64"  # etcd 3.4 asks for it on arm64
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.http + "/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") in ("true", True):
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"etcd did not become healthy within {timeout}s: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def restart(self, *, wipe: bool = False) -> None:
        self.kill()
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        self.start()

    def raw_values(self, prefix: str = "/mpcomm/") -> list[str]:
        """Every value under ``prefix``, read straight from the gateway (not through mpcomm)."""
        import base64

        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        body = json.dumps({"key": base64.b64encode(prefix.encode()).decode(),
                           "range_end": base64.b64encode(end.encode()).decode()}).encode()
        req = urllib.request.Request(self.http + "/v3/kv/range", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            kvs = json.loads(r.read()).get("kvs", [])
        return [base64.b64decode(kv.get("value", "")).decode() for kv in kvs]

    def _post(self, path: str, payload: dict) -> dict:
        req = urllib.request.Request(self.http + path, data=json.dumps(payload).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def grant(self, ttl: int = 60) -> int:
        """A lease of our own (an attacker with write access to etcd can take one too)."""
        return int(self._post("/v3/lease/grant", {"TTL": ttl, "ID": 0})["ID"])

    def put_raw(self, key: str, value: str, lease: int | None = None) -> None:
        """Write ``value`` at ``key`` straight through the gateway (without a lease unless given)."""
        self.put_many([(key, value)], lease)

    def put_many(self, items: list[tuple[str, str]], lease: int | None = None) -> None:
        """Write many keys, 128 per transaction (etcd's default ``--max-txn-ops``)."""
        import base64

        def op(key: str, value: str) -> dict:
            put = {"key": base64.b64encode(key.encode()).decode(), "value": base64.b64encode(value.encode()).decode()}
            if lease is not None:
                put["lease"] = lease
            return {"request_put": put}

        for i in range(0, len(items), 128):
            self._post("/v3/kv/txn", {"success": [op(k, v) for k, v in items[i:i + 128]]})

    def get_raw(self, key: str) -> str:
        """The value at exactly ``key`` ("" when absent)."""
        import base64

        kvs = self._post("/v3/kv/range", {"key": base64.b64encode(key.encode()).decode()}).get("kvs", [])
        return base64.b64decode(kvs[0].get("value", "")).decode() if kvs else ""
