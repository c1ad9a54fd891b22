"""Plugin loading: broken plugins are reported and skipped, the allow-list and autoload
switch work, unavailable transports say why, and no native library is imported early."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import pytest
from core_support import plugin_module

import mpcomm
import mpcomm.plugins.tcp
from mpcomm import Availability, Transport
from mpcomm.registry import PluginFailure, load_plugins


def hook_module(name: str, body: Any) -> Any:
    """A plugin module whose ``mpcomm_register_transports`` hook is ``body``."""
    import types

    mod = types.ModuleType(name)
    mod.mpcomm_register_transports = mpcomm.hookimpl(body)  # type: ignore[attr-defined]
    return mod


def _raising(register: Any) -> None:
    raise RuntimeError("boom in the hook")


def _lazy_import_fails(register: Any) -> None:
    import mpcomm_no_such_native_lib  # type: ignore[import-not-found]  # noqa: F401


def _not_a_transport(register: Any) -> None:
    register(int)


class DuplicateTcp(Transport):
    name: ClassVar[str] = "tcp"


class Nameless(Transport):
    name: ClassVar[str] = ""


class _Fake(Transport):
    """What every fake here shares: a post, the one method the contract requires."""

    def post(self, op: Any) -> None:
        op.fail(mpcomm.MpcommError(f"{self.name} is a fake"))


class Unavailable(_Fake):
    name: ClassVar[str] = "nope"

    @classmethod
    def availability(cls) -> Availability:
        return Availability.no("libnope is not installed")


class AvailabilityRaises(_Fake):
    name: ClassVar[str] = "crashy"

    @classmethod
    def availability(cls) -> Availability:
        raise OSError("cannot read /sys/class/nope")


class StartFails(_Fake):
    name: ClassVar[str] = "nostart"

    def start(self) -> dict[str, Any]:
        raise OSError("address already in use")


def broken_plugins() -> list[Any]:
    return [
        hook_module("raising_plugin", _raising),
        hook_module("lazy_import_plugin", _lazy_import_fails),
        hook_module("not_a_transport_plugin", _not_a_transport),
        plugin_module("duplicate_plugin", DuplicateTcp),
        plugin_module("nameless_plugin", Nameless),
    ]


def failures_by_name(failures: list[PluginFailure]) -> dict[str, PluginFailure]:
    return {f.name: f for f in failures}


def test_broken_plugins_are_reported_and_skipped() -> None:
    found = load_plugins(broken_plugins())
    by = failures_by_name(found.failures)
    assert set(by) == {"raising_plugin", "lazy_import_plugin", "not_a_transport_plugin",
                       "duplicate_plugin", "nameless_plugin"}
    for f in by.values():
        assert f.distribution == "(explicit)"
        assert f.reason
    assert "RuntimeError: boom in the hook" in by["raising_plugin"].reason
    assert "ModuleNotFoundError" in by["lazy_import_plugin"].reason
    assert "mpcomm_no_such_native_lib" in by["lazy_import_plugin"].reason
    assert "not a mpcomm.Transport subclass" in by["not_a_transport_plugin"].reason
    assert "'tcp' already registered" in by["duplicate_plugin"].reason
    assert "no name" in by["nameless_plugin"].reason
    # The real tcp won; the duplicate did not replace it.
    assert found.transports["tcp"].cls is not DuplicateTcp
    assert found.transports["tcp"].distribution == "mpcomm"


def test_engine_starts_with_tcp_despite_broken_plugins(make_engine: Any) -> None:
    target = make_engine(plugins=broken_plugins())
    initiator = make_engine(plugins=broken_plugins())
    assert list(target.transports) == ["tcp"]
    assert len(target.plugin_set.failures) == 5
    target.register(bytearray(64), name="r")
    remote = initiator.open(target.address, "r")
    assert initiator.write(b"x" * 64, remote).result(5) == 64


def test_misspelled_hook_is_reported_with_the_plugin_name() -> None:
    import types

    mod = types.ModuleType("typo_plugin")
    mod.mpcomm_register_transport = mpcomm.hookimpl(lambda register: None)  # type: ignore[attr-defined]
    found = load_plugins([mod], autoload=False)
    assert len(found.failures) == 1
    f = found.failures[0]
    assert "mpcomm_register_transport" in f.reason
    assert f.name == "typo_plugin"
    assert f.distribution == "(explicit)"


def test_unavailable_transport_is_skipped_with_its_reason(make_engine: Any) -> None:
    plugin = plugin_module("mixed_plugin", Unavailable, AvailabilityRaises, StartFails)
    e = make_engine(plugins=[plugin], transports=["nope", "crashy", "nostart", "tcp"])
    assert list(e.transports) == ["tcp"]
    status = {s.name: s for s in e.transport_status()}
    assert status["nope"].running is False
    assert not status["nope"].availability
    assert status["nope"].availability.reason == "libnope is not installed"
    assert status["nope"].plugin == "mixed_plugin"
    assert "cannot read /sys/class/nope" in status["crashy"].availability.reason
    assert "address already in use" in status["nostart"].availability.reason
    assert status["tcp"].running is True and status["tcp"].availability
    assert status["tcp"].capabilities["inflight_cancel"] is True


def test_only_unavailable_transports_means_no_engine() -> None:
    plugin = plugin_module("unavailable_plugin", Unavailable)
    with pytest.raises(mpcomm.TransportUnavailable, match="libnope is not installed"):
        mpcomm.Engine(plugins=[plugin], autoload=False, transports=["nope"])


def test_explicit_plugins_without_autoload() -> None:
    found = load_plugins([mpcomm.plugins.tcp], autoload=False)
    assert set(found.transports) == {"tcp"}
    assert found.failures == []


# -- environment switches, in fresh interpreters -----------------------------------------

PROBE = textwrap.dedent("""
    import json, sys
    import mpcomm
    import mpcomm.plugins.tcp
    from mpcomm.registry import load_plugins
    found = load_plugins()
    out = {"transports": sorted(found.transports),
           "failures": [[f.name, f.distribution, f.reason] for f in found.failures]}
    try:
        with mpcomm.Engine() as e:
            out["engine"] = list(e.transports)
    except mpcomm.MpcommError as exc:
        out["engine"] = type(exc).__name__ + ": " + str(exc)
    with mpcomm.Engine(plugins=[mpcomm.plugins.tcp], transports=["tcp"]) as e:
        out["explicit"] = list(e.transports)
    print(json.dumps(out))
