"""Discovery: the proxy's live backend table (state, health, pairings, generations).

The static part comes from the planner's :class:`pdstack.plan.BackendTable` (or from
flags through ``BackendTable.adhoc``); the live part (healthy / drained / in-flight /
failure counters) is kept here. The admin API adds, replaces, drains and removes
backends at run time (the rolling upgrade uses it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from pdstack import kvmodes
from pdstack.backend_identity import BackendIdentity
from pdstack.proxy.standby import check_standbys, in_rotation

log = logging.getLogger("pdstack.proxy")

ROLES = ("prefill", "decode", "colocated")

# why a backend is ejected (pdstack_proxy_ejections_total's reason label):
# refused: a connection refused or reset (a leg's, or /health's); unreachable: nothing
# answered within its budget (no /health, no /metrics); health_failed: /health answered an
# error; engine_5xx: a 5xx that /health confirmed; wedged_no_progress: requests held, its
# progress counters flat and a 1-token generation unanswered for the no-progress budget;
# error_rate: eject_after legs in a row failed with no progress from it; half_open: it failed
# on trial after a re-admission; other: an operator or a test
EJECT_REASONS = ("refused", "unreachable", "health_failed", "engine_5xx", "wedged_no_progress",
                 "error_rate", "half_open", "other")


def probe_reason(error: str) -> str:
    """The ejection reason a failed /health probe's ``error`` gives."""
    if error.startswith("/health timed out"):
        return "unreachable"
    if error.startswith("/health answered"):
        return "health_failed"
    return "refused" if error.startswith("/health failed") else "other"


class PendingLegs(set[Any]):
    """The upstream connections of a backend's legs that have sent nothing to a client yet,
    each with the ``time.monotonic()`` it was added: the oldest one's age, with no answer
    from the backend since (``BackendState.last_success``), is what makes the proxy suspect
    a wedged engine (one that accepts requests and makes no progress)."""

    def __init__(self) -> None:
        super().__init__()
        self.since: dict[Any, float] = {}

    def add(self, item: Any) -> None:
        super().add(item)
        self.since.setdefault(item, time.monotonic())

    def discard(self, item: Any) -> None:
        super().discard(item)
        self.since.pop(item, None)

    def oldest(self) -> float | None:
        """When the oldest leg still waiting was sent (None: none waits)."""
        return min(self.since.values(), default=None)


@dataclass(eq=False)
class BackendState(BackendIdentity):
    """One engine as the proxy sees it: what the table names it by (name, role, node, url,
    generation, standby: :class:`pdstack.backend_identity.BackendIdentity`), and its state."""

    # a warm standby's active engine it stands in for now
    stands_in_for: str = ""
    healthy: bool = False
    probed: bool = False  # checked at least once ("down", not "unknown", while never healthy)
    drained: bool = False
    removed: bool = False
    in_flight: int = 0
    # decode legs whose path was chosen for this decoder at prefill time, not yet ended
    planned_decodes: int = 0
    consecutive_failures: int = 0  # failed requests (legs) in a row
    probe_failures: int = 0  # failed /health probes in a row
    consecutive_successes: int = 0
    ejections: int = 0
    served: int = 0
    # time.monotonic() of the last sign of progress: a leg answered, or a streaming leg
    # received data
    last_success: float = 0.0
    last_error: str = ""
    # accepted requests and made no progress (pdstack.proxy.progress): ejected, and
    # re-admitted only after a real generation answers, not a bare /health
    wedged: bool = False
    # why it was last ejected (EJECT_REASONS: the ejections metric's reason label)
    eject_reason: str = ""
    # the engine's progress counters at its last /metrics read, and when that was
    # (time.monotonic()); counters that moved since count as progress (last_success)
    progress_mark: float | None = None
    progress_mark_at: float = 0.0
    # requests the engine held at that read (vllm:num_requests_running + waiting)
    engine_held: int = 0
    # lmcache-pd decoders: {"host", "init_ports": [..], "alloc_ports": [..]} (per TP rank)
    lmcache_pd: dict[str, Any] | None = None
    # circuit breaker (pdstack.proxy.breaker): re-admitted, on trial until it has served
    half_open: bool = False
    half_open_successes: int = 0
    # upstream connections of legs that have sent nothing to a client yet (aborted,
    # and so re-routed, when the backend is ejected)
    pending: PendingLegs = field(default_factory=PendingLegs, repr=False)
    # upstream connections of legs streaming to a client (a stall of all of them, with no
    # other progress, makes a wedge suspect too; aborted, with an error event to their
    # clients, when the backend is found wedged)
    streaming: PendingLegs = field(default_factory=PendingLegs, repr=False)

    @property
    def usable(self) -> bool:
        """May take new requests."""
        return self.healthy and not self.drained and not self.removed

    @property
    def state(self) -> str:
        if self.removed:
            return "removed"
        if not self.healthy:
            if self.ejections:
                return "ejected"  # was healthy, then failed
            return "down" if self.probed else "unknown"  # never passed a check yet
        return "drained" if self.drained else "healthy"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "role": self.role,
            "node": self.node,
            "url": self.url,
            "generation": self.generation,
            "state": self.state,
            "healthy": self.healthy,
            "drained": self.drained,
            "in_flight": self.in_flight,
            "served": self.served,
            "consecutive_failures": self.consecutive_failures,
            "ejections": self.ejections,
            "half_open": self.half_open,
            "wedged": self.wedged,
            "last_error": self.last_error,
        }
        if self.standby:
            data.update(standby=True, stands_in_for=self.stands_in_for)
        if self.lmcache_pd is not None:
            data["lmcache_pd"] = self.lmcache_pd
        return data


