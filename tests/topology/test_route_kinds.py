"""Routing by memory kind (issue 31): Capabilities per side, the router never picks
a transport that cannot move the (local, remote) pair, runtime narrowing, and
the refusal that names the kinds."""

from __future__ import annotations

import pytest

from mpcomm import Availability, Capabilities, ConfigError, MemoryKindUnsupported, Transport, TransportUnavailable
from mpcomm.routing import RoutePolicy, RouteQuery
from mpcomm.transport import effective_capabilities

from mpcomm.config import tomllib

BOTH = frozenset({"host", "cuda"})
INSTALLED = {
    "gpu_local": Capabilities(memory_kinds=BOTH, remote_memory_kinds=frozenset({"host"}), bandwidth_class="high"),
    "gpu_all": Capabilities(memory_kinds=BOTH, bandwidth_class="medium"),
    "hostonly": Capabilities(bandwidth_class="memory"),
}
ALL = frozenset(INSTALLED)


def q(local: str, remote: str, **kw: object) -> RouteQuery:
    return RouteQuery(same_host=True, local_kind=local, remote_kind=remote, peer_transports=ALL, **kw)


def test_capabilities_per_side() -> None:
    c = INSTALLED["gpu_local"]
    assert c.moves("cuda", "host") and c.moves("host", "host")
    assert not c.moves("host", "cuda") and not c.moves("cuda", "cuda")
    assert INSTALLED["gpu_all"].remote_kinds == BOTH  # None: the same as memory_kinds
    d = c.to_dict()
    assert d["memory_kinds"] == ["cuda", "host"] and d["remote_memory_kinds"] == ["host"]
    less = INSTALLED["gpu_all"].without_kinds({"cuda"})
    assert less.memory_kinds == {"host"} and less.remote_kinds == {"host"}
    assert Capabilities().to_dict()["remote_memory_kinds"] == ["host"]


def test_router_picks_only_transports_that_move_the_pair() -> None:
    p = RoutePolicy.from_config(None, INSTALLED)
    assert p.choose(q("host", "host")).transports == ("hostonly", "gpu_local", "gpu_all")
    assert p.choose(q("cuda", "host")).transports == ("gpu_local", "gpu_all")
    assert p.choose(q("host", "cuda")).transports == ("gpu_all",)
    assert p.choose(q("cuda", "cuda")).transports == ("gpu_all",)
    # a hint naming only a transport that cannot move the pair is refused, with the reason
    with pytest.raises(TransportUnavailable, match="hostonly: cannot move local cuda <-> remote cuda"):
        p.choose(q("cuda", "cuda", hint=("hostonly",)))


def test_rules_do_not_override_kinds() -> None:
    rules = tomllib.loads('[[route]]\nname = "fast"\ntransports = ["hostonly", "gpu_local"]\n')["route"]
    p = RoutePolicy.from_config(rules, INSTALLED)
    r = p.choose(q("cuda", "host"))
    assert (r.transports, r.rule) == (("gpu_local",), "fast")
    assert p.choose(q("cuda", "cuda")).transports == ("gpu_all",)  # the rule leaves nothing: default


def test_rule_kind_spellings() -> None:
    rules = tomllib.loads('[[route]]\nname = "d"\nlocal_kind = "device"\ntransports = ["gpu_all"]\n')["route"]
    p = RoutePolicy.from_config(rules, INSTALLED)
    assert p.rules[0].local_kind == "cuda"  # "device" (memory.types' word) means cuda
    assert p.choose(q("cuda", "host")).rule == "d"
    with pytest.raises(ConfigError, match="local_kind must be one of host, cuda, device"):
        RoutePolicy.from_config([{"name": "x", "transports": ["gpu_all"], "local_kind": "tpu"}], INSTALLED)


def test_no_transport_moves_the_pair_names_the_kinds() -> None:
    p = RoutePolicy.from_config(None, {"hostonly": INSTALLED["hostonly"], "gpu_local": INSTALLED["gpu_local"]})
    with pytest.raises(MemoryKindUnsupported) as ei:
        p.choose(q("host", "cuda"))
    e = ei.value
    assert (e.local_kind, e.remote_kind) == ("host", "cuda")
    assert "local host memory to/from remote cuda memory" in str(e)
    assert "gpu_local moves local cuda,host, remote host" in str(e)
    # a pair some transport moves, but none reaches: the plain TransportUnavailable
    with pytest.raises(TransportUnavailable) as ei2:
        p.choose(RouteQuery(same_host=True, local_kind="cuda", remote_kind="host", peer_transports=frozenset()))
    assert not isinstance(ei2.value, MemoryKindUnsupported)


class _Declares(Transport):
    name = "declares"
    capabilities = Capabilities(memory_kinds=BOTH)

    @classmethod
    def memory_kind_availability(cls) -> dict[str, Availability]:
        return {"cuda": Availability.no("no NVIDIA GPU")}


class _Broken(_Declares):
    @classmethod
    def memory_kind_availability(cls) -> dict[str, Availability]:
        raise RuntimeError("probe blew up")


def test_effective_capabilities_drop_unavailable_kinds() -> None:
    caps, missing = effective_capabilities(_Declares)
    assert caps.memory_kinds == {"host"} and missing == {"cuda": "no NVIDIA GPU"}
    caps, missing = effective_capabilities(_Broken)
    assert caps.memory_kinds == {"host"} and "probe blew up" in missing["cuda"]
    caps, missing = effective_capabilities(Transport)
    assert caps.memory_kinds == {"host"} and missing == {}