""")


def probe(env: dict[str, str], pythonpath: Path | None = None) -> dict[str, Any]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("MPCOMM_")}
    full.update(env)
    if pythonpath is not None:
        full["PYTHONPATH"] = os.pathsep.join([str(pythonpath), full.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def broken_dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An installed distribution whose entry point names a module that does not import."""
    root = tmp_path_factory.mktemp("site")
    info = root / "broken_transport-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-transport\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[mpcomm.transports]\nbroken = broken_transport_pkg.plugin\n")
    pkg = root / "broken_transport_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "plugin.py").write_text("import a_native_library_that_is_not_there\n")
    return root


def test_default_autoload_finds_in_tree_transports() -> None:
    out = probe({})
    assert {"tcp", "shm", "ucx", "rdma_zerocopy"} <= set(out["transports"])
    assert "tcp" in out["engine"]


def test_broken_entry_point_is_reported_and_engine_starts(broken_dist: Path) -> None:
    out = probe({}, broken_dist)
    failures = {f[0]: f for f in out["failures"]}
    assert "broken" in failures
    _, dist, reason = failures["broken"]
    assert dist == "broken-transport"
    assert "import failed" in reason and "a_native_library_that_is_not_there" in reason
    assert "tcp" in out["engine"]


def test_allow_list(broken_dist: Path) -> None:
    out = probe({"MPCOMM_PLUGINS": "tcp"}, broken_dist)
    assert out["transports"] == ["tcp"]
    assert out["failures"] == []  # the broken one was not even imported
    assert out["engine"] == ["tcp"]


def test_allow_list_with_two_names() -> None:
    out = probe({"MPCOMM_PLUGINS": " tcp , shm "})
    assert out["transports"] == ["shm", "tcp"]