def lmcache_pd_receiver(name: str, value: Any) -> dict[str, Any] | None:
    """Check an lmcache-pd receiver spec ``{"host", "init_ports", "alloc_ports"}``."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("host"), str) or not value["host"]:
        raise ValueError(f"backend {name}: lmcache_pd needs a host")
    ports: dict[str, list[int]] = {}
    for key in ("init_ports", "alloc_ports"):
        raw = value.get(key)
        if isinstance(raw, int):
            raw = [raw]
        if (
            not isinstance(raw, list)
            or not raw
            or not all(isinstance(x, int) and 0 < x < 65536 for x in raw)
        ):
            raise ValueError(f"backend {name}: lmcache_pd.{key} must be a list of ports")
        ports[key] = list(raw)
    if len(ports["init_ports"]) != len(ports["alloc_ports"]):
        raise ValueError(f"backend {name}: lmcache_pd needs one init and one alloc port per rank")
    return {"host": value["host"], **ports}


def derive_kv_path(kv_mode: str, prefill: BackendState, decode: BackendState) -> str | None:
    """The KV path between a prefiller and a decoder under ``kv_mode``; None = no pairing."""
    return kvmodes.kv_path(kv_mode, same_node=prefill.node == decode.node)


@dataclass
class BackendRegistry:
    """Backends + pairings + live state. Single-threaded (asyncio): no locks."""

    kv_mode: str
    served_model_name: str = ""
    skip_prefill_threshold_tokens: int = 0
    backends: dict[str, BackendState] = field(default_factory=dict)
    # prefill name -> {decode name: kv_path}
    pairings: dict[str, dict[str, str]] = field(default_factory=dict)
    on_eject: Callable[[BackendState], None] | None = None
    version: int = 0  # bumped on membership changes (routers rebuild their rings)
    # lmcache-pd: where the planner told the prefillers to PUSH ProxyNotif ({"host", "port"})
    lmcache_pd_notify: dict[str, Any] | None = None

    @property
    def mode(self) -> kvmodes.KvMode:
        return kvmodes.get(self.kv_mode)

    # ------------------------------------------------------------ construction
    @classmethod
    def from_table(cls, table: Any) -> BackendRegistry:
        """From a ``pdstack.plan.BackendTable`` (or its JSON dict)."""
        data = table if isinstance(table, dict) else table.model_dump(mode="json")
        kv_mode = data["kv_mode"]
        kvmodes.get(kv_mode)  # UnknownKvMode (a ValueError) names the valid ones
        reg = cls(
            kv_mode=kv_mode,
            served_model_name=data.get("served_model_name") or "",
            skip_prefill_threshold_tokens=int(data.get("skip_prefill_threshold_tokens") or 0),
            lmcache_pd_notify=data.get("lmcache_pd_notify"),
        )
        for b in data["backends"]:
            reg._add(
                BackendState(
                    name=b["name"],
                    role=b["role"],
                    node=b.get("node") or "local",
                    url=b["url"].rstrip("/"),
                    generation=b.get("generation") or "",
                    standby=bool(b.get("standby", False)),
                    lmcache_pd=lmcache_pd_receiver(b["name"], b.get("lmcache_pd")),
                )
            )
        for pair in data.get("pairings") or []:
            reg.pairings.setdefault(pair["prefill"], {})[pair["decode"]] = pair["kv_path"]
        reg.validate()
        return reg

    def _add(self, backend: BackendState) -> None:
        if backend.role not in ROLES:
            raise ValueError(f"backend {backend.name}: unknown role {backend.role!r}")
        disaggregated = self.mode.disaggregated
        if not disaggregated and backend.role != "colocated":
            raise ValueError(f"backend {backend.name}: kv_mode {self.kv_mode} needs role colocated")
        if disaggregated and backend.role == "colocated":
            raise ValueError(
                f"backend {backend.name}: role colocated needs a colocated kv_mode "
                f"(kv_mode is {self.kv_mode})"
            )
        self.backends[backend.name] = backend
        self.version += 1

    def validate(self) -> None:
        check_standbys(self.backends.values())
        for pre, decs in self.pairings.items():
            p = self.backends.get(pre)
            if p is None or p.role != "prefill":
                raise ValueError(f"pairing names {pre!r}, which is not a prefill backend")
            for dec in decs:
                d = self.backends.get(dec)
                if d is None or d.role != "decode":
                    raise ValueError(f"pairing names {dec!r}, which is not a decode backend")

    # ------------------------------------------------------------ queries
    def by_role(self, role: str, standbys: bool = False,
                out: Collection[str] = ()) -> list[BackendState]:
        """The ``role`` backends not removed; a warm standby only while it stands in for an
        active engine out of service (:mod:`pdstack.proxy.standby`; ``out``: names the
        caller counts out, a request's failed tries), every one with ``standbys``."""
        found = [b for b in self.backends.values() if b.role == role and not b.removed]
        return found if standbys else in_rotation(found, out)

    def refresh_rotation(self) -> None:
        """The standbys' rotation brought up to date (logged when it changes), without
        traffic too: each health round and scrape."""
        for role in ROLES:
            self.by_role(role)

    def decoders_for(self, prefill: BackendState,
                     out: Collection[str] = ()) -> list[tuple[BackendState, str]]:
        """Usable decoders paired with ``prefill``, same generation, with their KV path (a
        standby decoder only while it stands in: ``by_role``)."""
        rotating = {d.name for d in self.by_role("decode", out=out)}
        pairs: list[tuple[BackendState, str]] = []
        for name, kv_path in self.pairings.get(prefill.name, {}).items():
            d = self.backends.get(name)
            if d is None or d.name not in rotating or not d.usable \
                    or d.generation != prefill.generation:
                continue
            if kv_path == "shared-l1" and d.node != prefill.node:
                continue  # the LMCache store is per node
            pairs.append((d, kv_path))
        return pairs

    def receives_over_nixl(self, decoder: BackendState) -> bool:
        """Some prefiller hands KV to ``decoder`` over NIXL."""
        return decoder.role == "decode" and any(
            decs.get(decoder.name) == "nixl" for decs in self.pairings.values()
        )

    def describe_unroutable(self) -> str:
        """Why no request can be routed now (an operator-readable sentence)."""
        if not self.mode.disaggregated:
            engines = self.by_role("colocated")
            return f"no healthy engine ({_summary(engines)})"
        prefillers = self.by_role("prefill")
        usable = [p for p in prefillers if p.usable]
        if not usable:
            return f"no healthy prefiller ({_summary(prefillers)})"
        p = usable[0]
        paired = [self.backends[n] for n in self.pairings.get(p.name, {}) if n in self.backends]
        same_gen = [d for d in paired if d.generation == p.generation]
        detail = _summary(paired)
        if paired and not same_gen:
            detail = f"none of generation {p.generation!r}"
        return f"no healthy decoder for prefiller {p.name} on node {p.node} ({detail})"

    # ------------------------------------------------------------ health bookkeeping
    def record_failure(self, backend: BackendState, error: str, eject_after: int) -> None:
        backend.consecutive_failures += 1
        backend.consecutive_successes = 0
        backend.last_error = error
        if backend.healthy and backend.consecutive_failures >= eject_after:
            self.eject(backend, f"{eject_after} failures in a row, the last: {error}",
                       "error_rate")

    def eject(self, backend: BackendState, evidence: str, reason: str = "other") -> None:
        """Take ``backend`` out of rotation; ``reason`` is one of EJECT_REASONS, ``evidence``
        what was seen (both logged, the reason counted by the ``on_eject`` hook)."""
        backend.healthy = False
        backend.ejections += 1
        backend.eject_reason = reason if reason in EJECT_REASONS else "other"
        log.warning("ejected backend %s (%s): %s (reason %s)", backend.name, backend.url,
                    evidence, backend.eject_reason)
        if self.on_eject is not None:
            self.on_eject(backend)

    def record_probe(self, backend: BackendState, ok: bool, error: str, cfg: Any) -> None:
        backend.probed = True
        if ok:
            # a passing /health clears failed probes, not failed requests (a hung engine
            # may well answer /health)
            backend.probe_failures = 0
            if not backend.healthy:
                backend.consecutive_failures = 0
            if not backend.healthy and not backend.ejections:
                # never admitted yet (an engine still starting fails its first probes): its
                # first passing probe admits it at once; only an ejected backend waits for
                # readmit_after passing probes and a trial (half-open)
                backend.healthy = True
            elif not backend.healthy:
                backend.consecutive_successes += 1
                if backend.consecutive_successes >= cfg.readmit_after:
                    backend.healthy = True
                    backend.half_open = True  # on trial: one failure ejects it again
                    backend.half_open_successes = 0
                    backend.consecutive_successes = 0
                    backend.last_error = ""
                    log.warning("re-admitted backend %s (%s)", backend.name, backend.url)
        else:
            backend.probe_failures += 1
            backend.consecutive_successes = 0
            backend.last_error = error
            if backend.healthy and backend.probe_failures >= cfg.eject_after:
                self.eject(backend, f"{backend.probe_failures} failed /health probes in a row, "
                           f"the last: {error}", probe_reason(error))

    # ------------------------------------------------------------ admin
    def upsert(self, spec: dict[str, Any]) -> BackendState:
        """Add or replace a backend (admin API). New backends start unhealthy until probed."""
        name = str(spec["name"])
        role = str(spec["role"])
        old = self.backends.get(name)
        backend = BackendState(
            name=name,
            role=role,
            node=str(spec.get("node") or "local"),
            url=str(spec["url"]).rstrip("/"),
            generation=str(spec.get("generation") or ""),
            drained=bool(spec.get("drained", False)),
            # a replacement (an upgrade's) stays what it was unless the spec says
            standby=bool(spec.get("standby", old is not None and old.standby)),
        )
        if old is not None and old.role != role:
            raise ValueError(f"backend {name} exists with role {old.role}; remove it first")
        if role == "decode" and self.mode.lmcache_push:
            receiver = lmcache_pd_receiver(name, spec.get("lmcache_pd"))
            if receiver is None:
                # a replacement keeps its receiver; a stand-in (another name, an existing
                # engine's URL) is that engine, so it receives where that engine does
                same = [old] if old is not None else []
                same += [b for b in self.by_role("decode") if b.url == backend.url]
                receiver = next((b.lmcache_pd for b in same if b.lmcache_pd), None)
            backend.lmcache_pd = receiver
        self._add(backend)
        if role in ("prefill", "decode"):
            self._pair(backend, spec.get("pairs_with"))
        if old is not None:
            old.removed = True  # in-flight requests on the old entry finish; no new ones
        return backend

    def _pair(self, backend: BackendState, explicit: list[str] | None) -> None:
        """Pair a prefiller with its decoders, or a decoder with its prefillers: the ones
        ``pairs_with`` names, else every backend of the other role."""
        other = "decode" if backend.role == "prefill" else "prefill"
        targets = explicit if explicit is not None else [b.name for b in self.by_role(other)]
        if backend.role == "prefill":
            self.pairings[backend.name] = {}
        else:
            for decs in self.pairings.values():
                decs.pop(backend.name, None)
        for tname in targets:
            t = self.backends.get(tname)
            if t is None or t.role != other:
                raise ValueError(f"pairs_with names {tname!r}, which is not a {other} backend")
            pre, dec = (backend, t) if backend.role == "prefill" else (t, backend)
            path = derive_kv_path(self.kv_mode, pre, dec)
            if path is not None:
                self.pairings.setdefault(pre.name, {})[dec.name] = path

    def remove(self, name: str) -> BackendState:
        backend = self.backends.pop(name)
        backend.removed = True
        self.pairings.pop(name, None)
        for decs in self.pairings.values():
            decs.pop(name, None)
        self.version += 1
        return backend

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "kv_mode": self.kv_mode,
            "served_model_name": self.served_model_name,
            "backends": [b.to_json() for b in self.backends.values()],
            "pairings": [
                {"prefill": p, "decode": d, "kv_path": path}
                for p, decs in self.pairings.items()
                for d, path in decs.items()
            ],
        }
        if self.lmcache_pd_notify is not None:
            data["lmcache_pd_notify"] = self.lmcache_pd_notify
        return data


def _summary(backends: Iterable[BackendState]) -> str:
    items = list(backends)
    if not items:
        return "none configured"
    counts: dict[str, int] = {}
    for b in items:
        counts[b.state] = counts.get(b.state, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
