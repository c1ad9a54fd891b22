"""Finding and loading transport plugins.

Plugins come from the ``mpcomm.transports`` entry-point group (the in-tree
tcp, shm, ucx and rdma_zerocopy transports included, exactly like third-party
ones) and from objects passed explicitly. Environment switches:

* ``MPCOMM_PLUGINS=tcp,shm`` — allow-list of entry-point names to load;
* ``MPCOMM_DISABLE_PLUGIN_AUTOLOAD=1`` — load no entry points at all (only
  plugins passed to :func:`load_plugins` / ``Engine(plugins=...)``).

A plugin that fails to import, or whose hook raises or registers something
that is not a valid transport, is reported (:class:`PluginFailure`: its name,
distribution and reason) and skipped; start-up goes on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from . import hookspecs
from .transport import Transport, contract_problems

__all__ = ["ENTRY_POINT_GROUP", "PluginFailure", "PluginSet", "load_plugins"]

ENTRY_POINT_GROUP = "mpcomm.transports"
log = logging.getLogger("mpcomm.plugins")


@dataclass(frozen=True)
class PluginFailure:
    name: str
    distribution: str
    reason: str


@dataclass
class TransportEntry:
    cls: type[Transport]
    plugin: str
    distribution: str
    version: str


@dataclass
class PluginSet:
    """Everything the loaders found: transports by name, and failures."""

    transports: dict[str, TransportEntry] = field(default_factory=dict)
    failures: list[PluginFailure] = field(default_factory=list)
    manager: pluggy.PluginManager | None = None


def _allow_list() -> set[str] | None:
    raw = os.environ.get("MPCOMM_PLUGINS", "").strip()
    if not raw:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def _autoload_disabled() -> bool:
    return os.environ.get("MPCOMM_DISABLE_PLUGIN_AUTOLOAD", "").strip().lower() in ("1", "true", "yes")


def _entry_points() -> list[metadata.EntryPoint]:
    eps = metadata.entry_points()
    if hasattr(eps, "select"):
        return list(eps.select(group=ENTRY_POINT_GROUP))
    return list(eps.get(ENTRY_POINT_GROUP, []))  # type: ignore[attr-defined]  # pragma: no cover


def load_plugins(extra: Iterable[Any] = (), *, autoload: bool | None = None) -> PluginSet:
    """Load entry-point plugins (unless disabled) plus ``extra`` plugin objects."""
    pm = pluggy.PluginManager("mpcomm")
    pm.add_hookspecs(hookspecs)
    result = PluginSet(manager=pm)
    sources: list[tuple[str, str, str, Any]] = []  # (name, dist, version, plugin object)

    if autoload is None:
        autoload = not _autoload_disabled()
    if autoload:
        allow = _allow_list()
        seen: set[str] = set()
        for ep in _entry_points():
            if allow is not None and ep.name not in allow:
                continue
            if ep.name in seen:
                continue  # the same distribution found twice on sys.path
            seen.add(ep.name)
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else "?"
            dist_version = dist.version if dist is not None else "?"
            try:
                obj = ep.load()
            except Exception as exc:  # noqa: BLE001 - any import failure disables only that plugin
                result.failures.append(PluginFailure(ep.name, dist_name, f"import failed: {type(exc).__name__}: {exc}"))
                log.warning("transport plugin %s (%s) failed to load: %s", ep.name, dist_name, exc)
                continue
            sources.append((ep.name, dist_name, dist_version, obj))
    for obj in extra:
        name = getattr(obj, "__name__", type(obj).__name__)
        sources.append((name, "(explicit)", "", obj))

    for name, dist_name, version, obj in sources:
        registered: list[type[Transport]] = []
        try:
            pm.register(obj, name=f"{name}@{dist_name}")
            unknown = sorted(hc.name for hc in (pm.get_hookcallers(obj) or []) if hc.spec is None)
            if unknown:
                problem = (f"unknown hook {', '.join(unknown)} (known: "
                           f"{', '.join(n for n in dir(hookspecs) if n.startswith('mpcomm_'))})")
                result.failures.append(PluginFailure(name, dist_name, problem))
                log.warning("transport plugin %s (%s): %s", name, dist_name, problem)
                _unregister(pm, obj)
                continue
            impl = [i for i in pm.hook.mpcomm_register_transports.get_hookimpls() if i.plugin is obj]
            for hi in impl:
                hi.function(register=registered.append)
        except Exception as exc:  # noqa: BLE001
            result.failures.append(PluginFailure(name, dist_name, f"hook failed: {type(exc).__name__}: {exc}"))
            log.warning("transport plugin %s (%s) failed: %s", name, dist_name, exc)
            _unregister(pm, obj)
            continue
        for cls in registered:
            problem = _validate(cls, result)
            if problem:
                result.failures.append(PluginFailure(name, dist_name, problem))
                log.warning("transport plugin %s (%s): %s", name, dist_name, problem)
                continue
            result.transports[cls.name] = TransportEntry(cls, name, dist_name, version)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        result.failures.append(PluginFailure("?", "?", f"unknown hook: {exc}"))
    return result


def _unregister(pm: pluggy.PluginManager, obj: Any) -> None:
    try:
        pm.unregister(obj)
    except Exception:  # noqa: BLE001
        pass


def _validate(cls: Any, found: PluginSet) -> str:
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        return f"registered {cls!r}, which is not a mpcomm.Transport subclass"
    if not isinstance(cls.name, str) or not cls.name:
        return f"{cls.__qualname__} has no name"
    if cls.name in found.transports:
        return f"transport name {cls.name!r} already registered by plugin {found.transports[cls.name].plugin}"
    problems = contract_problems(cls)
    if problems:
        return f"{cls.__qualname__} breaks the transport contract: {'; '.join(problems)}"
    return ""
