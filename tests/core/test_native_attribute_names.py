"""No native code of the project reads, sets or calls a Python attribute by name (issue 28 item 5).

Why a grep: C that names a Python attribute (``PyObject_GetAttrString(o, "_refusing")``) is
a second, unchecked copy of that name. Renaming the attribute in Python breaks the C at run
time only, on whatever path reaches the lookup (the fast lane's was the hottest there is),
and nothing in Python shows the coupling. So the native code takes what it reads and calls
as objects handed to it at bind or setup time (probes, descriptors, callables: see
core/engine/bound.py native_step, core/memory.py LEASE_SLOTS and LEASE_WAKE, core/transfer.py Landed.FIELDS,
tent/_bridge.py open_bridge), and this test keeps every C/C++ source of the project,
tests' included, free of the CPython calls that take an attribute name.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = {".c", ".cc", ".cpp", ".cxx", ".h", ".hpp"}
#: The CPython API calls that look up, test, set, delete or call an attribute by its name.
BY_NAME = re.compile(r"\b(_?PyObject_(?:GetAttr|GetAttrString|GetOptionalAttr|GetOptionalAttrString|LookupAttr"
                     r"|LookupAttrId|HasAttr|HasAttrString|HasAttrWithError|HasAttrStringWithError|SetAttr"
                     r"|SetAttrString|DelAttr|DelAttrString|GenericGetAttr|GenericSetAttr|CallMethod\w*"
                     r"|VectorcallMethod))\s*\(")


def _sources() -> list[Path]:
    out = []
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT).parts
        if p.suffix in SUFFIXES and p.is_file() and not any(x.startswith(".") or x == "build" for x in rel):
            out.append(p)
    return sorted(out)


def offending(text: str) -> list[str]:
    """The by-name calls in ``text``, one ``line: code`` each."""
    return [f"{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1) if BY_NAME.search(line)]


def test_the_pattern_finds_what_it_must() -> None:
    for call in ['PyObject_GetAttrString(o, "_refusing")', "PyObject_GetAttr(o, s_alive)",
                 'PyObject_CallMethod(b, "query", "i", 1)', "PyObject_CallMethodNoArgs(local, s_wake)",
                 "PyObject_VectorcallMethod(name, args, 7, NULL)", "PyObject_SetAttr(h, s_origin, v)",
                 "_PyObject_LookupAttr(o, n, &r)", "PyObject_HasAttrString(o, \"x\")"]:
        assert offending(call), call
    assert not offending("PyObject_Vectorcall(f, args, 3, NULL); PyObject_CallOneArg(probe, o);")


def test_no_native_source_names_a_python_attribute() -> None:
    sources = _sources()
    names = {p.name for p in sources}
    assert {"_fastlane.c", "_dataport.c", "mpcomm.cpp"} <= names, names  # the walk found the sources
    found = {str(p.relative_to(ROOT)): hits for p in sources if (hits := offending(p.read_text(errors="replace")))}
    assert not found, found
