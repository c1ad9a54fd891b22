"""Route policy: which transports, in which order, carry one request.

Rules come from the config's ``[[route]]`` array of tables and are matched in
order; the first rule that matches a request *and* leaves at least one usable
transport decides its ordered transport list::

    [[route]]
    name = "same-host"
    same_host = true
    transports = ["shm", "ucx", "tcp"]

    [[route]]
    name = "rdma-both-sides"
    same_host = false
    requires = ["rdma_zerocopy"]        # the peer must run it too
    transports = ["rdma_zerocopy", "ucx", "tcp"]
    split_min = "64MiB"                 # requests this large may be striped
    max_stripes = 2

    [[route]]
    name = "other-hosts"
    transports = ["ucx", "tcp"]

A rule matches on ``same_host`` (bool), ``local_kind`` / ``remote_kind``
(memory kinds), a size range ``min_size`` .. ``max_size`` (inclusive; bytes
or strings like ``"4KiB"``) and ``requires`` (transports both sides must run).
A per-request hint (:attr:`RouteQuery.hint`) overrides every rule.

From a rule's list, transports that cannot carry the request are dropped:
not running here, not run by the peer, not able to reach another host
(``Capabilities.inter_node``) or the same host (``intra_node``), or not
handling the memory kinds. A rule left with nothing is skipped.

With no rule matching, the default is derived from capabilities alone (no
plugin names in the core): usable transports ranked by ``bandwidth_class``
(memory > high > medium > low), then zero-copy, then one-sided, then the
engine's configured preference order. The class is the *measured* one where
this node has a calibration of that transport for that kind of route
(``measured``, from :func:`mpcomm.calibration.route_classes`; same-host
measurements rank only same-host routes), else the one the transport
declares. (When the user gave an explicit order, ``transport.order`` or
``Engine(transports=...)``, the default keeps that order instead:
``ranked=False``.)

A rule naming a transport no installed plugin provides is a
:class:`~mpcomm.ConfigError` that says so (a transport that is installed but
unavailable on this host is fine: the same file serves every node).

Public API: :class:`RoutePolicy`, :class:`RouteRule`, :class:`RouteQuery`,
:class:`Route`, :class:`SplitPlan`, :func:`parse_rules`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, MemoryKindUnsupported, TransportUnavailable
from .memory_kinds import normalize_kind
from .units import parse_size
from .transport import BANDWIDTH_CLASSES, Capabilities

__all__ = [
    "DEFAULT_RULE",
    "HINT_RULE",
    "MEMORY_KINDS",
    "Route",
    "RouteQuery",
    "RoutePolicy",
    "RouteRule",
    "SplitPlan",
    "Stripe",
    "parse_rules",
]

#: Rule names a Route carries when no configured rule chose it.
DEFAULT_RULE = "default"
HINT_RULE = "hint"
MEMORY_KINDS = ("host", "cuda", "device")  # "device": the older spelling of "cuda"
MAX_RULES = 256
MAX_STRIPES = 16
#: Stripes start on this boundary so no stripe splits a page.
STRIPE_ALIGN = 4096

_RULE_KEYS = {
    "name", "same_host", "local_kind", "remote_kind", "min_size", "max_size",
    "requires", "transports", "split_min", "max_stripes", "split_across",
}


@dataclass(frozen=True)
class RouteQuery:
    """What the policy knows about one request.

    ``peer_transports``: the transports the peer runs *and* registered the
    target region with (the engine passes the intersection). ``hint``: an
    ordered transport list the caller wants, overriding the rules.
    """

    same_host: bool
    local_kind: str = "host"
    remote_kind: str = "host"
    size: int = 0
    peer_transports: frozenset[str] = frozenset()
    hint: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Route:
    """An ordered transport list and the name of the rule that chose it."""

    transports: tuple[str, ...]
    rule: str


@dataclass(frozen=True)
class Stripe:
    offset: int  # relative to the request's start
    length: int
    transport: str


@dataclass(frozen=True)
class SplitPlan:
    """How to cut one large request into stripes that run side by side."""

    stripes: tuple[Stripe, ...]
    rule: str


@dataclass(frozen=True)
class RouteRule:
    """One ``[[route]]`` table, validated."""

    name: str
    transports: tuple[str, ...]
    same_host: bool | None = None
    local_kind: str | None = None
    remote_kind: str | None = None
    min_size: int = 0
    max_size: int | None = None
    requires: tuple[str, ...] = ()
    split_min: int | None = None
    max_stripes: int = 2
    #: "lanes": all stripes on the route's first transport (it spreads them over
    #: its NICs / NUMA nodes); "transports": stripe i on the i-th usable transport.
    split_across: str = "lanes"

    def matches(self, q: RouteQuery) -> bool:
        if self.same_host is not None and self.same_host != q.same_host:
            return False
        if self.local_kind is not None and self.local_kind != q.local_kind:
            return False
        if self.remote_kind is not None and self.remote_kind != q.remote_kind:
            return False
        if q.size < self.min_size or (self.max_size is not None and q.size > self.max_size):
            return False
        return all(t in q.peer_transports for t in self.requires)


def _size(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be a size (bytes or a string like \"4KiB\"), not {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        try:
            n = parse_size(value)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    else:
        raise ConfigError(f"{where} must be a size (bytes or a string like \"4KiB\"), not {value!r}")
    if n < 0:
        raise ConfigError(f"{where} must not be negative, not {n}")
    return n


def _names(value: Any, where: str, *, allow_empty: bool) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where} must be a list of transport names, not {value!r}")
    if not value and not allow_empty:
        raise ConfigError(f"{where} must name at least one transport")
    if len(set(value)) != len(value):
        raise ConfigError(f"{where} names a transport twice: {list(value)!r}")
    return tuple(value)


def parse_rules(raw: Any, installed: Iterable[str] | None = None, *, source: str = "<config>") -> tuple[RouteRule, ...]:
    """Validate a ``[[route]]`` array. With ``installed``, every transport a
    rule names must be one of them (else a ConfigError that says so)."""
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)) or not all(isinstance(r, Mapping) for r in raw):
        raise ConfigError(f"{source}: route must be an array of tables ([[route]])")
    if len(raw) > MAX_RULES:
        raise ConfigError(f"{source}: at most {MAX_RULES} [[route]] rules, not {len(raw)}")
    known = None if installed is None else list(installed)
    rules: list[RouteRule] = []
    seen: set[str] = set()
    for i, r in enumerate(raw):
        name = r.get("name")
        label = f"{source}: route[{i}]"
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{label} needs a name (a non-empty string)")
        where = f"{source}: route {name!r}"
        if name in seen:
            raise ConfigError(f"{where}: two rules have this name")
        if name in (DEFAULT_RULE, HINT_RULE):
            raise ConfigError(f"{where}: the name is reserved")
        seen.add(name)
        unknown = sorted(set(r) - _RULE_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_RULE_KEYS))})")
        if "transports" not in r:
            raise ConfigError(f"{where}: transports is required (an ordered list)")
        transports = _names(r["transports"], f"{where}: transports", allow_empty=False)
        requires = _names(r.get("requires", []), f"{where}: requires", allow_empty=True)
        if known is not None:
            for t in (*transports, *requires):
                if t not in known:
                    raise ConfigError(
                        f"{where} names transport {t!r}, which is not installed "
                        f"(installed: {', '.join(known) or 'none'})"
                    )
        same_host = r.get("same_host")
        if same_host is not None and not isinstance(same_host, bool):
            raise ConfigError(f"{where}: same_host must be true or false, not {same_host!r}")
        kinds = {}
        for key in ("local_kind", "remote_kind"):
            v = r.get(key)
            if v is not None and v not in MEMORY_KINDS:
                raise ConfigError(f"{where}: {key} must be one of {', '.join(MEMORY_KINDS)}, not {v!r}")
            kinds[key] = normalize_kind(v) if v is not None else None
        min_size = _size(r.get("min_size", 0), f"{where}: min_size")
        max_size = _size(r["max_size"], f"{where}: max_size") if "max_size" in r else None
        if max_size is not None and max_size < min_size:
            raise ConfigError(f"{where}: max_size {max_size} is below min_size {min_size}")
        split_min = _size(r["split_min"], f"{where}: split_min") if "split_min" in r else None
        if split_min is not None and split_min < 2 * STRIPE_ALIGN:
            raise ConfigError(f"{where}: split_min must be at least {2 * STRIPE_ALIGN} bytes, not {split_min}")
        max_stripes = r.get("max_stripes", 2)
        if isinstance(max_stripes, bool) or not isinstance(max_stripes, int) or not 2 <= max_stripes <= MAX_STRIPES:
            raise ConfigError(f"{where}: max_stripes must be an integer from 2 to {MAX_STRIPES}, not {max_stripes!r}")
        split_across = r.get("split_across", "lanes")
        if split_across not in ("lanes", "transports"):
            raise ConfigError(f"{where}: split_across must be 'lanes' or 'transports', not {split_across!r}")
        rules.append(RouteRule(name=name, transports=transports, same_host=same_host, min_size=min_size,
                               max_size=max_size, requires=requires, split_min=split_min, max_stripes=max_stripes,
                               split_across=split_across, **kinds))
    return tuple(rules)


def _rank(bandwidth_class: str) -> int:
    try:
        return BANDWIDTH_CLASSES.index(bandwidth_class)
    except ValueError:
        return 0  # an unknown class ranks as the lowest


class RoutePolicy:
    """Chooses a :class:`Route` per request (see the module docstring).

    Args:
        rules: validated rules, in match order.
        installed: every transport a plugin provides, with its capabilities,
            in the engine's preference order (the last tie-breaker).
        running: the transports running on this engine (default: all installed).
        ranked: rank the default route by capabilities (True), or keep the
            ``installed`` order (False: the user gave an explicit preference,
            ``transport.order`` or ``Engine(transports=...)``).
        measured: measured bandwidth class per transport, per kind of route
            (``{True: same-host classes, False: other-host classes}``); a
            transport missing there ranks by its declared class.
    """

    def __init__(self, rules: Sequence[RouteRule], installed: Mapping[str, Capabilities],
                 running: Iterable[str] | None = None, *, ranked: bool = True,
                 measured: Mapping[bool, Mapping[str, str]] | None = None) -> None:
        self.rules = tuple(rules)
        #: Whether a rule looks at the request's size (routes then differ per request).
        self.size_rules = any(r.min_size or r.max_size is not None or r.split_min is not None for r in self.rules)
        self.installed = dict(installed)
        self.running = tuple(self.installed if running is None else (n for n in running if n in self.installed))
        #: Measured classes in use, per kind of route (only those of running transports).
        self.measured: dict[bool, dict[str, str]] = {
            kind: {n: c for n, c in (measured or {}).get(kind, {}).items() if n in self.running}
            for kind in (True, False)}
        order = {name: i for i, name in enumerate(self.installed)}
        # One default order per kind of route: a same-host calibration says nothing
        # about the path to another host.
        self._default_orders: dict[bool, tuple[str, ...]] = {}
        for kind in (True, False):
            if ranked:
                classes = self.classes(kind)
                self._default_orders[kind] = tuple(sorted(
                    self.running,
                    key=lambda n, c=classes: (-_rank(c[n]), not self.installed[n].zero_copy,
                                              not self.installed[n].one_sided, order[n]),
                ))
            else:
                self._default_orders[kind] = tuple(sorted(self.running, key=order.__getitem__))

    def classes(self, same_host: bool) -> dict[str, str]:
        """The bandwidth class the default route ranks each running transport by:
        measured for this kind of route where known, else declared."""
        measured = self.measured[same_host]
        return {n: measured.get(n, self.installed[n].bandwidth_class) for n in self.running}

    def default_order(self, same_host: bool) -> tuple[str, ...]:
        """Running transports in the default route's order, before per-request filtering."""
        return self._default_orders[same_host]

    @classmethod
    def from_config(cls, raw_rules: Any, installed: Mapping[str, Capabilities],
                    running: Iterable[str] | None = None, *, ranked: bool = True,
                    source: str = "<config>", measured: Mapping[bool, Mapping[str, str]] | None = None,
                    ) -> RoutePolicy:
        """Validate ``raw_rules`` (the config's ``route`` array) against ``installed``."""
        return cls(parse_rules(raw_rules, installed, source=source), installed, running, ranked=ranked,
                   measured=measured)

    @classmethod
    def for_config(cls, config: Any, installed: Mapping[str, Capabilities], running: Iterable[str] | None = None,
                   *, exact_order: Sequence[str] | None = None,
                   measured: Mapping[bool, Mapping[str, str]] | None = None) -> RoutePolicy:
        """The policy an engine with ``config`` uses: its ``[[route]]`` rules,
        ``installed`` reordered by the configured preference (``exact_order``
        = ``Engine(transports=...)``), and the capability ranking unless the
        user gave an order of their own. ``measured``: the node's measured
        classes (:func:`mpcomm.calibration.route_classes`, which honours
        ``transport.bandwidth``); None ranks by the declared classes."""
        from .config import DEFAULT_ORDER

        t = config.transport
        if exact_order is not None:
            preferred = list(exact_order)
        elif t.name != "auto":
            preferred = [t.name]
        else:
            preferred = list(t.order)
        order = [n for n in preferred if n in installed] + [n for n in installed if n not in preferred]
        ranked = exact_order is None and t.name == "auto" and tuple(t.order) == tuple(DEFAULT_ORDER)
        return cls.from_config(list(config.route), {n: installed[n] for n in order}, running,
                               ranked=ranked, source=config.source, measured=measured)

    def usable(self, name: str, q: RouteQuery) -> bool:
        """Can ``name`` carry this request at all (capabilities and both sides)?"""
        caps = self.installed.get(name)
        if caps is None or name not in self.running or name not in q.peer_transports:
            return False
        if not (caps.intra_node if q.same_host else caps.inter_node):
            return False
        return caps.moves(q.local_kind, q.remote_kind)

    def _filter(self, names: Iterable[str], q: RouteQuery) -> tuple[str, ...]:
        return tuple(n for n in names if self.usable(n, q))

    def _match(self, q: RouteQuery) -> tuple[RouteRule | None, tuple[str, ...]]:
        for rule in self.rules:
            if rule.matches(q):
                chosen = self._filter(rule.transports, q)
                if chosen:
                    return rule, chosen
        return None, self._filter(self._default_orders[q.same_host], q)

    def choose(self, q: RouteQuery) -> Route:
        """The ordered transports for ``q`` and the rule that chose them.

        Raises TransportUnavailable, with the reason per transport, when
        nothing can carry the request.
        """
        if q.hint:
            chosen = self._filter(q.hint, q)
            if chosen:
                return Route(chosen, HINT_RULE)
            raise TransportUnavailable(f"none of the hinted transports {list(q.hint)} can carry this request: "
                                       + self.explain(q.hint, q))
        rule, chosen = self._match(q)
        if not chosen:
            if not any(self.installed[n].moves(q.local_kind, q.remote_kind) for n in self.running):
                raise MemoryKindUnsupported(
                    f"no running transport moves local {q.local_kind} memory to/from remote {q.remote_kind} "
                    "memory: " + "; ".join(f"{n} moves local {','.join(sorted(self.installed[n].memory_kinds))}, "
                                           f"remote {','.join(sorted(self.installed[n].remote_kinds))}"
                                           for n in self.running),
                    local_kind=q.local_kind, remote_kind=q.remote_kind)
            raise TransportUnavailable("no transport can carry this request: " + self.explain(self.installed, q))
        return Route(chosen, rule.name if rule else DEFAULT_RULE)

    def explain(self, names: Iterable[str], q: RouteQuery) -> str:
        """Why each of ``names`` cannot carry ``q`` ("" for those that can)."""
        reasons = []
        for n in names:
            caps = self.installed.get(n)
            if caps is None:
                why = "not installed"
            elif n not in self.running:
                why = "not running here"
            elif n not in q.peer_transports:
                why = "the peer does not offer it for this region"
            elif not (caps.intra_node if q.same_host else caps.inter_node):
                why = "cannot reach the same host" if q.same_host else "cannot reach another host"
            elif not caps.moves(q.local_kind, q.remote_kind):
                why = (f"cannot move local {q.local_kind} <-> remote {q.remote_kind} memory (moves local "
                       f"{','.join(sorted(caps.memory_kinds))}, remote {','.join(sorted(caps.remote_kinds))})")
            else:
                continue
            reasons.append(f"{n}: {why}")
        return "; ".join(reasons)

    def split(self, q: RouteQuery, route: Route | None = None) -> SplitPlan | None:
        """Whether (and how) to stripe a large request; None: send it whole.

        Only a matching rule with ``split_min`` allows splitting (hints and
        the default never split). Requests of at least ``split_min`` bytes
        are cut into up to ``max_stripes`` stripes of at least
        ``split_min / max_stripes`` bytes, on 4 KiB boundaries.
        """
        if q.hint:
            return None
        rule, chosen = self._match(q)
        if rule is None or rule.split_min is None or q.size < rule.split_min:
            return None
        if route is not None:
            chosen = route.transports
        if not chosen:
            return None
        lanes = rule.max_stripes
        if rule.split_across == "transports":
            lanes = min(lanes, len(chosen))
        piece = max(rule.split_min // rule.max_stripes, STRIPE_ALIGN)
        lanes = max(1, min(lanes, q.size // piece))
        if lanes < 2:
            return None
        step = -(-q.size // lanes)
        step = -(-step // STRIPE_ALIGN) * STRIPE_ALIGN
        stripes = []
        off = 0
        for i in range(lanes):
            length = min(step, q.size - off)
            if length <= 0:
                break
            t = chosen[i] if rule.split_across == "transports" else chosen[0]
            stripes.append(Stripe(off, length, t))
            off += length
        if len(stripes) < 2:
            return None
        return SplitPlan(tuple(stripes), rule.name)

    def describe(self) -> list[dict[str, Any]]:
        """The rules as dicts (for ``mpcomm topology`` and logs)."""
        out = []
        for r in self.rules:
            d = {k: v for k, v in r.__dict__.items() if v not in (None, (), 0) or k == "name"}
            d["transports"] = list(r.transports)
            if r.requires:
                d["requires"] = list(r.requires)
            out.append(d)
        return out
