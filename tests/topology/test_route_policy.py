"""Route policy: rules from TOML, the capability-derived default, hints, splitting."""

from __future__ import annotations


import pytest

from mpcomm import Capabilities, ConfigError, MemoryKindUnsupported, TransportUnavailable
from mpcomm.routing import DEFAULT_RULE, HINT_RULE, RoutePolicy, RouteQuery, parse_rules

from mpcomm.config import tomllib  # the TOML parser the config itself uses (tomli before 3.11)

# Capabilities as the in-tree plugins declare them (names here are only labels:
# the default order must come from the capabilities, which the last test checks).
INSTALLED = {
    "shm": Capabilities(inter_node=False, bandwidth_class="memory"),
    "rdma_zerocopy": Capabilities(bandwidth_class="high"),
    "ucx": Capabilities(bandwidth_class="medium"),
    "tcp": Capabilities(one_sided=False),
}
ALL = frozenset(INSTALLED)

ISSUE_EXAMPLE = """
[[route]]
name = "same-host"
same_host = true
transports = ["shm", "ucx", "tcp"]

[[route]]
name = "rdma-both-sides"
same_host = false
requires = ["rdma_zerocopy"]
transports = ["rdma_zerocopy", "ucx", "tcp"]
split_min = "64MiB"

[[route]]
name = "other-hosts"
transports = ["ucx", "tcp"]
"""


def policy(text: str = ISSUE_EXAMPLE, running=None) -> RoutePolicy:
    return RoutePolicy.from_config(tomllib.loads(text).get("route"), INSTALLED, running)


def test_issue_example() -> None:
    p = policy()
    r = p.choose(RouteQuery(same_host=True, peer_transports=ALL))
    assert (r.transports, r.rule) == (("shm", "ucx", "tcp"), "same-host")
    r = p.choose(RouteQuery(same_host=False, peer_transports=ALL))
    assert (r.transports, r.rule) == (("rdma_zerocopy", "ucx", "tcp"), "rdma-both-sides")
    r = p.choose(RouteQuery(same_host=False, peer_transports=frozenset({"ucx", "tcp"})))
    assert (r.transports, r.rule) == (("ucx", "tcp"), "other-hosts")


def test_unusable_transports_are_dropped_and_empty_rules_skipped() -> None:
    # only tcp runs here: every rule is cut down to tcp
    p = policy(running=["tcp"])
    assert p.choose(RouteQuery(same_host=True, peer_transports=ALL)).transports == ("tcp",)
    # a rule whose transports are all unusable falls through to the next rule
    p = policy('[[route]]\nname="only-shm"\ntransports=["shm"]\n[[route]]\nname="net"\ntransports=["tcp"]\n')
    assert p.choose(RouteQuery(same_host=False, peer_transports=ALL)) .rule == "net"
    # a transport the peer did not register the region with is not offered
    r = policy().choose(RouteQuery(same_host=True, peer_transports=frozenset({"tcp"})))
    assert r.transports == ("tcp",) and r.rule == "same-host"


def test_default_comes_from_capabilities() -> None:
    p = RoutePolicy.from_config(None, INSTALLED)
    same = p.choose(RouteQuery(same_host=True, peer_transports=ALL))
    assert same == type(same)(("shm", "rdma_zerocopy", "ucx", "tcp"), DEFAULT_RULE)
    other = p.choose(RouteQuery(same_host=False, peer_transports=ALL))
    assert other.transports == ("rdma_zerocopy", "ucx", "tcp")  # shm is intra-node only


def test_default_is_not_derived_from_names() -> None:
    # the same capabilities under other names rank the same way
    renamed = {"a": INSTALLED["tcp"], "b": INSTALLED["ucx"], "c": INSTALLED["shm"], "d": INSTALLED["rdma_zerocopy"]}
    p = RoutePolicy.from_config([], renamed)
    assert p.choose(RouteQuery(True, peer_transports=frozenset(renamed))).transports == ("c", "d", "b", "a")
    # equal capabilities: the engine's preference order (installed order) decides
    twins = {"y": Capabilities(), "x": Capabilities()}
    assert RoutePolicy.from_config([], twins).choose(RouteQuery(False, peer_transports=frozenset(twins))).transports == ("y", "x")


def test_hint_overrides_rules() -> None:
    r = policy().choose(RouteQuery(same_host=True, peer_transports=ALL, hint=("tcp", "ucx")))
    assert r == type(r)(("tcp", "ucx"), HINT_RULE)
    with pytest.raises(TransportUnavailable, match="shm: cannot reach another host"):
        policy().choose(RouteQuery(same_host=False, peer_transports=ALL, hint=("shm",)))


