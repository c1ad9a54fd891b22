"""A target whose interpreter is busy: ``python -m mpcomm.testing.spinning CONFIG_JSON TRANSPORTS_JSON``.

The process builds an engine from CONFIG (JSON, ``null`` for the defaults) on
TRANSPORTS, registers a 1 MiB bytearray as ``"kv"``, prints its address, and
waits for one line on stdin (the initiator has attached while the target was
idle). Then a thread spins in Python for ever with a 10 s switch interval, so
any other thread that wants the GIL waits about 10 s for it: only work served
without the GIL (a native data port, a native progress loop) reaches the
region meanwhile. It prints ``spinning`` once the spin has begun.

:class:`SpinningTarget` runs it from a test::

    with SpinningTarget({"plugins": {"tcp": {"connections": 1}}}, ["tcp"]) as target:
        remote = initiator.open(target.address, "kv", timeout=10)
        ...                          # attach and measure while idle
        target.spin()                # from here the target's Python holds the GIL
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["SpinningTarget"]


class SpinningTarget:
    """The spinning target in a child process; a context manager that kills it on exit."""

    def __init__(self, config: dict[str, Any] | None, transports: Sequence[str],
                 env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mpcomm.testing.spinning", json.dumps(config), json.dumps(list(transports))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        #: the target engine's address (its region is ``"kv"``, 1 MiB)
        self.address = self._line()

    def _line(self) -> str:
        return self.proc.stdout.readline().strip()  # type: ignore[union-attr]

    def spin(self, settle: float = 0.2) -> None:
        """Start the spin; return once it runs and ``settle`` seconds later (the spinner has the GIL)."""
        self.proc.stdin.write("go\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        line = self._line()
        if line != "spinning":
            raise RuntimeError(f"the spinning target answered {line!r} (exit status {self.proc.poll()})")
        time.sleep(settle)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> SpinningTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str]) -> int:
    import mpcomm

    engine = mpcomm.Engine(json.loads(argv[1]), transports=json.loads(argv[2]))
    engine.register(bytearray(1 << 20), name="kv")
    print(engine.address, flush=True)
    sys.stdin.readline()  # the initiator has attached (control channel, Python)

    def spin() -> None:
        print("spinning", flush=True)
        while True:  # never releases the GIL but every 10 s, when asked
            pass

    sys.setswitchinterval(10)  # a thread waiting for the GIL asks for it after 10 s
    threading.Thread(target=spin, daemon=True).start()
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
