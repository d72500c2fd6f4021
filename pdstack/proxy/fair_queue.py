"""The admission queue: the requests KV admission holds, and the order they leave in.

Fair across tenants (``fairness``, on by default): one FIFO per tenant, released by
start-time fair queuing (a weighted fair queuing variant: each waiter's tag is
``max(virtual time, its tenant's last finish)``, a tenant's finish advances by
``cost / weight``, the smallest tag goes first), so under saturation tenants share the
engines in proportion to their weights, not in arrival order. The cost is what a request
occupies: engine seconds (:mod:`pdstack.proxy.shares`), charged when it becomes its flow's
head and settled with the measured time when it ends. Priority classes are strict:
``interactive`` waiters go before any ``batch`` one, and a full queue sheds its newest
``batch`` waiter (503) to make room for an ``interactive`` request. ``fairness: false`` is
one FIFO (arrival order).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdstack.proxy.tenants import TenantState


class AdmissionRejected(Exception):
    """No gated engine had KV headroom within the deadline, or the queue was full."""

    def __init__(
        self, reason: str, message: str, tenant_fault: bool = False, retry_after_s: float = 0.0
    ) -> None:
        super().__init__(message)
        # when to come back (0: the proxy's default Retry-After)
        self.retry_after_s = retry_after_s
        # "queue_full" | "timeout" | "shed" | "max_queued" | "queue_wait"
        self.reason = reason
        # the tenant's own doing (over its share, or a batch tenant): 429, not 503
        self.tenant_fault = tenant_fault


@dataclass(eq=False)
class Waiter:
    candidates: Callable[[], list[Any]]  # BackendState
    tokens: int  # its prompt
    future: asyncio.Future[None]
    output: int = 0  # the output it is expected to add to an engine's KV
    tenant: TenantState | None = None
    request_id: str = ""
    cost: float = 0.0  # charged in the fair queue (set when it becomes its flow's head)
    tag: float = 0.0  # start tag (fair queuing; set when it becomes its flow's head)
    queued: bool = False
    seq: int = 0  # arrival order


@dataclass(eq=False)
class Flow:
    """One tenant's waiters (fair queuing) and the finish tag of its last one."""

    waiters: deque[Waiter] = field(default_factory=deque)
    finish: float = 0.0
    rank: int = 0
    weight: float = 1.0


