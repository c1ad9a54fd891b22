"""libmpcomm.so driven by a C++ host of our own, as Mooncake TENT's adapter drives it.

Three processes: targets A and B (tent_host target) and an initiator
(tent_host initiator) that runs the scenario in tent_host.cpp and asks this
driver to check the targets' memory byte for byte, to kill B, and to restart
B on the same port. Skipped, with the reason, where the native provider or a
compiler is missing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from mpcomm.tent.build import compile_host, native_status

HERE = Path(__file__).resolve().parent
SIZE = 8 << 20


@pytest.fixture(scope="module")
def host_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exe, reason = compile_host(HERE / "tent_host.cpp", tmp_path_factory.mktemp("tent") / "tent_host")
    if exe is None:
        pytest.skip(reason)
    return exe


def _env() -> dict[str, str]:
    import sys

    env = dict(os.environ)
    env.setdefault("MPCOMM_TENT_BIND", "127.0.0.1")
    # The interpreter running the tests, whatever venv last rebuilt an editable tree's core/lib.
    env.setdefault("MPCOMM_PYTHON", sys.executable)
    return env


class Target:
    def __init__(self, exe: Path, name: str, port: int = 0, seed: int = 0) -> None:
        self.name = name
        self.proc = subprocess.Popen([str(exe), "target", f"127.0.0.1:{name}", str(port), str(SIZE), str(seed)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
        line = self._line(60)
        assert line.startswith("READY"), line
        _, port_s, addr, _size = line.split()
        self.port, self.addr = int(port_s), int(addr)

    def _line(self, timeout: float) -> str:
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"target {self.name} said nothing in {timeout}s")
        return self.proc.stdout.readline().strip()

    def ask(self, cmd: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._line(60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def quit(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("QUIT")
                self.proc.wait(20)
            except (TimeoutError, BrokenPipeError, subprocess.TimeoutExpired):
                self.kill()


def test_host_makes_tents_calls_between_processes(host_exe: Path) -> None:
    a, b = Target(host_exe, "A", seed=10), Target(host_exe, "B", seed=20)
    init = subprocess.Popen([str(host_exe), "initiator", str(SIZE), "4", "127.0.0.1:A", str(a.port), str(a.addr),
                             "127.0.0.1:B", str(b.port), str(b.addr)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
    targets = {"A": a, "B": b}
    steps: list[str] = []
    try:
        assert init.stdout is not None and init.stdin is not None
        deadline = time.monotonic() + 240
        for raw in init.stdout:
            line = raw.strip()
            assert time.monotonic() < deadline, "the scenario took too long"
            if line.startswith("STEP"):
                steps.append(line)
                continue
            if line == "DONE" or line.startswith("FAIL"):
                steps.append(line)
                break
            if not line.startswith("REQ "):
                continue
            req = line[4:].split()
            if req[0] == "VERIFY":
                reply = targets[req[1]].ask("VERIFY " + " ".join(req[2:]))
            elif req[0] == "KILL":
                targets[req[1]].kill()
                reply = "OK"
            elif req[0] == "RESTART":
                old = targets[req[1]]
                targets[req[1]] = Target(host_exe, req[1], port=old.port, seed=30)
                reply = f"OK {targets[req[1]].addr}"
            else:
                reply = "UNKNOWN"
            init.stdin.write(reply + "\n")
            init.stdin.flush()
        rc = init.wait(60)
    finally:
        if init.poll() is None:
            init.kill()
        for t in targets.values():
            t.quit()
    print("\n".join(steps))
    assert steps and steps[-1] == "DONE", steps
    assert rc == 0
    for name in ("init+register", "connect+query", "putAsync", "getAsync", "out-of-range", "released handle",
                 "scatterAsync", "broadcastAsync", "gatherAsync", "dead peer", "restarted peer", "shutdown with"):
        assert any(name in s for s in steps), name


def test_codes_agree_with_header() -> None:
    """include/mpcomm.h and mpcomm.tent.codes carry the same numbers."""
    import re

    from mpcomm.tent import codes

    header = (Path(__file__).resolve().parents[2] / "tent" / "native" / "mpcomm.h").read_text()
    found = dict(re.findall(r"constexpr int MPCOMM_(\w+) = (-?\d+);", header))
    assert found.pop("SUCCESS") == "0"
    assert found, "no codes parsed"
    for name, value in found.items():
        assert getattr(codes, name) == int(value), name
    assert set(found) == {k for k in vars(codes) if k.startswith("ERR_")}


def test_installed_root_is_a_valid_mpcomm_root() -> None:
    st = native_status()
    if not st["built"]:
        pytest.skip(st["reason"])
    root = Path(st["root"])
    assert (root / "include" / "mpcomm.h").is_file()
    assert (root / "lib" / "libmpcomm.so").exists()
    out = subprocess.run(["readelf", "-d", str(root / "lib" / "libmpcomm.so")], capture_output=True, text=True)
    if out.returncode == 0:
        assert "Library soname: [libmpcomm.so.1]" in out.stdout
    assert (root / "lib" / "cmake" / "mpcomm" / "mpcommConfigVersion.cmake").is_file()


def test_host_that_already_runs_python(tmp_path: Path) -> None:
    """The library uses the host's interpreter and releases the GIL the host holds while waiting."""
    import sys

    exe, reason = compile_host(HERE / "tent_host.cpp", tmp_path / "tent_pyhost", embed_python=True)
    if exe is None:
        pytest.skip(reason)
    env = dict(_env(), MPCOMM_TRANSPORTS="tcp")  # completion on another thread, not inline
    proc = subprocess.run([str(exe), "pyhost", sys.executable], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("DONE"), proc.stdout + proc.stderr


def test_doctor_reports_the_provider() -> None:
    from mpcomm.tent.doctor import native_provider_check

    check = native_provider_check()
    st = native_status()
    assert (check.status.value in ("pass", "warn")) == st["built"]
    if not st["built"]:
        assert st["reason"] in check.value


def test_a_python_without_mpcomm_is_an_error_code_not_a_crash(host_exe: Path, tmp_path: Path) -> None:
    """MPCOMM_PYTHON naming an environment without mpcomm: init returns MPCOMM_ERR_RUNTIME with the reason."""
    import sys
    import venv

    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)
    base_python = getattr(sys, "_base_executable", sys.executable)
    py = bare / "bin" / "python3"
    if not py.exists():
        pytest.skip(f"venv made no interpreter from {base_python}")
    env = dict(_env(), MPCOMM_PYTHON=str(py))  # overrides the default above
    proc = subprocess.run([str(host_exe), "target", "127.0.0.1:x", "0", "4096", "0"], capture_output=True,
                          text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL target init" in proc.stdout and "last error -13" in proc.stdout, proc.stdout
    assert "mpcomm.tent._bridge" in proc.stdout + proc.stderr


def test_a_vanished_interpreter_is_an_error_code(host_exe: Path, tmp_path: Path) -> None:
    env = dict(_env(), MPCOMM_PYTHON=str(tmp_path / "gone" / "python3"))
    proc = subprocess.run([str(host_exe), "target", "127.0.0.1:x", "0", "4096", "0"], capture_output=True,
                          text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 1 and "last error -13" in proc.stdout and "does not exist" in proc.stdout, proc.stdout


def test_a_peer_killed_during_a_put_is_an_error_code_not_sigpipe(host_exe: Path) -> None:
    """A C++ host (SIGPIPE at its default, as a C++ program has it) puts over tcp while its peer is SIGKILLed.

    Every send to a socket must carry MSG_NOSIGNAL: the library may not change the host's signal
    dispositions, and a send into a reset connection would otherwise kill the host with signal 13.
    Repeated, because the kill has to land while a payload is being sent.
    """
    env = dict(_env(), MPCOMM_TRANSPORTS="tcp")
    for attempt in range(4):
        target = Target(host_exe, f"T{attempt}", seed=attempt)
        init = subprocess.Popen([str(host_exe), "dieput", f"127.0.0.1:T{attempt}", str(target.port),
                                 str(target.addr), str(SIZE)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert init.stdout is not None
            line = init.stdout.readline().strip()
            assert line == "PUTTING", line + (init.stderr.read() if init.stderr else "")
            time.sleep(0.05 * attempt)  # land the kill at different points of a put
            target.kill()
            out, err = init.communicate(timeout=90)
        finally:
            if init.poll() is None:
                init.kill()
            target.quit()
        assert init.returncode != -signal.SIGPIPE, f"attempt {attempt}: the host died of SIGPIPE\n{err[-2000:]}"
        assert init.returncode == 0, f"attempt {attempt}: rc {init.returncode}\n{out}\n{err[-2000:]}"
        assert out.strip().startswith("ERR -"), out
