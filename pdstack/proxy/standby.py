"""Warm standbys: engines the planner starts like their role's others (``standby: true`` in
the backend table) that the proxy routes to only while an active engine is out of service.

A dead engine comes back in minutes on a GPU (imports, weights, torch.compile, CUDA
graphs: 108-230 s on an H200); a standby already did all that, so its role's share of the
node is back at the next request. The proxy manages no process: the standby is a normal
engine, probed like any other (so it is known healthy when it is needed); only the choice
of candidates treats it differently.

The rule, per role and generation (engines of another generation never stand in: an
upgrade never pairs old with new): with ``k`` active (non-standby) engines not usable
(ejected, unhealthy, drained; a wedged one is ejected), up to ``k`` usable standbys are in
rotation, the first by name, each standing in for one of them (by name too, so the choice
is stable and the log names who stands in for whom). A request's own failed tries count
as out for that request (``out``): its retry reaches a standby at once, before the failed
engine's ejection. When the active engine is back (re-admitted) its standby leaves
rotation: it gets no new requests, and its streams finish where they are.

Rotation changes (of the whole registry, not one request's view) are logged and kept on
each standby (``BackendState.stands_in_for``), which the
``pdstack_proxy_backend_in_rotation`` gauge reads.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Protocol, TypeVar

from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("pdstack.proxy")


class Engine(Protocol):
    """What the rule reads of a backend (``pdstack.proxy.backends.BackendState``), and the
    one thing it writes: whom a standby stands in for."""

    stands_in_for: str
    name: str
    role: str
    generation: str
    standby: bool
    removed: bool

    @property
    def usable(self) -> bool: ...
    @property
    def state(self) -> str: ...


class Registry(Protocol):
    """What the gauge reads of the proxy's backend registry."""

    @property
    def backends(self) -> Mapping[str, Engine]: ...
    def refresh_rotation(self) -> None: ...


# in_rotation hands back the caller's own type (backends.py: BackendState)
E = TypeVar("E", bound=Engine)


def rotation(backends: Iterable[Engine], out: Collection[str] = ()) -> dict[str, str]:
    """Standby name -> the active engine it stands in for, among ``backends`` (one role, not
    removed); ``out``: names counted out of service besides the unusable ones."""
    groups: dict[str, tuple[list[Engine], list[Engine]]] = {}
    for b in backends:
        active, standbys = groups.setdefault(b.generation, ([], []))
        (standbys if b.standby else active).append(b)
    chosen: dict[str, str] = {}
    for active, standbys in groups.values():
        missing = sorted(b.name for b in active if not b.usable or b.name in out)
        if not missing:
            continue
        ready = sorted(s.name for s in standbys if s.usable and s.name not in out)
        chosen.update(zip(ready, missing, strict=False))
    return chosen


def check_standbys(backends: Iterable[Engine]) -> None:
    """ValueError for a role whose backends are all standbys (none would ever serve)."""
    roles: dict[str, bool] = {}
    for b in backends:
        roles[b.role] = roles.get(b.role, True) and b.standby
    for role, only_standbys in roles.items():
        if only_standbys:
            raise ValueError(f"every {role} backend is a standby; a standby only stands in "
                             "for an active one (standby: false)")


def in_rotation(found: list[E], out: Collection[str] = ()) -> list[E]:
    """``found`` (one role's backends, not removed) less the standbys not in rotation now;
    with no ``out``, a change of rotation is logged and noted on the standbys."""
    if not any(b.standby for b in found):
        return found  # the common case: no standby, nothing to compute
    chosen = rotation(found, out)
    if not out:
        _note(found, chosen)
    return [b for b in found if not b.standby or b.name in chosen]


def _note(found: Sequence[Engine], chosen: dict[str, str]) -> None:
    """Log each standby whose place changed, and keep it on the standby."""
    states = {b.name: b for b in found}
    for s in found:
        if not s.standby:
            continue
        now = chosen.get(s.name, "")
        if now == s.stands_in_for:
            continue
        before, s.stands_in_for = s.stands_in_for, now
        if now:
            log.warning("standby %s in rotation: stands in for %s (%s)", s.name, now,
                        _why_out(states[now]))
        elif before in states and states[before].usable:
            log.warning("standby %s out of rotation: %s is back (its streams finish)",
                        s.name, before)
        else:
            log.warning("standby %s out of rotation (%s; stood in for %s)", s.name,
                        s.state if not s.usable else "no active engine out", before)


def _why_out(b: Engine) -> str:
    """An active engine's reason to be out, for the log."""
    return b.state if not b.usable else "failed a request's try"


def collect_rotation(registry: Registry) -> GaugeMetricFamily:
    """``pdstack_proxy_backend_in_rotation{backend}``: 1 while a backend takes new requests
    by the standby rule (an active engine: while usable; a standby: while it stands in),
    else 0 (the rotation is brought up to date first)."""
    registry.refresh_rotation()
    gauge = GaugeMetricFamily(
        "pdstack_proxy_backend_in_rotation",
        "Backend takes new requests (1) or not (0): an active engine while usable, a warm "
        "standby only while it stands in for an active one out of service",
        labels=["backend"],
    )
    for b in registry.backends.values():
        if b.removed:
            continue
        on = b.usable and (not b.standby or bool(b.stands_in_for))
        gauge.add_metric([b.name], 1.0 if on else 0.0)
    return gauge
