"""What names one engine to the proxy, declared once: the fields that the planner's backend
table entry (:class:`pdstack.plan_types.Backend`, a frozen pydantic model) and the proxy's
live record of it (:class:`pdstack.proxy.backends.BackendState`, a mutable dataclass) share.
Both inherit them from :class:`BackendIdentity` (pydantic takes a stdlib dataclass base's
fields as its own, validated); a field added here is in the table's JSON and in the proxy's
state alike. Stdlib only, so the proxy's registry needs no planner module."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)  # no __eq__: the proxy's records hash by identity
class BackendIdentity:
    name: str
    role: str
    node: str
    url: str
    generation: str = ""
    # a warm standby: routed to only while an active engine of its role is out
    # (pdstack.proxy.standby); the table's JSON omits it when false (a table without the
    # key has none)
    standby: bool = False
