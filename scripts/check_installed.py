"""Check an installed mpcomm (a wheel's, typically): helpers present, an engine moves bytes, provider laid out.

``python scripts/check_installed.py [--allow-missing]``: run from anywhere but the
source checkout (so that the installed package is the one imported). Exits 1 with
the reasons when a compiled helper is missing (unless ``--allow-missing``), when a
write between two engines over loopback tcp does not land, or when the MPComm
provider is not laid out under the package directory. cibuildwheel runs it as the
test of every wheel it builds (pyproject.toml, docs/packaging.md); the wheel test in
tests/newcomer/test_packaging.py runs it in a venv without a compiler.
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--allow-missing", action="store_true", help="a missing compiled helper is not a failure")
    args = ap.parse_args()
    import mpcomm
    from mpcomm import native_helper
    from mpcomm.tent.build import native_status

    problems = []
    missing = native_helper.missing()
    if missing and not args.allow_missing:
        problems.append(f"compiled helpers missing: {missing}")
    with mpcomm.Engine(transports=["tcp"], endpoint="127.0.0.1:0") as target, \
            mpcomm.Engine(transports=["tcp"], endpoint="127.0.0.1:0") as ini:
        region = target.allocate(1 << 16, name="buf")
        remote = ini.open(target.address, "buf")
        data = bytes(range(256)) * 16
        if ini.write(data, remote, 128).result(30) != len(data) or bytes(region.view[128:128 + len(data)]) != data:
            problems.append("a tcp write between two engines did not land")
    st = native_status()
    if not st["built"]:
        problems.append(f"MPComm provider not built: {st['reason']}")
    print(json.dumps({"mpcomm": mpcomm.__file__, "missing_helpers": missing, "provider": st}, indent=1))
    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