def test_matching_on_kinds_and_sizes() -> None:
    text = """
[[route]]
name = "small"
max_size = "4KiB"
transports = ["tcp"]
[[route]]
name = "mid"
min_size = 4097
max_size = "1MiB"
local_kind = "host"
remote_kind = "host"
transports = ["ucx", "tcp"]
"""
    p = policy(text)
    q = lambda size, **kw: RouteQuery(same_host=False, size=size, peer_transports=ALL, **kw)  # noqa: E731
    assert p.choose(q(4096)).rule == "small"
    assert p.choose(q(4097)).rule == "mid"
    assert p.choose(q(1 << 20)).rule == "mid"
    assert p.choose(q((1 << 20) + 1)).rule == DEFAULT_RULE
    # device memory: none of these host-only capabilities moves it, so no rule and no default
    with pytest.raises(MemoryKindUnsupported, match="local host memory to/from remote cuda memory"):
        p.choose(q(10, remote_kind="cuda"))


def test_nothing_usable_says_why() -> None:
    p = policy(running=["shm"])
    with pytest.raises(TransportUnavailable) as ei:
        p.choose(RouteQuery(same_host=False, peer_transports=frozenset({"shm", "tcp"})))
    msg = str(ei.value)
    assert "shm: cannot reach another host" in msg and "tcp: not running here" in msg
    assert "ucx: not running here" in msg


@pytest.mark.parametrize(
    "rules, message",
    [
        ([{"name": "r", "transports": ["verbs9"]}], "route 'r' names transport 'verbs9', which is not installed"),
        ([{"name": "r", "transports": ["tcp"], "requires": ["gpu_direct"]}], "'gpu_direct', which is not installed"),
        ([{"transports": ["tcp"]}], r"route\[0\] needs a name"),
        ([{"name": "r"}], "transports is required"),
        ([{"name": "r", "transports": []}], "must name at least one transport"),
        ([{"name": "r", "transports": ["tcp", "tcp"]}], "names a transport twice"),
        ([{"name": "r", "transports": ["tcp"], "same_host": "yes"}], "same_host must be true or false"),
        ([{"name": "r", "transports": ["tcp"], "min_size": "lots"}], "min_size: not a size"),
        ([{"name": "r", "transports": ["tcp"], "min_size": "8KiB", "max_size": "4KiB"}], "below min_size"),
        ([{"name": "r", "transports": ["tcp"], "remote_kind": "gpu"}], "remote_kind must be one of host, cuda, device"),
        ([{"name": "r", "transports": ["tcp"], "max_stripes": 1}], "max_stripes must be an integer from 2"),
        ([{"name": "r", "transports": ["tcp"], "split_min": 100}], "split_min must be at least"),
        ([{"name": "r", "transports": ["tcp"], "colour": "red"}], "unknown key 'colour'"),
        ([{"name": "r", "transports": ["tcp"]}, {"name": "r", "transports": ["ucx"]}], "two rules have this name"),
        ([{"name": "default", "transports": ["tcp"]}], "the name is reserved"),
        ({"name": "r"}, r"array of tables"),
    ],
)
def test_bad_rules_are_config_errors(rules, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RoutePolicy.from_config(rules, INSTALLED)


def test_installed_but_not_running_is_fine() -> None:
    # rdma is installed (a plugin provides it) but not available on this host
    p = policy(running=["shm", "tcp"])
    r = p.choose(RouteQuery(same_host=False, peer_transports=ALL))
    assert r.rule == "rdma-both-sides" and r.transports == ("tcp",)


def test_split() -> None:
    p = policy()
    big = RouteQuery(same_host=False, size=(128 << 20) + 5, peer_transports=ALL)
    plan = p.split(big)
    assert plan is not None and plan.rule == "rdma-both-sides"
    assert len(plan.stripes) == 2
    assert sum(s.length for s in plan.stripes) == big.size
    assert plan.stripes[0].offset == 0 and plan.stripes[1].offset == plan.stripes[0].length
    assert plan.stripes[1].offset % 4096 == 0
    assert {s.transport for s in plan.stripes} == {"rdma_zerocopy"}
    assert p.split(RouteQuery(same_host=False, size=(64 << 20) - 1, peer_transports=ALL)) is None
    assert p.split(RouteQuery(same_host=True, size=1 << 30, peer_transports=ALL)) is None  # same-host rule: no split_min
    assert p.split(RouteQuery(same_host=False, size=1 << 30, peer_transports=ALL, hint=("tcp",))) is None


def test_split_across_transports() -> None:
    p = RoutePolicy.from_config(
        [{"name": "two", "transports": ["ucx", "tcp"], "split_min": "1MiB", "max_stripes": 4,
          "split_across": "transports"}], INSTALLED)
    plan = p.split(RouteQuery(same_host=False, size=8 << 20, peer_transports=ALL))
    assert plan is not None
    assert [s.transport for s in plan.stripes] == ["ucx", "tcp"]  # as many stripes as transports
    assert [s.length for s in plan.stripes] == [4 << 20, 4 << 20]


def test_parse_rules_without_installed_checks_shape_only() -> None:
    rules = parse_rules([{"name": "x", "transports": ["anything"], "max_size": "4KiB"}])
    assert rules[0].max_size == 4096
