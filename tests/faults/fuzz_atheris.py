"""Coverage-guided fuzzing (atheris) of the parsers that read peers' bytes: ``python fuzz_atheris.py TARGET [libFuzzer args]``.

TARGET is ``frame`` (mpcomm.wire.read_frame + parse_json over a real socket
pair, as the control endpoint reads a frame) or ``descriptor``
(RemoteRegion.from_bytes). The property: a ProtocolError / MpcommError or a
result, nothing else. Any other exception is a crash: atheris prints the input
and exits non-zero. Run bounded, e.g. ``-max_total_time=3``.
"""

from __future__ import annotations

import socket
import sys

import atheris

with atheris.instrument_imports(include=["mpcomm.wire", "mpcomm.remote"]):
    from mpcomm import remote, wire
    from mpcomm.errors import MpcommError


def fuzz_frame(data: bytes) -> None:
    a, b = socket.socketpair()
    try:
        a.sendall(data[:60000])
        a.shutdown(socket.SHUT_WR)
        try:
            ftype, _flags, payload = wire.read_frame(b, wire.CONTROL_MAGIC, 1 << 16)
            if ftype == wire.T_JSON:
                wire.parse_json(payload)
        except (MpcommError, ConnectionError):
            pass  # EOF mid-frame is a PeerConnectionError or ConnectionError: both clear
    finally:
        a.close()
        b.close()


def fuzz_descriptor(data: bytes) -> None:
    try:
        remote.RemoteRegion.from_bytes(data)
    except MpcommError:
        pass


def main() -> None:
    target = {"frame": fuzz_frame, "descriptor": fuzz_descriptor}[sys.argv[1]]
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
