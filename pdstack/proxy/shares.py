"""The tenants' shares: what each tenant's requests occupy on the engines.

Per tenant, over the requests admission let through and that have not ended: how many run,
and how long each held the engines (engine seconds, from admission to the request's end).
The fair queue (:mod:`pdstack.proxy.fair_queue`) charges a waiter its tenant's recent
average engine seconds and settles with the measured time when the request ends: prompt
tokens alone undercharged a flood of short prompts with long answers (a tenant with long
prompts waited for ~9 of the flood's requests each time; issue 24). The totals (engine
seconds per tenant) are the proxy's per-tenant share of engine time.

Shares of the engine (issue 37): while several tenants are active (a request of theirs
in flight, or one arrived within ``ACTIVE_WINDOW_S``: a tenant at 4 req/s stays active
between its requests), each may hold at most its weight's share of the engine:
- running requests: ``share x running capacity`` (the engines' running cap), at least 1;
- prompt tokens being prefilled (admitted, no first byte yet: a streaming answer's prefill
  ends at its first byte, however long it waits for it in the engine's queue; a
  non-streaming answer's first byte is its last, so it counts for ``PREFILL_MAX_S``):
  ``share x prefill budget``; a tenant with nothing in prefill may always send one
  request, however long. A request counts the tokens the engine has to compute, not its
  whole prompt (:meth:`pdstack.proxy.admission.KvAdmission.to_prefill`): counted whole, a
  chat tenant's 2.1 k-token prompts (96 % cached) overran a 1,024-token share and queued
  one at a time like the flood's (isolation run 3: chat P50 151 ms -> 2.5 s).
So a flooding tenant's long prefills cannot fill every engine step, and its running
batch cannot fill the engine, while another tenant is active.

Interactive first (:meth:`TenantLedger.yields`): while a request of a higher class (an
``interactive`` tenant's) waits for its first byte, a lower class's request is not sent.
The engine step that computes the interactive prompt then holds no new batch prompt: on
one H200 a step with a 4-6 k-token batch prefill took ~80 ms against ~4 ms of decode, and
chat's first token waited for the step in progress and then shared its own with the next
batch prefill (isolation run 4: chat's ITL P90 4 -> 80 ms, TTFT P50 26 -> 92-128 ms, with
0.1 ms in the proxy's queue). A hold lasts until that first byte, at most ``FIRST_HOLD_S``
from the interactive request's admission; a non-streaming answer (its first byte is its
last: its prefill's end is not seen) holds nothing. Work-conserving toward a
tenant alone: alone it gets the whole engine. Priority classes act in the queue
(``interactive`` waiters first, :mod:`pdstack.proxy.fair_queue`): an interactive tenant's
request goes first, up to its share; batch tenants take the rest.

Memory: one small record per tenant with requests in flight or a cost average (the tenant
set is the configured one), one per request in flight.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

COST_EWMA = 0.2  # weight of the newest request in a tenant's average engine seconds
ACTIVE_WINDOW_S = 5.0  # a tenant with a request this recent counts as active
PREFILL_MAX_S = 2.0  # a non-streaming request admitted longer ago counts as prefilled
# a streaming request counts until its first byte, at most this long (a first byte lost). It
# once left the count after PREFILL_MAX_S too: a flood's prompts that waited longer in the
# engine's queue left it, the share let more in, the engine's waiting queue held 16-52
# requests and chat waited behind them in it (isolation run 6: chat P99 11.6 s)
PREFILL_STREAM_MAX_S = 60.0
# a higher class's request in prefill holds a lower class's for at most this long from its
# admission (a chat prefill under load: 30-200 ms on one H200)
FIRST_HOLD_S = 0.5
RATE_WINDOW_S = 10.0  # a tenant's admission rate is measured over this window


def _trim(admits: deque[float], now: float) -> None:
    """Drop the admission times older than RATE_WINDOW_S (oldest first)."""
    while admits and admits[0] < now - RATE_WINDOW_S:
        admits.popleft()


def ewma(average: float | None, value: float) -> float:
    """``average`` moved toward ``value`` by COST_EWMA (``value`` itself when there is none)."""
    return value if average is None else average + COST_EWMA * (value - average)


@dataclass(slots=True)
class Running:
    tenant: str
    admitted: float  # monotonic
    charged: float  # what the fair queue charged (0: it never waited)
    prompt: int
    prefilling: bool = True  # no first byte yet
    holds_lower: bool = True  # a streaming answer: lower classes wait for its first byte


class TenantLedger:
    """Who runs what: per request and per tenant (single-threaded, asyncio)."""

    def __init__(self, settle: Callable[[str, float], None]) -> None:
        self._settle = settle  # the fair queue's: (tenant, measured - charged)
        self._running: dict[str, Running] = {}
        self.count: dict[str, int] = {}  # tenant -> its requests running
        self.prompt: dict[str, int] = {}  # tenant -> their prompt tokens
        self._cost: dict[str, float] = {}
        self._cost_all = 0.0
        self.engine_seconds: dict[str, float] = {}  # tenant -> total, of ended requests
        self.prefill: dict[str, int] = {}  # tenant -> prompt tokens admitted, no first byte
        self._prefilling: dict[str, deque[Running]] = {}  # tenant -> in admission order
        # tenant -> (weight, last arrival, class rank: 0 interactive, higher is lower)
        self._seen: dict[str, tuple[float, float, int]] = {}
        self._admits: dict[str, deque[float]] = {}  # tenant -> admission times, last window

    def cost_of(self, tenant: str) -> float:
        """What a request of ``tenant`` is charged in the fair queue before it has run:
        its tenant's average engine seconds, else every tenant's, else 1 s."""
        return self._cost.get(tenant) or self._cost_all or 1.0

    def start(
        self,
        request_id: str,
        tenant: str,
        charged: float,
        prompt: int = 0,
        holds_lower: bool = True,
    ) -> None:
        """An admitted request: measured from now until :meth:`end`. ``holds_lower``: its
        first byte ends its prefill (a streaming answer), so lower classes may wait for it."""
        if not request_id:
            return
        if request_id in self._running:
            return
        self.count[tenant] = self.count.get(tenant, 0) + 1
        self.prompt[tenant] = self.prompt.get(tenant, 0) + prompt
        self.prefill[tenant] = self.prefill.get(tenant, 0) + prompt
        now = time.monotonic()
        r = self._running[request_id] = Running(tenant, now, charged, prompt, True, holds_lower)
        self._prefilling.setdefault(tenant, deque()).append(r)
        admits = self._admits.setdefault(tenant, deque())
        admits.append(now)
        _trim(admits, now)

    def admit_rate(self, tenant: str) -> float:
        """``tenant``'s requests admitted per second over the last RATE_WINDOW_S (0 when
        none; over the time since its first admission when that is shorter, >= 1 s)."""
        admits = self._admits.get(tenant)
        now = time.monotonic()
        if admits:
            _trim(admits, now)
        if not admits:
            self._admits.pop(tenant, None)
            return 0.0
        return len(admits) / max(1.0, min(RATE_WINDOW_S, now - admits[0]))

    def landed(self, request_id: str) -> bool:
        """The request's first byte came: its prompt is prefilled (True: it was counted)."""
        r = self._running.get(request_id)
        if r is None or not r.prefilling:
            return False
        self._prefilled(r)
        return True

    def _prefilled(self, r: Running) -> None:
        r.prefilling = False
        self.prefill[r.tenant] = self.prefill.get(r.tenant, 0) - r.prompt

    def _expire(self, tenant: str) -> int:
        """``tenant``'s prompt tokens in prefill now: its oldest requests (landed or ended,
        or admitted longer ago than their limit: PREFILL_MAX_S for a non-streaming one,
        PREFILL_STREAM_MAX_S for a streaming one) leave the count (amortised O(1): a
        non-streaming request behind a streaming one leaves with it or after it)."""
        queue = self._prefilling.get(tenant)
        now = time.monotonic()
        while queue and (not queue[0].prefilling or queue[0].admitted < now - (
            PREFILL_STREAM_MAX_S if queue[0].holds_lower else PREFILL_MAX_S
        )):
            r = queue.popleft()
            if r.prefilling:
                self._prefilled(r)
        if queue is not None and not queue:
            del self._prefilling[tenant]
        return self.prefill.get(tenant, 0)

    def end(self, request_id: str) -> bool:
        """The request ended: its measured engine time updates its tenant's average and
        corrects what its queueing charged. False when it was not running."""
        r = self._running.pop(request_id, None)
        if r is None:
            return False
        name = r.tenant
        if r.prefilling:
            self._prefilled(r)
        left = self.count.get(name, 1) - 1
        if left > 0:
            self.count[name] = left
            self.prompt[name] = self.prompt.get(name, 0) - r.prompt
        else:
            self.count.pop(name, None)
            self.prompt.pop(name, None)
            self.prefill.pop(name, None)
            self._prefilling.pop(name, None)
        seconds = max(time.monotonic() - r.admitted, 1e-3)
        self.engine_seconds[name] = self.engine_seconds.get(name, 0.0) + seconds
        self._cost[name] = ewma(self._cost.get(name), seconds)
        self._cost_all = ewma(self._cost_all or None, seconds)
        if r.charged:
            self._settle(name, seconds - r.charged)
        return True

    def running(self, tenant: str) -> int:
        return self.count.get(tenant, 0)

    # ------------------------------------------------------------ shares
    def seen(self, tenant: str, weight: float, rank: int = 0) -> None:
        """A request of ``tenant`` (class ``rank``) arrived (it is active for
        ACTIVE_WINDOW_S from now)."""
        self._seen[tenant] = (weight, time.monotonic(), rank)

    def shares(self) -> dict[str, float]:
        """Each active tenant's share of the engine (weights over the active ones)."""
        cutoff = time.monotonic() - ACTIVE_WINDOW_S
        weights = {}
        for name, (weight, last, _rank) in list(self._seen.items()):
            if last >= cutoff or self.count.get(name):
                weights[name] = weight
            else:
                del self._seen[name]  # bounded: only active tenants are kept
        total = sum(weights.values())
        return {name: w / total for name, w in weights.items()} if total else {}

    def over_share(self, tenant: str, prompt: int, running_cap: int, prefill_cap: int) -> bool:
        """Would one more request of ``tenant`` (``prompt`` tokens) take it past its share
        of the running capacity or the prefill budget? Never while it is alone."""
        shares = self.shares()
        share = shares.get(tenant)
        if share is None or len(shares) < 2:
            return False
        if running_cap and self.count.get(tenant, 0) + 1 > max(1.0, share * running_cap):
            return True
        in_prefill = self._expire(tenant) if prefill_cap else 0
        return bool(prefill_cap) and in_prefill > 0 and in_prefill + prompt > share * prefill_cap

    def yields(self, tenant: str) -> bool:
        """Should a request of ``tenant`` wait because a tenant of a higher class has a
        request in prefill, admitted less than FIRST_HOLD_S ago (interactive first)?"""
        seen = self._seen.get(tenant)
        if seen is None or seen[2] == 0:
            return False
        rank, cutoff = seen[2], time.monotonic() - FIRST_HOLD_S
        for name, queue in self._prefilling.items():
            other = self._seen.get(name)
            if other is None or other[2] >= rank:
                continue
            for r in reversed(queue):  # newest first: admission order
                if r.admitted < cutoff:
                    break
                if r.prefilling and r.holds_lower:
                    return True
        return False
