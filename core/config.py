"""Configuration: a TOML file mirroring the design document's example.

::

    [transport]
    name = "auto"              # or one transport's name ("tcp", "shm", ...)
    order = ["shm", "rdma_zerocopy", "ucx", "tcp"]   # preference when name = "auto"
    mode = "zero-copy"         # or "copy" (bounce buffers; for comparison)
    endpoint = "0.0.0.0:18400" # control endpoint; port 0 picks a free one
    advertise = ""             # host peers dial, when endpoint binds a wildcard
    secret = ""                # shared secret (HMAC handshake); or MPCOMM_SECRET
    handshake_timeout_ms = 5000

    [memory]
    types = ["host", "device"]
    registration = "eager"     # or "lazy": transports register on first use
    alignment = 4096

    [runtime]
    worker_threads = 8
    queue_depth = 1024
    request_timeout_ms = 5000
    backpressure = "block"     # or "raise"
    abort_grace_ms = 2000

    [observability]
    metrics = true
    trace_transfers = false

    [plugins.tcp]              # per-transport options (each transport lists its keys)
    connections = 4

Unknown keys and bad values raise :class:`~mpcomm.ConfigError` naming the key
and the file. ``Config()`` is the embedded default: loopback endpoint on a free
port, no metadata service, no secret.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Config", "load_config"]

DEFAULT_ORDER = ["shm", "rdma_zerocopy", "ucx", "tcp"]


@dataclass(frozen=True)
class TransportSection:
    name: str = "auto"
    order: tuple[str, ...] = tuple(DEFAULT_ORDER)
    mode: str = "zero-copy"
    endpoint: str = "127.0.0.1:0"
    advertise: str = ""
    secret: str = ""
    handshake_timeout_ms: int = 5000


@dataclass(frozen=True)
class MemorySection:
    types: tuple[str, ...] = ("host",)
    registration: str = "eager"
    alignment: int = 1


@dataclass(frozen=True)
class RuntimeSection:
    worker_threads: int = 8
    queue_depth: int = 1024
    request_timeout_ms: int = 5000
    backpressure: str = "block"
    abort_grace_ms: int = 2000
    notify_queue: int = 1024


@dataclass(frozen=True)
class ObservabilitySection:
    metrics: bool = False
    trace_transfers: bool = False


_SECTIONS = {
    "transport": TransportSection,
    "memory": MemorySection,
    "runtime": RuntimeSection,
    "observability": ObservabilitySection,
}

_CHOICES = {
    ("transport", "mode"): ("zero-copy", "copy"),
    ("memory", "registration"): ("eager", "lazy"),
    ("runtime", "backpressure"): ("block", "raise"),
}


@dataclass(frozen=True)
class Config:
    """The whole configuration; ``Config()`` is the embedded default."""

    transport: TransportSection = field(default_factory=TransportSection)
    memory: MemorySection = field(default_factory=MemorySection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    observability: ObservabilitySection = field(default_factory=ObservabilitySection)
    plugins: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: str = "<defaults>"

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Config:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_bytes().decode("utf-8"))  # TOML is UTF-8 whatever the locale
        except FileNotFoundError as exc:
            raise ConfigError(f"{p}: config file not found") from exc
        except OSError as exc:
            raise ConfigError(f"{p}: cannot read config file: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: not UTF-8 ({exc})") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from exc
        return cls.from_dict(data, source=str(p))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> Config:
        kwargs: dict[str, Any] = {"source": source}
        for key, value in data.items():
            if key == "plugins":
                if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
                    raise ConfigError(f"{source}: [plugins] must hold one table per transport")
                kwargs["plugins"] = {k: dict(v) for k, v in value.items()}
                continue
            section_cls = _SECTIONS.get(key)
            if section_cls is None:
                raise ConfigError(f"{source}: unknown section [{key}] (known: {', '.join([*_SECTIONS, 'plugins'])})")
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: [{key}] must be a table")
            kwargs[key] = _build_section(key, section_cls, value, source)
        return cls(**kwargs)

    def with_overrides(self, **sections: dict[str, Any]) -> Config:
        """A copy with some keys replaced, validated like a file: ``with_overrides(runtime={"queue_depth": 8})``."""
        new = self
        for key, values in sections.items():
            if key == "plugins":
                merged = {k: dict(v) for k, v in self.plugins.items()}
                for name, opts in values.items():
                    merged.setdefault(name, {}).update(opts)
                new = replace(new, plugins=merged)
                continue
            section_cls = _SECTIONS.get(key)
            if section_cls is None:
                raise ConfigError(f"{self.source}: unknown section [{key}]")
            current = {f.name: getattr(getattr(new, key), f.name) for f in fields(section_cls)}
            current.update(values)
            new = replace(new, **{key: _build_section(key, section_cls, current, self.source)})
        return new

    def plugin_options(self, name: str, defaults: dict[str, Any]) -> dict[str, Any]:
        """``[plugins.<name>]`` merged over ``defaults``; unknown keys are errors."""
        given = self.plugins.get(name, {})
        unknown = sorted(set(given) - set(defaults))
        if unknown:
            raise ConfigError(
                f"{self.source}: unknown key plugins.{name}.{unknown[0]} (known: {', '.join(sorted(defaults)) or 'none'})"
            )
        out = dict(defaults)
        for k, v in given.items():
            if defaults[k] is not None and not isinstance(v, type(defaults[k])) and not (
                isinstance(defaults[k], float) and isinstance(v, int)
            ):
                raise ConfigError(
                    f"{self.source}: plugins.{name}.{k} must be {type(defaults[k]).__name__}, not {type(v).__name__}"
                )
            out[k] = v
        return out

    @property
    def request_timeout(self) -> float:
        return self.runtime.request_timeout_ms / 1000.0


def _build_section(key: str, section_cls: type, values: dict[str, Any], source: str) -> Any:
    known = {f.name: f for f in fields(section_cls)}
    out: dict[str, Any] = {}
    for name, value in values.items():
        f = known.get(name)
        if f is None:
            raise ConfigError(f"{source}: unknown key {key}.{name} (known: {', '.join(known)})")
        default = f.default
        where = f"{source}: {key}.{name}"
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{where} must be true or false, not {value!r}")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{where} must be an integer, not {value!r}")
            if value < 0 or (value == 0 and name not in ()):
                raise ConfigError(f"{where} must be positive, not {value}")
        elif isinstance(default, str):
            if not isinstance(value, str):
                raise ConfigError(f"{where} must be a string, not {value!r}")
        elif isinstance(default, tuple):
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{where} must be a list of strings, not {value!r}")
            value = tuple(value)
        choices = _CHOICES.get((key, name))
        if choices and value not in choices:
            raise ConfigError(f"{where} must be one of {', '.join(choices)}, not {value!r}")
        out[name] = value
    if key == "memory":
        alignment = out.get("alignment", 1)
        if alignment & (alignment - 1):
            raise ConfigError(f"{source}: memory.alignment must be a power of two, not {alignment}")
        bad = [t for t in out.get("types", ()) if t not in ("host", "device")]
        if bad:
            raise ConfigError(f"{source}: memory.types may hold 'host' and 'device', not {bad[0]!r}")
    if key == "transport" and "endpoint" in out:
        from .peer import parse_endpoint

        try:
            parse_endpoint(out["endpoint"])
        except ValueError as exc:
            raise ConfigError(f"{source}: transport.endpoint: {exc}") from exc
    return section_cls(**out)


def load_config(config: Config | str | os.PathLike[str] | dict[str, Any] | None) -> Config:
    """Accept a Config, a TOML path, a dict, or None (embedded default)."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return Config.from_dict(config)
    return Config.load(config)
