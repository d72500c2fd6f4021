"""KV-aware admission: hold a request in the proxy only when sending it would hurt.

A request goes straight to its engine unless, at the moment it arrives,
- every candidate engine would be pushed past its KV watermark by it (prompt + expected
  output on top of what the engine holds and will hold: :mod:`pdstack.proxy.kv_gate`),
  which is where vLLM starts preempting running requests; or
- every candidate already runs ``max_running`` of the proxy's requests (the engine's own
  running limit, from the plan): the engine would queue it itself, in arrival order;
  held here, the fair queue decides who goes next; or
- its tenant holds its weight's share of the engines while another tenant is active
  (running requests, prompt tokens in prefill: :mod:`pdstack.proxy.shares`; a prompt's
  prefix that an earlier request sent the engines counts as cached, not as prefill: a chat
  tenant's 2 k-token system prompt costs its ~100 new tokens, not 2 k); or
- earlier requests wait already: it goes behind them (fair order, :mod:`.fair_queue`).

The state behind each decision is the proxy's own accounting, current at the decision
(updated at admission, first byte and end); the engines' ``/metrics`` correct it (their KV
usage, with prefix reuse) but never gate, read every ``scrape_interval_s`` near the
watermark or while requests wait, else every ``scrape_idle_interval_s`` (a scrape costs the
engine's loop time: :mod:`pdstack.proxy.scrape_pace`): a
burst that fits goes through at once, and a held request goes the moment a running one
ends, not at the next scrape. A stale or failed scrape never blocks: the gate then counts
the proxy's requests only. Which engines are gated: the ones whose KV a request fills for
its whole life (decoders, colocated engines); prefillers hand their KV off.

Held requests wait in a bounded queue with a deadline (``queue_max``, ``queue_timeout_s``;
past either: 503, OpenAI JSON, ``Retry-After``); a tenant's ``max_queued`` bounds its own
share (429), a request predicted to wait for its first byte past its class's budget is
refused at arrival (``queue_wait``: 429, or 503 for a tenant alone on the engines or with no
tenants; not held until it times out, nor sent to be late: :mod:`pdstack.proxy.wait_budget`),
a full
queue sheds the newest waiter of the tenant holding the most of it (429: the flood pays),
and a batch tenant is refused with 429, never a 5xx. Every
decision is counted with its reason (``admitted`` / ``held`` by reason in the proxy's
metrics), beside what the gate last read from each engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Sequence

import aiohttp

from pdstack.proxy import engine_metrics, kv_gate
from pdstack.proxy.admission_config import AdmissionConfig
from pdstack.proxy.admission_queue import _SENT, AdmissionQueue
from pdstack.proxy.backends import BackendState
from pdstack.proxy.fair_queue import AdmissionRejected, FairQueue
from pdstack.proxy.kv_gate import GATED_ROLES, EngineLoad, prompt_tokens
from pdstack.proxy.kv_mark import KvMark
from pdstack.proxy.periodic import every
from pdstack.proxy.routing import PrefixIndex
from pdstack.proxy.scrape_pace import ScrapePace
from pdstack.proxy.shares import TenantLedger
from pdstack.proxy.tenants import TenantState
from pdstack.proxy.wait_budget import BUDGET_SHARE, WaitBudget

__all__ = [
    "AdmissionConfig",
    "AdmissionRejected",
    "EngineLoad",
    "KvAdmission",
    "prompt_tokens",
]


class KvAdmission(AdmissionQueue):
    """The gate. One per proxy; single-threaded (asyncio)."""

    def __init__(
        self,
        config: AdmissionConfig,
        backends: Callable[[], Iterable[BackendState]],
        headers: Callable[[], dict[str, str]] | None = None,
        block_chars: int = 256,
    ) -> None:
        """``block_chars``: the characters of one prompt block that :meth:`expect` is given
        (the prefix index's: the proxy hashes each prompt once, for both)."""
        self.config = config
        self.block_chars = block_chars
        self._backends = backends
        self._headers = headers or dict
        self.loads: dict[str, EngineLoad] = {}
        self.marks: dict[str, KvMark] = {}  # engine -> its watermark (:mod:`.kv_mark`)
        self.ledger = TenantLedger(lambda tenant, delta: self._queue.settle(tenant, delta))
        self._queue = FairQueue(config.fairness, cost=self.ledger.cost_of)
        self._expected: dict[str, int] = {}  # request id -> expected output tokens
        self._unary: set[str] = set()  # request ids of non-streaming answers
        # request id -> its prompt's block hashes and length in characters
        self._prompts: dict[str, tuple[tuple[int, ...], int]] = {}
        # the prompt blocks sent to the engines lately (one store: the prefill share is
        # judged before an engine is picked), for :meth:`to_prefill`
        self._sent = PrefixIndex(block_chars, config.sent_blocks)
        # admitted from the queue, not yet placed (hold/reserve): pump waits for them, so
        # two waiters never take the same headroom
        self._unplaced: set[str] = set()
        # called with (tenant, seconds) when a waiter leaves the queue (per-tenant metrics)
        self.on_wait: Callable[[TenantState | None, float], None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._pace = ScrapePace(config.scrape_interval_s, config.scrape_idle_interval_s)
        self._session: aiohttp.ClientSession | None = None
        # read by the proxy's /metrics (rejections are counted there, by reason)
        self.admitted_after_wait = 0
        self.wait_seconds_sum = 0.0
        self.admitted: dict[str, int] = {}  # reason -> requests that went
        self.held: dict[str, int] = {}  # reason -> requests that waited
        self.budget = WaitBudget(config.burst_growth)  # first bytes, each arrival's wait
        self.wait_budget_s = BUDGET_SHARE * config.ttft_slo_s  # an interactive request's

    # ------------------------------------------------------------ lifecycle
    async def start(self, session: aiohttp.ClientSession) -> None:
        if not self.config.enabled:
            return
        self._session = session
        await self.scrape_once()
        self._task = asyncio.create_task(
            every(lambda: self._pace.tick_s, self.scrape_due, "admission scrape failed")
        )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for waiter in self._queue.drain():
            if not waiter.future.done():
                waiter.future.cancel()

    async def scrape_once(self) -> None:
        """Read every gated engine's /metrics (the correction); a held request may fit now."""
        await self._scrape(self._gated())

    async def scrape_due(self) -> None:
        """Read the gated engines that are due (:class:`ScrapePace`): a tick of the loop."""
        now, held, kv_high = time.monotonic(), bool(self._queue), self.config.kv_high
        due = [
            b
            for b in self._gated()
            if self._pace.due(b.name, self.loads.get(b.name, EngineLoad()), kv_high, held, now)
        ]
        if due:
            await self._scrape(due)

    def _gated(self) -> list[BackendState]:
        return [b for b in self._backends() if b.role in GATED_ROLES and not b.removed]

    async def _scrape(self, gated: list[BackendState]) -> None:
        assert self._session is not None
        session, headers, timeout = self._session, self._headers(), self.config.scrape_timeout_s
        now = time.monotonic()
        for b in gated:
            self._pace.tried[b.name] = now
        await asyncio.gather(
            *(
                engine_metrics.scrape(
                    session, b.url, headers, self.loads.setdefault(b.name, EngineLoad()), timeout
                )
                for b in gated
            )
        )
        self.pump()

    # ------------------------------------------------------------ decisions
    def expect(
        self,
        request_id: str,
        max_tokens: int,
        blocks: Sequence[int] = (),
        chars: int = 0,
        stream: bool = True,
    ) -> None:
        """The output ``request_id`` is expected to add (its ``max_tokens``, 0 = unset), and
        its prompt's ``blocks`` (chain-hashed, ``block_chars`` each, of a prompt of ``chars``
        characters: a prefix shared on an engine counts once there). ``stream``: False for
        an answer whose first byte is its last (its prefill's end is not seen: it holds no
        lower class's request, interactive first)."""
        if self.config.enabled and request_id:
            cap = self.config.output_tokens
            self._expected[request_id] = min(max_tokens, cap) if max_tokens > 0 else cap
            if chars:
                self._prompts[request_id] = (tuple(blocks), chars)
            if not stream:
                self._unary.add(request_id)

    def output_of(self, request_id: str) -> int:
        return self._expected.get(request_id, self.config.output_tokens)

    def _prompt(self, request_id: str, tokens: int) -> tuple[tuple[int, ...], float]:
        """The request's prompt blocks and the tokens of one (none known: no blocks)."""
        blocks, chars = self._prompts.get(request_id, ((), 0))
        return blocks, (tokens * self.block_chars / chars if chars else 0.0)

    def to_prefill(self, request_id: str, tokens: int) -> int:
        """The prompt tokens of ``request_id`` that an engine has to compute: its ``tokens``
        less the leading blocks that earlier requests sent the engines (their prefix cache
        holds them, or the proxy believes so); all of them when its prompt is not known."""
        blocks, chars = self._prompts.get(request_id, ((), 0))
        if not blocks or not chars:
            return tokens
        cached = self._sent.cached_chars(_SENT, list(blocks))
        return max(0, round(tokens * (chars - cached) / chars))

    def check(
        self,
        backend: BackendState,
        tokens: int,
        output: int,
        tenant: str | None = None,
        request_id: str = "",
    ) -> tuple[bool, str]:
        """May ``backend`` take a request of ``tokens`` prompt + ``output`` now (of
        ``tenant``: see :meth:`_first_of_tenant`)? (yes/no, the reason). With the
        ``request_id`` of a request whose prompt the gate knows (:meth:`expect`), its
        prefix that the engine's requests hold already does not count."""
        if not self.config.enabled:
            return True, kv_gate.OPEN_IDLE
        load = self.loads.get(backend.name)
        if load is None or (not load.requests and backend.in_flight == 0):
            return True, kv_gate.OPEN_IDLE
        cap = self.config.max_running
        if cap > 0 and load.active >= cap and not self._first_of_tenant(load, tenant):
            return False, kv_gate.HELD_RUNNING
        if load.capacity_tokens <= 0:
            return True, kv_gate.OPEN_UNKNOWN
        now = time.monotonic()
        fresh = now - load.scraped_at <= self.config.stale_after_s
        mark = self.mark(backend.name)
        # room for the peak with it: the KV above its prompt's (its output is in the peak)
        room = mark.value * load.capacity_tokens - load.adds(
            tokens, *self._prompt(request_id, tokens)
        )
        if load.upper(fresh, output) <= room:
            return True, kv_gate.OPEN_FITS
        if load.projected(fresh, output) > room:
            mark.held(now)
            return False, kv_gate.HELD_KV
        if mark.at_floor and load.cautious(now, self.config.preempt_caution_s):
            mark.held(now)
            return False, kv_gate.HELD_PREEMPTING  # fits on the path, which preempted
        return True, kv_gate.OPEN_FITS

    def mark(self, name: str) -> KvMark:
        """The engine's KV watermark: ``kv_high``, learned up to ``kv_learn_max``."""
        mark = self.marks.get(name)
        if mark is None:
            c = self.config
            mark = self.marks[name] = KvMark(c.kv_high, c.kv_learn_max)
        return mark

    def is_open(
        self, backend: BackendState, tokens: int, tenant: str | None = None, request_id: str = ""
    ) -> bool:
        """``backend`` may take a request of ``tokens`` prompt (and the expected output)."""
        return self.check(backend, tokens, self.output_of(request_id), tenant, request_id)[0]

    def _over_share(self, tenant: str, tokens: int) -> bool:
        """One more request (``tokens`` to prefill) would take ``tenant`` past its share of
        the engines (running slots, prompt tokens in prefill) while another tenant is
        active."""
        if not self.config.fairness:
            return False
        engines = max(1, len(self.loads))
        return self.ledger.over_share(
            tenant, tokens, self.config.max_running * engines,
            self.config.prefill_tokens * engines,
        )  # fmt: skip

    def _yields(self, tenant: str) -> bool:
        """A request of ``tenant`` waits for a higher class's first byte (interactive
        first, :meth:`pdstack.proxy.shares.TenantLedger.yields`)."""
        c = self.config
        return c.fairness and c.interactive_first and self.ledger.yields(tenant)

    def _first_of_tenant(self, load: EngineLoad, tenant: str | None) -> bool:
        """Fair queuing's guarantee at the running cap: a tenant with nothing running (on
        any engine) may go one over the cap of a full engine (at most ``max_running`` over
        in all). An engine batches: without it, a tenant that keeps the cap full makes
        every other tenant's request wait for one of its requests to end, however fair the
        queue's order (vLLM does not preempt for the proxy)."""
        if tenant is None or not self.config.fairness:
            return False
        if load.active >= 2 * self.config.max_running:
            return False
        return not self.ledger.running(tenant)

    def open_among(
        self, candidates: Iterable[BackendState], tokens: int, request_id: str = ""
    ) -> list[BackendState]:
        return [
            b for b in candidates if b.usable and self.is_open(b, tokens, request_id=request_id)
        ]

    def prefer_open(
        self, candidates: list[BackendState], tokens: int, request_id: str = ""
    ) -> list[BackendState]:
        """The candidates with KV headroom for ``tokens``, or all of them when none has:
        routing then picks among these (admission already decided the request goes)."""
        return self.open_among(candidates, tokens, request_id) or candidates

    def _fits(
        self,
        candidates: list[BackendState],
        tokens: int,
        output: int,
        tenant: str | None,
        request_id: str = "",
    ) -> tuple[bool, str]:
        """Some usable candidate is open (to ``tenant``), or there is none at all (then
        routing answers 503 at once: admission never holds a request that no engine could
        take). The reason: the tenant's share (of all the engines, judged once), else the
        first open candidate's, else the first closed one's (a full KV before any other)."""
        usable = [b for b in candidates if b.usable]
        if not usable:
            return True, kv_gate.OPEN_UNKNOWN
        if tenant and self._over_share(tenant, self.to_prefill(request_id, tokens)):
            return False, kv_gate.HELD_SHARE
        if tenant and self._yields(tenant):
            return False, kv_gate.HELD_FIRST
        closed = ""
        for b in usable:
            ok, reason = self.check(b, tokens, output, tenant, request_id)
            if ok:
                return True, reason
            if not closed or reason == kv_gate.HELD_KV:
                closed = reason
        return False, closed

    # ------------------------------------------------------------ accounting
    def reserve(
        self, backend: BackendState, request_id: str, tokens: int, sent: bool = True
    ) -> None:
        """The request goes to ``backend``: its tokens count there (and nowhere else).
        ``sent``: its final leg goes now (False: a hold, :meth:`hold`)."""
        if self.config.enabled and backend.role in GATED_ROLES:
            for name, other in self.loads.items():
                if name != backend.name:
                    other.drop(request_id)  # its hold, or an earlier try
            load = self.loads.setdefault(backend.name, EngineLoad())
            blocks, per_block = self._prompt(request_id, tokens)
            load.add(request_id, tokens, self.output_of(request_id), blocks, per_block)
            if sent:
                load.send(request_id)
            self.pump()  # the next waiter sees this reservation

    def hold(self, candidates: Iterable[BackendState], request_id: str, tokens: int) -> None:
        """An admitted request holds its tokens on the gated candidate with the most
        headroom until its final leg reserves them on the engine it really goes to. In
        P/D the decoder is picked only after the prefill leg: without a hold, every request
        admitted meanwhile would see the same headroom."""
        if not self.config.enabled:
            return
        self._unplaced.discard(request_id)
        gated = [b for b in candidates if b.role in GATED_ROLES and b.usable]
        pool = self.prefer_open(gated, tokens, request_id)
        if pool:
            self.reserve(min(pool, key=self._fill), request_id, tokens, sent=False)
        else:
            self.pump()  # placed nowhere gated: the next waiter need not wait for it

    def _fill(self, backend: BackendState) -> float:
        load = self.loads.get(backend.name)
        if load is None or load.capacity_tokens <= 0:
            return 0.0
        fresh = time.monotonic() - load.scraped_at <= self.config.stale_after_s
        return load.upper(fresh) / load.capacity_tokens  # a ranking: the O(1) bound

    def landed(self, backend: BackendState, request_id: str) -> None:
        """The request's first byte came back: its KV is allocated on ``backend``."""
        load = self.loads.get(backend.name)
        seconds = load.land(request_id) if load is not None else None
        if seconds is not None:
            self.mark(backend.name).first_byte(seconds, time.monotonic(), self.config.ttft_slo_s)
        self.budget.landed(request_id)
        if self.ledger.landed(request_id):
            self.pump()  # its tenant's prefill share has room again

    def streamed(self, backend: BackendState, request_id: str, tokens: int) -> None:
        """``tokens`` more of the request's output went to the client from ``backend``."""
        load = self.loads.get(backend.name)
        if load is not None and tokens:
            load.stream(request_id, tokens)

    def release(self, backend: BackendState, request_id: str) -> None:
        """The request ended (or failed) on ``backend``."""
        load = self.loads.get(backend.name)
        if load is not None and load.drop(request_id):
            self.pump()

    def forget(self, request_id: str) -> None:
        """The request is over (answered, failed or cancelled): drop what it holds."""
        unplaced = request_id in self._unplaced  # admitted, and ended before its hold
        self._unplaced.discard(request_id)
        self._expected.pop(request_id, None)
        self._prompts.pop(request_id, None)
        self._unary.discard(request_id)
        self.budget.ended(request_id)
        ended = self.ledger.end(request_id)
        dropped = [load.drop(request_id) for load in self.loads.values()]
        if unplaced or ended or any(dropped):
            self.pump()