class FairQueue:
    """The admission queue. ``fair``: start-time fair queuing over one FIFO per tenant,
    strict priority between classes (``interactive`` first); else one FIFO. Memory: the
    waiters, plus one small record per tenant while it has waiters (the tenant set is
    the configured one)."""

    def __init__(self, fair: bool, cost: Callable[[str], float] | None = None) -> None:
        self.fair = fair
        # what a waiter of a tenant is charged when it becomes its flow's head (None: its
        # prompt tokens); read then, not at arrival, so a long queue carries no stale charges
        self._cost = cost
        self._fifo: deque[Waiter] = deque()
        self._flows: dict[str, Flow] = {}
        self._vtime = 0.0
        self._len = 0
        self._seq = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def push(self, w: Waiter) -> None:
        w.queued = True
        w.seq = self._seq
        self._seq += 1
        self._len += 1
        if not self.fair:
            self._fifo.append(w)
            return
        name = w.tenant.name if w.tenant is not None else ""
        flow = self._flows.get(name)
        if flow is None:
            flow = self._flows[name] = Flow()
            if w.tenant is not None:
                flow.rank, flow.weight = w.tenant.policy.rank, w.tenant.policy.weight
        flow.waiters.append(w)
        if len(flow.waiters) == 1:
            self._tag(name, flow)

    def _tag(self, name: str, flow: Flow) -> None:
        """The flow's head gets its start tag and is charged now (start-time fair queuing
        with the tag computed at the head: the same order, and the charge is current)."""
        w = flow.waiters[0]
        w.cost = self._cost(name) if self._cost is not None else float(max(1, w.tokens))
        w.tag = max(self._vtime, flow.finish)
        flow.finish = w.tag + w.cost / flow.weight

    def settle(self, tenant: str, delta: float) -> None:
        """A request of ``tenant`` that waited here cost ``delta`` more (or less) than it
        was charged: its tenant's later waiters start that much later (or earlier). Nothing
        when the tenant's record is gone (its debt ended with the busy period)."""
        flow = self._flows.get(tenant) if self.fair else None
        if flow is not None:
            flow.finish = max(self._vtime, flow.finish + delta / flow.weight)

    def head(self) -> Waiter | None:
        """The waiter to admit next (not removed)."""
        if not self.fair:
            return self._fifo[0] if self._fifo else None
        best: Waiter | None = None
        best_rank = 0
        for flow in self._flows.values():
            if not flow.waiters:
                continue
            w = flow.waiters[0]
            if best is None or (flow.rank, w.tag) < (best_rank, best.tag):
                best, best_rank = w, flow.rank
        return best

    def flow_heads(self) -> list[Waiter]:
        """Each tenant's first waiter (fair queuing; none with one FIFO)."""
        return [f.waiters[0] for f in self._flows.values() if f.waiters] if self.fair else []

    def pop(self, w: Waiter) -> None:
        """``w`` (the head, or a flow's head going over the running cap) is admitted:
        virtual time moves to its tag."""
        if self.fair:
            self._vtime = max(self._vtime, w.tag)
        self.discard(w, admitted=True)

    def discard(self, w: Waiter, admitted: bool = False) -> None:
        """``w`` leaves the queue: admitted (:meth:`pop`), or not (timed out, shed,
        cancelled: a head's charge is given back)."""
        if not w.queued:
            return
        w.queued = False
        self._len -= 1
        if not self.fair:
            if self._fifo and self._fifo[0] is w:
                self._fifo.popleft()
            else:
                self._fifo.remove(w)
            return
        name = w.tenant.name if w.tenant is not None else ""
        flow = self._flows[name]
        if flow.waiters[0] is w:
            flow.waiters.popleft()
            if not admitted:
                flow.finish = w.tag  # it never ran: its charge is given back
            if flow.waiters:
                self._tag(name, flow)
        else:
            flow.waiters.remove(w)
        if not self._len:  # the busy period is over: nobody owes anything
            self._flows.clear()
            self._vtime = 0.0
        elif not flow.waiters and flow.finish <= self._vtime:
            del self._flows[name]  # nothing owed: forget it (bounded memory)

    def newest_below(self, rank: int) -> Waiter | None:
        """The most recent waiter of a class below ``rank`` (a larger rank number)."""
        victims = [f.waiters[-1] for f in self._flows.values() if f.waiters and f.rank > rank]
        return max(victims, key=lambda w: w.seq, default=None)

    def victim_for(self, name: str, rank: int, weight: float) -> Waiter | None:
        """A full queue and a waiter of tenant ``name`` (class ``rank``) arrives: the waiter
        to shed for it. The newest of a lower class, else the newest of the tenant of the
        same class with the most waiters per weight, if that is not ``name`` itself (then
        None: the newcomer is the one over its share)."""
        lower = self.newest_below(rank)
        if lower is not None:
            return lower
        mine = self._flows.get(name)
        own = ((len(mine.waiters) if mine else 0) + 1) / weight
        flows = [(n, f) for n, f in self._flows.items() if f.waiters and f.rank == rank]
        heavy = max(flows, key=lambda nf: len(nf[1].waiters) / nf[1].weight, default=None)
        if heavy is None or heavy[0] == name or len(heavy[1].waiters) / heavy[1].weight <= own:
            return None
        return heavy[1].waiters[-1]

    def ahead_of(self, name: str, rank: int, weight: float) -> int:
        """How many waiters leave before a new waiter of tenant ``name`` (class ``rank``,
        ``weight``): all of them with one FIFO; fair: every waiter of a higher class, and of
        each tenant of its class as many as that tenant's weight gets while the new one's
        flow drains to it (start-time fair queuing at equal costs)."""
        if not self.fair:
            return self._len
        mine = self._flows.get(name)
        turns = ((len(mine.waiters) if mine else 0) + 1) / weight
        ahead = 0
        for n, f in self._flows.items():
            if f.rank < rank:
                ahead += len(f.waiters)
            elif f.rank == rank:
                ahead += len(f.waiters) if n == name else min(len(f.waiters), int(turns * f.weight))
        return ahead

    def drain(self) -> list[Waiter]:
        out = [*self._fifo, *(w for f in self._flows.values() for w in f.waiters)]
        self._fifo.clear()
        self._flows.clear()
        self._len = 0
        return out


def tenant_name(w: Waiter) -> str:
    """The waiter's tenant ("" without tenants)."""
    return w.tenant.name if w.tenant is not None else ""