def test_disable_autoload(broken_dist: Path) -> None:
    out = probe({"MPCOMM_DISABLE_PLUGIN_AUTOLOAD": "1"}, broken_dist)
    assert out["transports"] == []
    assert out["failures"] == []
    assert out["engine"].startswith("TransportUnavailable")
    assert out["explicit"] == ["tcp"]  # explicit plugins still load


NATIVE_PROBE = textwrap.dedent("""
    import json, sys
    import mpcomm
    before = sorted(sys.modules)
    with mpcomm.Engine(transports=["tcp"]) as e:
        e.register(bytearray(4096), name="r")
    maps = open("/proc/self/maps").read()
    print(json.dumps({"modules": sorted(sys.modules),
                      "libs": [l for l in ("libibverbs", "libucp", "libucs", "librdmacm") if l in maps]}))
""")


def test_native_libraries_are_not_imported(tmp_path: Path) -> None:
    # Importable stand-ins for the native bindings: if anything imported them
    # at plugin-import or engine-start time, they would show up in sys.modules.
    for pkg in ("pyverbs", "ucp", "ucxx", "libucx"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPCOMM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", NATIVE_PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    loaded = [m for m in out["modules"] if m.split(".")[0] in ("pyverbs", "ucp", "ucxx", "libucx")]
    assert loaded == []
    assert out["libs"] == []
    assert "mpcomm.plugins.tcp" in out["modules"]  # the probe did load plugins


# -- the transport contract, verified at load (core/transport.py TRANSPORT_CONTRACT) --

class _NoPost(Transport):
    name: ClassVar[str] = "nopost"


class _WrongPostArgs(_Fake):
    name: ClassVar[str] = "wrongargs"

    def post(self, operation: Any, extra: int) -> None:  # type: ignore[override]
        pass


class _InstanceAvailability(_Fake):
    name: ClassVar[str] = "instavail"

    def availability(self) -> Availability:  # type: ignore[override]
        return Availability.yes()


class _BadAttributes(_Fake):
    name: ClassVar[str] = "badattrs"
    post_may_block = "yes"  # type: ignore[assignment]
    capabilities = {"one_sided": True}  # type: ignore[assignment]


class _FlexibleOverrides(_Fake):
    """Overrides that take more than the contract passes, with defaults, or *args/**kwargs: accepted."""

    name: ClassVar[str] = "flexible"
    post_may_block = True

    def post(self, op: Any, *, trace: bool = False) -> None:
        super().post(op)

    def post_inline(self, *args: Any, **kwargs: Any) -> bool:
        return False

    def register(self, region: Any, hint: str = "") -> dict[str, Any]:
        return {}


def test_the_registry_verifies_each_transport_against_the_contract() -> None:
    mods = [plugin_module(f"{cls.name}_plugin", cls) for cls in
            (_NoPost, _WrongPostArgs, _InstanceAvailability, _BadAttributes, _FlexibleOverrides)]
    found = load_plugins(mods, autoload=False)
    by = failures_by_name(found.failures)
    assert set(by) == {"nopost_plugin", "wrongargs_plugin", "instavail_plugin", "badattrs_plugin"}
    assert "does not define 'post'" in by["nopost_plugin"].reason
    assert "post() takes 'operation' where the contract passes 'op'" in by["wrongargs_plugin"].reason
    assert "availability must be a classmethod" in by["instavail_plugin"].reason
    assert "post_may_block must be a bool, not 'yes'" in by["badattrs_plugin"].reason
    assert "capabilities must be a Capabilities" in by["badattrs_plugin"].reason
    assert list(found.transports) == ["flexible"]


def test_every_in_tree_transport_keeps_the_contract() -> None:
    from mpcomm.transport import contract_problems

    found = load_plugins(autoload=True)
    assert not found.failures
    for name, entry in found.transports.items():
        assert contract_problems(entry.cls) == [], name


def test_the_contract_table_names_every_public_member_of_the_base_class() -> None:
    from mpcomm.transport import TRANSPORT_CONTRACT

    public = {n for n in vars(Transport) if not n.startswith("_")}
    assert public == set(TRANSPORT_CONTRACT)
