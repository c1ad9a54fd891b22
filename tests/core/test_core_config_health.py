"""[health]: read from the file into the engine's HealthPolicy and connect back-off; bad values name the key."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

import mpcomm
from mpcomm import Config, ConfigError
from mpcomm.config import RANGES, HealthSection
from mpcomm.errors import PeerConnectionError
from mpcomm.health import HealthPolicy

HEALTH_TOML = """\
[health]
pause_after = 2
base_cooldown_ms = 20
max_cooldown_ms = 1500
quarantine_after = 7
max_attempts = 4
connect_backoff_ms = 250
connect_backoff_max_ms = 1000
"""


def test_the_defaults_are_the_health_policy_defaults() -> None:
    """No [health] section: the engine behaves as before the section existed."""
    assert Config().health_policy() == HealthPolicy()
    with mpcomm.Engine(transports=["tcp"]) as e:
        assert e.health.policy == HealthPolicy()


def test_health_keys_are_read_into_the_engine(tmp_path: Path) -> None:
    p = tmp_path / "mpcomm.toml"
    p.write_text(HEALTH_TOML)
    cfg = Config.load(p)
    assert cfg.health.connect_backoff_ms == 250 and cfg.health.connect_backoff_max_ms == 1000
    with mpcomm.Engine(cfg, transports=["tcp"]) as e:
        assert e.health.policy == HealthPolicy(base_cooldown=0.02, max_cooldown=1.5, quarantine_after=7,
                                               max_attempts=4, pause_after=2)
        # The back-off's window is the configured one: seen in the refusal of a closed port.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(PeerConnectionError) as first:
            e.open(address, "kv", timeout=5)
        assert "not connecting to" not in str(first.value)  # this one dialled
        with pytest.raises(PeerConnectionError) as second:
            e.open(address, "kv", timeout=5)
        assert "held back for 0.25s" in str(second.value), str(second.value)
        assert 0 < second.value.retry_after <= 0.25  # type: ignore[attr-defined]


def test_with_overrides_sets_health_keys() -> None:
    cfg = Config().with_overrides(health={"max_attempts": 1, "connect_backoff_ms": 0})
    assert cfg.health_policy().max_attempts == 1 and cfg.health.connect_backoff_ms == 0


@pytest.mark.parametrize("key", [k for (section, k) in RANGES if section == "health"])
def test_out_of_range_health_values_name_the_key_and_the_range(tmp_path: Path, key: str) -> None:
    lo, hi = RANGES[("health", key)]
    for bad in (lo - 1, hi + 1):
        p = tmp_path / "mpcomm.toml"
        p.write_text(f"[health]\n{key} = {bad}\n")
        with pytest.raises(ConfigError) as info:
            Config.load(p)
        msg = str(info.value)
        assert str(p) in msg and f"health.{key}" in msg and f"between {lo} and {hi}" in msg, msg


@pytest.mark.parametrize(("values", "names"), [
    ({"max_attempts": "3"}, "health.max_attempts must be an integer"),
    ({"pause_after": True}, "health.pause_after must be an integer"),
    ({"quarantine_after": 2.5}, "health.quarantine_after must be an integer"),
    ({"connect_backoff": 100}, "unknown key health.connect_backoff (known: "),
    ({"base_cooldown_ms": 500, "max_cooldown_ms": 100},
     "health.max_cooldown_ms must be at least health.base_cooldown_ms (500), not 100"),
    ({"connect_backoff_ms": 3000}, "health.connect_backoff_max_ms must be at least health.connect_backoff_ms (3000)"),
])
def test_bad_health_values_are_refused_naming_the_key(values: dict, names: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_dict({"health": values})
    assert names in str(info.value), str(info.value)
    with pytest.raises(ConfigError) as info:  # the same checks through with_overrides
        Config().with_overrides(health=values)
    assert names in str(info.value), str(info.value)


def test_the_example_config_documents_every_health_key() -> None:
    example = Path(__file__).resolve().parents[2] / "docs" / "tent-transport.example.toml"
    cfg = Config.load(example)
    assert cfg.health == HealthSection()  # written out with the defaults
    text = example.read_text()
    for (section, key) in RANGES:
        if section == "health":
            assert f"\n{key} = " in text, f"health.{key} is missing from {example.name}"
