"""No module reads another module's private attributes (issue 28, item 5).

The rule, checked with ``ast`` over every ``.py`` file of ``core/``, ``plugins/``,
``cli/`` and ``tent/``:

* An attribute access ``x._name`` (read, write or delete), or ``getattr``/
  ``setattr``/``hasattr``/``delattr`` with the constant ``"_name"``, where ``x`` is
  not ``self``, ``cls`` or ``super()`` and ``_name`` is not a dunder, must name
  something *defined in the same module*: a function or class of that name, a
  name assigned at module level or in a class body, a ``__slots__`` entry, or an
  attribute the module assigns on ``self``/``cls``.
* ``from <project module> import _name`` of a private name that is not itself a
  module (a package's private submodule, such as ``from . import _native``, is
  the package's own) breaks the same rule.

What another module needs gets a public name, documented where it is declared,
or the code moves to the module that owns the attribute. ``ALLOWED`` lists only
what is outside the project, each with its reason.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("core", "plugins", "cli", "tent")

#: (file relative to the repository, private name) -> why it is not the project's own.
ALLOWED: dict[tuple[str, str], str] = {
    ("cli/nodecheck.py", "_exit"): "os._exit: the standard library's documented exit of a forked child",
    ("core/telemetry.py", "_done_callbacks"): "concurrent.futures.Future's own callback list (Transfer's "
                                              "standard-library base class), read by the telemetry bridge",
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined(tree: ast.Module) -> set[str]:
    """Every name the module defines as an attribute or top-level name (see the module docstring)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                for target in _targets(stmt):
                    if isinstance(target, ast.Name):
                        names.add(target.id)
                        if target.id == "__slots__":
                            names.update(c.value for c in ast.walk(stmt) if isinstance(c, ast.Constant)
                                         and isinstance(c.value, str))
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in _targets(node):
                for sub in ast.walk(target):
                    if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                            and sub.value.id in ("self", "cls")):
                        names.add(sub.attr)
    for stmt in tree.body:
        for target in _targets(stmt):
            for sub in ast.walk(target):
                if isinstance(sub, ast.Name):
                    names.add(sub.id)
    return names


def _targets(stmt: ast.AST) -> list[ast.expr]:
    if isinstance(stmt, ast.Assign):
        return stmt.targets
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        return [stmt.target]
    return []


def _own(value: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object's own attributes."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"


def _is_module(path: Path, node: ast.ImportFrom, name: str) -> bool:
    base = path.parent
    for _ in range(max(node.level - 1, 0)):
        base = base.parent
    if node.level == 0:  # mpcomm.x.y -> the tree it maps to is not resolved here: treat as a name
        return False
    where = base.joinpath(*(node.module or "").split(".")) if node.module else base
    return ((where / f"{name}.py").exists() or (where / name / "__init__.py").exists()
            or any(where.glob(f"{name}.*.so")) or any(where.glob(f"{name}.c")))


def violations(path: Path, source: str) -> Iterator[tuple[int, str, str]]:
    """(line, private name, code) for each access that breaks the rule in ``source``."""
    tree = ast.parse(source)
    defined = _defined(tree)
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and not _own(node.value):
            name = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and not _own(node.args[0])):
            name = node.args[1].value
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("mpcomm")):
            for alias in node.names:
                if _is_private(alias.name) and not _is_module(path, node, alias.name):
                    yield node.lineno, alias.name, f"from {'.' * node.level}{node.module or ''} import {alias.name}"
            continue
        if name is not None and _is_private(name) and name not in defined:
            yield node.lineno, name, ast.unparse(node)[:80]


def _sources() -> Iterator[Path]:
    for tree in TREES:
        yield from sorted((ROOT / tree).rglob("*.py"))


def test_no_module_reads_another_modules_private_attributes() -> None:
    found = []
    used_allowances = set()
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        for line, name, code in violations(path, path.read_text(encoding="utf-8")):
            if (rel, name) in ALLOWED:
                used_allowances.add((rel, name))
                continue
            found.append(f"{rel}:{line}: {code}  ({name} is not defined in {rel})")
    assert not found, ("private attributes of other modules (give them a public, documented name, or move "
                       "the code to the module that owns them):\n" + "\n".join(found))
    assert used_allowances == set(ALLOWED), f"stale allowances: {set(ALLOWED) - used_allowances}"


def test_the_rule_catches_what_it_says_and_passes_what_it_allows(tmp_path: Path) -> None:
    bad = (
        "from ..transfer import _Dispatch\n"
        "def f(engine, op):\n"
        "    engine._closed\n"
        "    op._stage = 1\n"
        "    return getattr(op, '_probe', None)\n"
    )
    got = sorted(name for _, name, _ in violations(tmp_path / "m.py", bad))
    assert got == ["_Dispatch", "_closed", "_probe", "_stage"]
    good = (
        "from . import _native\n"
        "_cache = {}\n"
        "class A:\n"
        "    __slots__ = ('_x',)\n"
        "    _default = 0\n"
        "    def __init__(self):\n"
        "        self._y = 1\n"
        "        super()._z()\n"
        "    def _m(self): pass\n"
        "def g(a, b):\n"
        "    return a._x, a._y, a._default, b._m(), a.__class__, _cache\n"
    )
    (tmp_path / "_native.py").write_text("")
    assert list(violations(tmp_path / "m.py", good)) == []
