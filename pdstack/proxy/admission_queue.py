"""The gate's waiting room: who is refused at arrival, who waits, who goes next.

:class:`AdmissionQueue` is the half of :class:`pdstack.proxy.admission.KvAdmission` that
orders requests (the other half judges whether one fits an engine, ``_fits``): a request
that fits and finds nobody waiting goes at once; one predicted past its class's wait budget
is refused at arrival (:mod:`pdstack.proxy.wait_budget`); a full queue sheds the heaviest
tenant's newest waiter; the rest wait in fair order (:mod:`pdstack.proxy.fair_queue`) until
:meth:`AdmissionQueue.pump` finds the head a place, or their deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pdstack.proxy import kv_gate
from pdstack.proxy.admission_config import AdmissionConfig
from pdstack.proxy.backends import BackendState
from pdstack.proxy.fair_queue import AdmissionRejected, FairQueue, Waiter, tenant_name
from pdstack.proxy.routing import PrefixIndex
from pdstack.proxy.shares import TenantLedger
from pdstack.proxy.tenants import TenantState
from pdstack.proxy.wait_budget import WaitBudget

_SENT = ("engines", "")  # the one store of KvAdmission._sent


class AdmissionQueue:
    """The queue half of the gate (a base of :class:`~pdstack.proxy.admission.KvAdmission`,
    which owns the state named here)."""

    config: AdmissionConfig
    ledger: TenantLedger
    budget: WaitBudget
    wait_budget_s: float
    _queue: FairQueue
    _prompts: dict[str, tuple[tuple[int, ...], int]]
    _sent: PrefixIndex
    _unary: set[str]
    _unplaced: set[str]
    admitted: dict[str, int]
    held: dict[str, int]
    admitted_after_wait: int
    wait_seconds_sum: float
    on_wait: Callable[[TenantState | None, float], None] | None

    def _fits(
        self, candidates: list[BackendState], tokens: int, output: int, tenant: str,
        request_id: str,
    ) -> tuple[bool, str]:  # fmt: skip
        raise NotImplementedError

    def output_of(self, request_id: str) -> int:
        raise NotImplementedError

    def to_prefill(self, request_id: str, tokens: int) -> int:
        raise NotImplementedError

    # ------------------------------------------------------------ the queue
    async def wait_open(
        self,
        candidates: Callable[[], list[BackendState]],
        tokens: int,
        tenant: TenantState | None = None,
        request_id: str = "",
    ) -> None:
        """Return once some candidate is open for ``tokens`` (behind earlier waiters: FIFO,
        or fair across tenants), or raise :class:`AdmissionRejected`. With ``request_id``,
        the request's engine time is measured until :meth:`forget` (the fair cost)."""
        if not self.config.enabled:
            return
        name = tenant.name if tenant is not None else ""
        if tenant is not None:
            self.ledger.seen(name, tenant.policy.weight, tenant.policy.rank)
        try:
            await self._wait_open(candidates, tokens, tenant, request_id)
        except AdmissionRejected as exc:
            if tenant is not None and tenant.policy.priority == "batch":
                exc.tenant_fault = True  # a batch tenant waits its turn: 429, never 5xx
            raise

    async def _wait_open(
        self,
        candidates: Callable[[], list[BackendState]],
        tokens: int,
        tenant: TenantState | None,
        request_id: str,
    ) -> None:
        name = tenant.name if tenant is not None else ""
        output = self.output_of(request_id)
        reason = kv_gate.HELD_QUEUE
        self._check_budget(tenant, request_id)
        if not self._queue:
            ok, reason = self._fits(candidates(), tokens, output, name, request_id)
            if ok:
                self._go(request_id, name, 0.0, tokens, reason)
                return
        self._check_room(tenant)
        self.held[reason] = self.held.get(reason, 0) + 1
        waiter = Waiter(
            candidates, tokens, asyncio.get_running_loop().create_future(), output, tenant,
            request_id,
        )  # fmt: skip
        await self._wait(waiter)

    def _check_room(self, tenant: TenantState | None) -> None:
        """Raise :class:`AdmissionRejected` when the tenant's or the proxy's queue is full
        (a full queue sheds its newest lower-class waiter first)."""
        if tenant is not None:
            cap = tenant.policy.max_queued
            if cap and tenant.queued >= cap:
                raise AdmissionRejected(
                    "max_queued",
                    f"tenant {tenant.name!r} is at its max_queued limit ({cap} requests "
                    "waiting for the engines); retry later",
                    tenant_fault=True,
                )
        if len(self._queue) < self.config.queue_max or self._shed_for(tenant):
            return
        raise AdmissionRejected(
            "queue_full",
            f"every engine is near its KV limit and {len(self._queue)} requests wait "
            "already (the most of them your tenant's); retry later",
            tenant_fault=tenant is not None and self.config.fairness,
        )

    def refuse_at_arrival(self, tenant: TenantState | None) -> None:
        """The wait budget's judgement of a request that has just arrived, before its body is
        read: raise :class:`AdmissionRejected` (as :meth:`wait_open` would) when a request
        of ``tenant``'s class would wait past its budget now. Under a flood the refusal then
        costs its connection the headers alone (a flood of 300 at once on 2 busy cores:
        0.37 s to the last 503 when each was parsed and routed first); the request that
        passes is judged again, with its own size, in :meth:`wait_open`."""
        if not self.config.enabled:
            return
        try:
            self._check_budget(tenant, "")
        except AdmissionRejected as exc:
            if tenant is not None and tenant.policy.priority == "batch":
                exc.tenant_fault = True
            raise

    def _check_budget(self, tenant: TenantState | None, request_id: str) -> None:
        """Raise :class:`AdmissionRejected` (``queue_wait``) when the request's predicted
        time to first byte is past its class's budget (:mod:`pdstack.proxy.wait_budget`):
        refused at arrival, not held until the deadline and not sent to be late. 429 while
        other tenants share the engines (the flood pays), 503 for a tenant alone or without
        tenants (the server is overloaded); a batch tenant: 429 always (:meth:`wait_open`)."""
        batch = tenant is not None and tenant.policy.priority == "batch"
        if tenant is None:
            ahead = len(self._queue)
        else:
            p = tenant.policy
            ahead = self._queue.ahead_of(tenant.name, p.rank, p.weight)
        predicted = self.budget.predict(ahead)
        limit = self.config.queue_timeout_s if batch else self.wait_budget_s
        if predicted <= limit or limit <= 0:
            self.budget.arrived(request_id, predicted, ahead)
            return
        rate = self.budget.rate()
        raise AdmissionRejected(
            "queue_wait",
            f"the engines are saturated: {ahead + self.budget.in_prefill} requests are ahead "
            f"of this one and the engines start {rate:.1f} a second, so its first token would "
            f"come in ~{predicted:.1f} s, past its {limit:g} s budget; retry later",
            tenant_fault=tenant is not None and len(self.ledger.shares()) > 1,
            retry_after_s=predicted - limit,
        )

    async def _wait(self, waiter: Waiter) -> None:
        queue, tenant = self._queue, waiter.tenant
        queue.push(waiter)
        if tenant is not None:
            tenant.queued += 1
        # it may go now: first of its tenant (over the running cap), or the head of a queue
        # whose engines freed up since the last event; else at the next end or scrape
        self.pump()
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.config.queue_timeout_s):
                await waiter.future
        except TimeoutError:
            raise AdmissionRejected(
                "timeout",
                f"no engine had KV headroom within {self.config.queue_timeout_s:g} s; retry later",
            ) from None
        finally:
            queue.discard(waiter)
            if tenant is not None:
                tenant.queued -= 1
            waited = time.monotonic() - started
            self.wait_seconds_sum += waited
            if self.on_wait is not None:
                self.on_wait(tenant, waited)
        self.admitted_after_wait += 1

    def _shed_for(self, tenant: TenantState | None) -> bool:
        """A full queue: drop the waiter a newcomer of ``tenant`` goes before (the newest
        of a lower class, else of the tenant with the most waiters per weight: 429 to it,
        the flood pays); False when there is none (the newcomer is the heaviest)."""
        if tenant is None or not self.config.fairness:
            return False
        p = tenant.policy
        victim = self._queue.victim_for(tenant.name, p.rank, p.weight)
        if victim is None:
            return False
        self._queue.discard(victim)
        if not victim.future.done():
            victim.future.set_exception(
                AdmissionRejected(
                    "shed",
                    "shed for another tenant's request: the queue is full and your tenant "
                    "holds the most of it (or is of a lower class); retry later",
                    tenant_fault=True,
                )
            )
        return True

    def pump(self) -> None:
        """Admit the next waiter (FIFO head, or the fair pick) if it fits somewhere. One
        at a time: the admitted request reserves its tokens on the engine it picks, then
        calls :meth:`pump` again, so two waiters never take the same headroom."""
        queue = self._queue
        if self._unplaced:
            return  # an admitted waiter has yet to take its place: then it pumps again
        while True:
            head = queue.head()
            if head is None:
                return
            if head.future.done():
                queue.discard(head)
                continue
            if self._admit_if_it_fits(head):
                return
            # the head waits for the running cap; a tenant with nothing running on a full
            # engine need not (one over the cap, _first_of_tenant): the other flows' heads
            for w in queue.flow_heads():
                if w is not head and not w.future.done():
                    self._admit_if_it_fits(w)
            return

    def _admit_if_it_fits(self, w: Waiter) -> bool:
        """Admit ``w`` if one of its candidate engines can take it now."""
        ok, reason = self._fits(w.candidates(), w.tokens, w.output, tenant_name(w), w.request_id)
        if ok:
            self._admit(w, reason)
        return ok

    def _admit(self, w: Waiter, reason: str) -> None:
        """``w`` leaves the queue admitted, and counts as its tenant's at once (before its
        task runs again: the next pump sees it)."""
        self._queue.pop(w)
        if w.request_id:
            self._unplaced.add(w.request_id)
        self._go(w.request_id, tenant_name(w), w.cost, w.tokens, reason)
        w.future.set_result(None)

    def _go(self, request_id: str, tenant: str, charged: float, tokens: int, reason: str) -> None:
        """An admitted request: counted (by reason) and measured until :meth:`forget`."""
        self.admitted[reason] = self.admitted.get(reason, 0) + 1
        self.budget.admitted(request_id)
        self.ledger.start(
            request_id, tenant, charged, self.to_prefill(request_id, tokens),
            holds_lower=request_id not in self._unary,
        )  # fmt: skip
        blocks = self._prompts.get(request_id, ((), 0))[0]
        if blocks:  # sent: the next request with this prefix finds it cached
            self._sent.insert(_SENT, list(blocks))

    @property
    def queued(self) -> int:
        return len(self._queue)
