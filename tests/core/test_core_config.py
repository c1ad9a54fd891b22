"""Config: the embedded default, the docs-style TOML file, and errors that name the key and the file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import mpcomm
from mpcomm import Config, ConfigError, load_config

DOCS_TOML = """\
# mirrors the design document's example
[transport]
name = "tcp"
mode = "zero-copy"
endpoint = "0.0.0.0:18400"

[memory]
types = ["host", "device"]
registration = "eager"
alignment = 4096

[runtime]
worker_threads = 8
queue_depth = 1024
request_timeout_ms = 5000

[observability]
metrics = true
trace_transfers = false
"""


def write(tmp_path: Path, text: str, name: str = "mpcomm.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_embedded_default_needs_no_file_and_no_service() -> None:
    cfg = Config()
    assert load_config(None) == cfg
    assert cfg.source == "<defaults>"
    assert cfg.transport.endpoint == "127.0.0.1:0"
    assert cfg.transport.secret == ""
    assert cfg.transport.mode == "zero-copy"
    assert cfg.memory.registration == "eager"
    assert cfg.runtime.queue_depth == 1024
    assert cfg.request_timeout == 5.0


def test_engine_on_embedded_default_listens_on_a_free_loopback_port() -> None:
    with mpcomm.Engine(transports=["tcp"]) as e:
        host, _, port = e.address.rpartition(":")
        assert host == "127.0.0.1"
        assert int(port) > 0


def test_docs_style_toml_loads_every_key(tmp_path: Path) -> None:
    path = write(tmp_path, DOCS_TOML)
    cfg = load_config(path)
    assert cfg.source == str(path)
    assert (cfg.transport.name, cfg.transport.mode, cfg.transport.endpoint) == ("tcp", "zero-copy", "0.0.0.0:18400")
    assert cfg.memory.types == ("host", "device")
    assert cfg.memory.registration == "eager"
    assert cfg.memory.alignment == 4096
    assert (cfg.runtime.worker_threads, cfg.runtime.queue_depth, cfg.runtime.request_timeout_ms) == (8, 1024, 5000)
    assert cfg.observability.metrics is True
    assert cfg.observability.trace_transfers is False
    # A str path works the same as a Path.
    assert load_config(str(path)) == cfg


def test_docs_style_toml_drives_an_engine(tmp_path: Path) -> None:
    path = write(tmp_path, DOCS_TOML)
    with mpcomm.Engine(path, endpoint="127.0.0.1:0") as e:
        assert list(e.transports) == ["tcp"]  # transport.name = "tcp"
        assert e.config.memory.alignment == 4096
        assert e.allocate(5000).address % 4096 == 0


@pytest.mark.parametrize(
    "section, body, key",
    [
        ("[bogus]", "x = 1", "[bogus]"),
        ("[runtime]", "bogus_key = 1", "runtime.bogus_key"),
        ("[runtime]", 'queue_depth = "8"', "runtime.queue_depth"),
        ("[runtime]", "worker_threads = true", "runtime.worker_threads"),
        ("[runtime]", "request_timeout_ms = 0", "runtime.request_timeout_ms"),
        ("[runtime]", "queue_depth = -1", "runtime.queue_depth"),
        ("[runtime]", 'backpressure = "drop"', "runtime.backpressure"),
        ("[transport]", 'mode = "fast"', "transport.mode"),
        ("[transport]", "name = 3", "transport.name"),
        ("[transport]", 'endpoint = "localhost"', "transport.endpoint"),
        ("[transport]", 'endpoint = "127.0.0.1:99999"', "transport.endpoint"),
        ("[transport]", 'endpoint = "::1:80"', "transport.endpoint"),
        ("[memory]", "alignment = 3000", "memory.alignment"),
        ("[memory]", "alignment = 0", "memory.alignment"),
        ("[memory]", 'registration = "sometimes"', "memory.registration"),
        ("[memory]", 'types = ["gpu"]', "memory.types"),
        ("[memory]", 'types = "host"', "memory.types"),
        ("[observability]", 'metrics = "yes"', "observability.metrics"),
    ],
)
def test_bad_key_or_value_names_key_and_file(tmp_path: Path, section: str, body: str, key: str) -> None:
    path = write(tmp_path, f"{section}\n{body}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert key in msg
    assert str(path) in msg
    assert info.value.retryable is False


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    path = write(tmp_path, 'runtime = 3\n')
    with pytest.raises(ConfigError, match=r"\[runtime\]") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_invalid_toml_and_missing_file_name_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[runtime\nqueue_depth = 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert str(missing) in str(info.value)


def test_unreadable_or_non_utf8_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)  # a directory
    assert str(tmp_path) in str(info.value)
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"# caf\xe9\n[runtime]\nqueue_depth = 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_utf8_comments_load_whatever_the_locale(tmp_path: Path) -> None:
    path = tmp_path / "zh.toml"
    path.write_bytes("# 示意性配置 (the seed's example is commented in Chinese)\n[runtime]\nqueue_depth = 2\n".encode())
    assert load_config(path).runtime.queue_depth == 2
    # Under a plain C locale, without UTF-8 mode, too.
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    code = f"import mpcomm; print(mpcomm.load_config({str(path)!r}).runtime.queue_depth)"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "2"


def test_overrides_are_validated_like_a_file() -> None:
    cfg = Config().with_overrides(runtime={"queue_depth": 8})
    assert cfg.runtime.queue_depth == 8
    assert cfg.runtime.worker_threads == Config().runtime.worker_threads
    with pytest.raises(ConfigError, match="runtime.queue_depth"):
        Config().with_overrides(runtime={"queue_depth": "8"})
    with pytest.raises(ConfigError, match="transport.endpoint"):
        mpcomm.Engine(endpoint="no-port-here", transports=["tcp"])


def test_dict_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"memory\.alignment"):
        load_config({"memory": {"alignment": 12}})


def test_unknown_plugin_option_names_key_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[plugins.tcp]\nconnections = 2\nbogus = 1\n")
    cfg = load_config(path)  # the core cannot know a plugin's keys: checked when the transport starts
    assert cfg.plugins == {"tcp": {"connections": 2, "bogus": 1}}
    with pytest.raises(ConfigError) as info:
        mpcomm.Engine(path, transports=["tcp"])
    assert "plugins.tcp.bogus" in str(info.value)
    assert str(path) in str(info.value)


def test_plugin_option_of_wrong_type_names_key_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[plugins.tcp]\nconnections = "4"\n')
    with pytest.raises(ConfigError) as info:
        mpcomm.Engine(path, transports=["tcp"])
    assert "plugins.tcp.connections" in str(info.value)
    assert str(path) in str(info.value)


def test_plugin_options_reach_the_transport(tmp_path: Path) -> None:
    path = write(tmp_path, "[plugins.tcp]\nconnections = 2\n")
    with mpcomm.Engine(path, transports=["tcp"]) as e:
        assert e.transports["tcp"].ctx.options["connections"] == 2
        assert e.transports["tcp"].ctx.options["chunk"] == 1 << 20  # default kept
