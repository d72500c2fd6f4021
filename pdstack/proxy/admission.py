"""KV-aware admission: hold requests in the proxy instead of pushing engines into preemption.

vLLM admits a request as soon as its prompt fits in free KV blocks, so under load it fills
GPU KV with prompts and then preempts running requests to find room for their decode
tokens (measured on one H200 with an LMCache tier: 20-30x more preemptions, served load
flat). This gate keeps every gated engine below a KV watermark:

- every ``scrape_interval_s`` it reads each gated engine's own ``/metrics``
  (``vllm:kv_cache_usage_perc``, ``vllm:num_requests_waiting``,
  ``vllm:num_requests_running``, and once ``vllm:cache_config_info`` for the capacity);
- a request sent to an engine reserves its prompt tokens there until a scrape that began
  after its first byte (by then its KV is in the engine's own usage);
- an engine is *open* for a request while ``usage + reserved + this request <= kv_high``,
  it has at most ``max_waiting`` requests queued and, with ``max_running`` > 0, fewer than
  that many of the proxy's requests are active on it; an idle engine is always open (a
  request larger than the watermark still runs);
- the waiting gauge is not read on engines whose requests wait for a KV handoff
  (``ignores_waiting``: NIXL decoders, whose requests sit in vLLM's waiting queue until
  their KV has arrived: that wait is the transfer, not a full engine); the running cap
  still bounds them;
- when no candidate is open the request waits in a bounded queue with a deadline
  (``queue_max``, ``queue_timeout_s``); past either, the proxy answers 503 (OpenAI JSON,
  ``Retry-After``). A stale or failed scrape never blocks: that engine is judged by the
  proxy's own counts only.
- the queue is fair across tenants (:mod:`pdstack.proxy.tenants`; ``fairness``, on by
  default): one FIFO per tenant, released by start-time fair queuing (a weighted fair
  queuing variant: each waiter's tag is ``max(virtual time, its tenant's last finish)``,
  a tenant's finish advances by ``cost / weight``, the smallest tag goes first), so under
  saturation tenants share the engines in proportion to their weights, not in arrival
  order. The cost is what a request occupies: engine seconds (from the proxy's admission
  to the request's end), charged at queueing as the tenant's recent average and settled
  with the measured time when it ends (as ``tpm`` settles with the real usage). Prompt
  tokens alone undercharged a flood of short prompts with long answers: a tenant with long
  prompts waited for ~9 of the flood's requests each time (issue 24).
  Priority classes are strict: ``interactive`` waiters go before any ``batch`` one, and
  a full queue sheds its newest ``batch`` waiter (503) to make room for an
  ``interactive`` request. A tenant's ``max_queued`` bounds its own share
  (over it: 429 ``rate_limit_exceeded``). ``fairness: false`` is one FIFO (arrival order),
  the tenant bounds still counted.

Which engines are gated: the ones whose KV a request fills for its whole life (decoders,
colocated engines). Prefillers hand their KV off and are not gated.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdstack.proxy.backends import BackendState
from pdstack.proxy.periodic import every
from pdstack.proxy.tenants import TenantState

GATED_ROLES = ("decode", "colocated")
COST_EWMA = 0.2  # weight of the newest request in a tenant's average engine seconds


def _ewma(average: float | None, value: float) -> float:
    """``average`` moved toward ``value`` by COST_EWMA (``value`` itself when there is none)."""
    return value if average is None else average + COST_EWMA * (value - average)


class AdmissionRejected(Exception):
    """No gated engine had KV headroom within the deadline, or the queue was full."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # "queue_full" | "timeout" | "shed" | "max_queued"


@dataclass
class AdmissionConfig:
    enabled: bool = False
    kv_high: float = 0.85  # watermark on the engine's KV usage (0..1), reservations included
    # requests the engine itself may queue: 2 held 2 requests at 8 req/s where 0 held 12-16
    # (vLLM's waiting gauge is non-zero for a step under light load; results/h200x1 run 2)
    max_waiting: int = 2
    max_running: int = 0  # the proxy's requests active on one engine at once; 0 = no cap
    scrape_interval_s: float = 0.1
    scrape_timeout_s: float = 1.0
    stale_after_s: float = 2.0  # an older scrape is not trusted (the engine is judged open)
    queue_max: int = 4096
    queue_timeout_s: float = 60.0
    fairness: bool = True  # per-tenant fair queuing + priorities (False: one FIFO)


@dataclass
class EngineLoad:
    """One gated engine as its own /metrics and the proxy's reservations describe it."""

    kv_usage: float = 0.0
    waiting: float = 0.0
    capacity_tokens: int = 0
    scraped_at: float = 0.0  # monotonic time the last good scrape started
    # request id -> (tokens, first byte time or None)
    reserved: dict[str, tuple[int, float | None]] = field(default_factory=dict)
    # the proxy's requests sent (or held) here and not yet ended: the running cap's count;
    # every key of ``reserved`` is in it (a scrape drops the reservation, not the request)
    active: set[str] = field(default_factory=set)

    def drop(self, request_id: str) -> bool:
        """The request no longer counts here; True when it did."""
        self.reserved.pop(request_id, None)
        if request_id not in self.active:
            return False
        self.active.discard(request_id)
        return True

    def reserved_tokens(self) -> int:
        return sum(tokens for tokens, _ in self.reserved.values())

    def fill(self, extra_tokens: int = 0) -> float:
        """KV usage as the gate sees it: the engine's own, plus what requests sent since
        its last scrape (and ``extra_tokens``) will take."""
        if self.capacity_tokens <= 0:
            return self.kv_usage
        return self.kv_usage + (self.reserved_tokens() + extra_tokens) / self.capacity_tokens


def parse_engine_metrics(text: str) -> dict[str, float]:
    """The few vLLM gauges admission reads. Request counts are summed over label sets
    (an API server fronting data-parallel engines lists one per engine); KV usage is the
    fullest engine's (a fraction per engine: summing would pass 1 and read as percent)."""
    out: dict[str, float] = {}
    wanted = {
        "vllm:kv_cache_usage_perc": "kv_usage",
        "vllm:gpu_cache_usage_perc": "kv_usage",
        "vllm:num_requests_waiting": "waiting",
        "vllm:num_requests_running": "running",
    }
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        head, _, raw_value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        if name == "vllm:cache_config_info":
            labels = _labels(rest)
            try:
                blocks = int(float(labels.get("num_gpu_blocks", "0")))
                size = int(float(labels.get("block_size", "0")))
            except ValueError:
                continue
            if blocks and size:
                out["capacity_tokens"] = float(blocks * size)
            continue
        key = wanted.get(name)
        if key is None:
            continue
        try:
            value = float(raw_value)
        except ValueError:
            continue
        if key == "kv_usage":
            out[key] = max(out.get(key, 0.0), value)
        else:
            out[key] = out.get(key, 0.0) + value
    return out


def _labels(rest: str) -> dict[str, str]:
    body = rest.split("}", 1)[0]
    labels: dict[str, str] = {}
    for part in body.split('",'):
        key, _, value = part.partition("=")
        if key:
            labels[key.strip()] = value.strip().strip('"')
    return labels


def prompt_tokens(body: dict[str, Any], text_len: int, chars_per_token: float) -> int:
    """The request's prompt in tokens: exact for token-id prompts, else estimated."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    return max(1, int(text_len / chars_per_token))


class KvAdmission:
    """The gate. One per proxy; single-threaded (asyncio)."""

    def __init__(
        self,
        config: AdmissionConfig,
        backends: Callable[[], Iterable[BackendState]],
        headers: Callable[[], dict[str, str]] | None = None,
        ignores_waiting: Callable[[BackendState], bool] | None = None,
    ) -> None:
        self.config = config
        self._backends = backends
        self._headers = headers or dict
        self._ignores_waiting = ignores_waiting or (lambda backend: False)
        self.loads: dict[str, EngineLoad] = {}
        self._queue = FairQueue(config.fairness, cost=self.cost_of)
        # fair queuing's cost: engine seconds per request, a moving average per tenant
        # (bounded: the configured tenants and the default one) and over all of them
        self._cost: dict[str, float] = {}
        self._cost_all = 0.0
        # request id -> (tenant name, admitted at, cost charged in the queue or 0): requests
        # in flight only (forget() drops them)
        self._running: dict[str, tuple[str, float, float]] = {}
        self._tenant_running: dict[str, int] = {}  # tenant name -> its requests in _running
        # admitted from the queue, not yet placed (hold/reserve): pump waits for them, so
        # two waiters never take the same headroom
        self._unplaced: set[str] = set()
        # called with (tenant, seconds) when a waiter leaves the queue (per-tenant metrics)
        self.on_wait: Callable[[TenantState | None, float], None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        # read by the proxy's /metrics (rejections are counted there, by reason)
        self.admitted_after_wait = 0
        self.wait_seconds_sum = 0.0

    # ------------------------------------------------------------ lifecycle
    async def start(self, session: aiohttp.ClientSession) -> None:
        if not self.config.enabled:
            return
        self._session = session
        await self.scrape_once()
        self._task = asyncio.create_task(
            every(
                lambda: self.config.scrape_interval_s, self.scrape_once, "admission scrape failed"
            )
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
        gated = [b for b in self._backends() if b.role in GATED_ROLES and not b.removed]
        await asyncio.gather(*(self._scrape(b) for b in gated))
        self.pump()

    async def _scrape(self, backend: BackendState) -> None:
        assert self._session is not None
        load = self.loads.setdefault(backend.name, EngineLoad())
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.config.scrape_timeout_s):
                async with self._session.get(
                    f"{backend.url}/metrics", headers=self._headers()
                ) as resp:
                    if resp.status != 200:
                        return
                    text = await resp.text()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return
        values = parse_engine_metrics(text)
        if "kv_usage" not in values:
            return
        usage = values["kv_usage"]
        load.kv_usage = usage / 100.0 if usage > 1.0 else usage
        load.waiting = values.get("waiting", 0.0)
        if values.get("capacity_tokens"):
            load.capacity_tokens = int(values["capacity_tokens"])
        load.scraped_at = started
        # reservations whose first byte came before this scrape began are in kv_usage now
        for rid, (_, landed) in list(load.reserved.items()):
            if landed is not None and landed < started:
                del load.reserved[rid]

    # ------------------------------------------------------------ decisions
    def is_open(self, backend: BackendState, tokens: int, tenant: str | None = None) -> bool:
        """``backend`` may take a request of ``tokens`` now (of ``tenant``: see
        :meth:`_first_of_tenant` for the running cap)."""
        if not self.config.enabled:
            return True
        load = self.loads.get(backend.name)
        if load is None or (not load.active and backend.in_flight == 0):
            return True  # idle (or never scraped): always open
        cap = self.config.max_running
        if cap > 0 and len(load.active) >= cap and not self._first_of_tenant(load, tenant):
            return False  # the proxy's own count: needs no scrape
        fresh = time.monotonic() - load.scraped_at <= self.config.stale_after_s
        if not fresh or load.capacity_tokens <= 0:
            return True  # no trustworthy numbers: do not block on them
        if load.waiting > self.config.max_waiting and not self._ignores_waiting(backend):
            return False
        return load.fill(tokens) <= self.config.kv_high

    def _first_of_tenant(self, load: EngineLoad, tenant: str | None) -> bool:
        """Fair queuing's guarantee at the running cap: a tenant with nothing running (on
        any engine) may go one over the cap of a full engine (at most ``max_running`` over in all).
        An engine batches: without it, a tenant that keeps the cap full makes every other
        tenant's request wait for one of its requests to end, however fair the queue's
        order (vLLM does not preempt for the proxy), and that wait, not the queue, is
        what a flood then costs the others."""
        if tenant is None or not self.config.fairness:
            return False
        if len(load.active) >= 2 * self.config.max_running:
            return False
        return not self._tenant_running.get(tenant)

    def open_among(self, candidates: Iterable[BackendState], tokens: int) -> list[BackendState]:
        return [b for b in candidates if b.usable and self.is_open(b, tokens)]

    def prefer_open(self, candidates: list[BackendState], tokens: int) -> list[BackendState]:
        """The candidates with KV headroom for ``tokens``, or all of them when none has:
        routing then picks among these (admission already decided the request goes)."""
        return self.open_among(candidates, tokens) or candidates

    def reserve(self, backend: BackendState, request_id: str, tokens: int) -> None:
        """The request goes to ``backend``: its tokens count there (and nowhere else)."""
        if self.config.enabled and backend.role in GATED_ROLES:
            for name, other in self.loads.items():
                if name != backend.name:
                    other.drop(request_id)  # its hold, or an earlier try
            load = self.loads.setdefault(backend.name, EngineLoad())
            load.reserved[request_id] = (tokens, None)
            load.active.add(request_id)
            self.pump()  # the next waiter sees this reservation

    def hold(self, candidates: Iterable[BackendState], request_id: str, tokens: int) -> None:
        """An admitted request holds its tokens on the gated candidate with the most
        headroom until its final leg reserves them on the engine it really goes to. In
        P/D the decoder is picked only after the prefill leg: without a hold, every request
        admitted meanwhile (a burst, or one waiter per scrape) would see the same headroom."""
        if not self.config.enabled:
            return
        self._unplaced.discard(request_id)
        gated = [b for b in candidates if b.role in GATED_ROLES and b.usable]
        pool = self.prefer_open(gated, tokens)
        if pool:
            self.reserve(min(pool, key=self._fill), request_id, tokens)
        else:
            self.pump()  # placed nowhere gated: the next waiter need not wait for it

    def forget(self, request_id: str) -> None:
        """The request is over (answered, failed or cancelled): drop what it holds."""
        unplaced = request_id in self._unplaced  # admitted, and ended before its hold
        self._unplaced.discard(request_id)
        self._settle(request_id)
        dropped = [load.drop(request_id) for load in self.loads.values()]
        if unplaced or any(dropped):
            self.pump()

    def _fill(self, backend: BackendState) -> float:
        load = self.loads.get(backend.name)
        return 0.0 if load is None else load.fill()

    def landed(self, backend: BackendState, request_id: str) -> None:
        """The request's first byte came back: its KV is allocated on ``backend``."""
        load = self.loads.get(backend.name)
        if load is not None and request_id in load.reserved:
            tokens, _ = load.reserved[request_id]
            load.reserved[request_id] = (tokens, time.monotonic())

    def release(self, backend: BackendState, request_id: str) -> None:
        """The request ended (or failed) on ``backend``."""
        load = self.loads.get(backend.name)
        if load is not None and load.drop(request_id):
            self.pump()

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
        queue = self._queue
        if not queue and self._fits(candidates(), tokens, name):
            self._start(request_id, name, 0.0)
            return
        if tenant is not None:
            cap = tenant.policy.max_queued
            if cap and tenant.queued >= cap:
                raise AdmissionRejected(
                    "max_queued",
                    f"tenant {tenant.name!r} is at its max_queued limit ({cap} requests "
                    "waiting for the engines); retry later",
                )
        rank = tenant.policy.rank if tenant is not None else 0
        if len(queue) >= self.config.queue_max and not self._shed_for(rank):
            raise AdmissionRejected(
                "queue_full",
                f"every engine is near its KV limit and {len(queue)} requests wait "
                "already; retry later",
            )
        waiter = _Waiter(
            candidates, tokens, asyncio.get_running_loop().create_future(), tenant, request_id
        )
        queue.push(waiter)
        if tenant is not None:
            tenant.queued += 1
        # it may go now: first of its tenant (over the running cap), or the head of a queue
        # whose engines freed up since the last event; else at the next release or scrape
        self.pump()
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.config.queue_timeout_s):
                await waiter.future
        except TimeoutError:
            raise AdmissionRejected(
                "timeout",
                f"no engine had KV headroom within {self.config.queue_timeout_s:g} s; "
                "retry later",
            ) from None
        finally:
            queue.discard(waiter)
            if tenant is not None:
                tenant.queued -= 1
            waited = time.monotonic() - started
            self.wait_seconds_sum += waited
            if self.on_wait is not None:
                self.on_wait(tenant, waited)
        self.admitted_after_wait += 1  # counted in _running when admitted (_admit)

    def cost_of(self, tenant: str) -> float:
        """What a request of ``tenant`` is charged in the fair queue before it has run:
        its tenant's average engine seconds, else every tenant's, else 1 s."""
        return self._cost.get(tenant) or self._cost_all or 1.0

    def _settle(self, request_id: str) -> None:
        """The request ended: its measured engine time updates its tenant's average and
        corrects what its queueing charged."""
        entry = self._running.pop(request_id, None)
        if entry is None:
            return
        name, admitted, charged = entry
        left = self._tenant_running.get(name, 1) - 1
        if left > 0:
            self._tenant_running[name] = left
        else:
            self._tenant_running.pop(name, None)
        seconds = max(time.monotonic() - admitted, 1e-3)
        self._cost[name] = _ewma(self._cost.get(name), seconds)
        self._cost_all = _ewma(self._cost_all or None, seconds)
        if charged:
            self._queue.settle(name, seconds - charged)

    def _shed_for(self, rank: int) -> bool:
        """A full queue: drop its newest waiter of a lower class than ``rank`` (503 to
        it); False when there is none."""
        victim = self._queue.newest_below(rank) if self.config.fairness else None
        if victim is None:
            return False
        self._queue.discard(victim)
        if not victim.future.done():
            victim.future.set_exception(
                AdmissionRejected(
                    "shed",
                    "shed for an interactive request: every engine is near its KV limit "
                    "and the queue is full; retry later",
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
            if self._fits(head.candidates(), head.tokens, _tenant_name(head)):
                self._admit(head)
                return
            # the head waits for the running cap; a tenant with nothing running on a full
            # engine need not (one over the cap, _first_of_tenant): the other flows' heads
            for w in queue.flow_heads():
                if w is not head and not w.future.done() and self._fits(
                    w.candidates(), w.tokens, _tenant_name(w)
                ):
                    self._admit(w)
            return

    def _admit(self, w: _Waiter) -> None:
        """``w`` leaves the queue admitted, and counts as its tenant's at once (before its
        task runs again: the next pump sees it)."""
        self._queue.pop(w)
        if w.request_id:
            self._unplaced.add(w.request_id)
        self._start(w.request_id, _tenant_name(w), w.cost)
        w.future.set_result(None)

    def _start(self, request_id: str, tenant: str, charged: float) -> None:
        """An admitted request: its engine time is measured from now until :meth:`forget`
        (the fair cost), and it counts for its tenant (the running cap's guarantee)."""
        if request_id:
            if request_id not in self._running:
                self._tenant_running[tenant] = self._tenant_running.get(tenant, 0) + 1
            self._running[request_id] = (tenant, time.monotonic(), charged)

    def _fits(self, candidates: list[BackendState], tokens: int, tenant: str | None) -> bool:
        """Some usable candidate is open (to ``tenant``), or there is none at all (then
        routing answers 503 at once: admission never holds a request that no engine could
        take)."""
        usable = [b for b in candidates if b.usable]
        return not usable or any(self.is_open(b, tokens, tenant) for b in usable)

    @property
    def queued(self) -> int:
        return len(self._queue)


def _tenant_name(w: _Waiter) -> str:
    return w.tenant.name if w.tenant is not None else ""


@dataclass(eq=False)
class _Waiter:
    candidates: Callable[[], list[BackendState]]
    tokens: int
    future: asyncio.Future[None]
    tenant: TenantState | None = None
    request_id: str = ""
    cost: float = 0.0  # charged in the fair queue (set when it becomes its flow's head)
    tag: float = 0.0  # start tag (fair queuing; set when it becomes its flow's head)
    queued: bool = False
    seq: int = 0  # arrival order


@dataclass(eq=False)
class _Flow:
    """One tenant's waiters (fair queuing) and the finish tag of its last one."""

    waiters: deque[_Waiter] = field(default_factory=deque)
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
        self._fifo: deque[_Waiter] = deque()
        self._flows: dict[str, _Flow] = {}
        self._vtime = 0.0
        self._len = 0
        self._seq = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def push(self, w: _Waiter) -> None:
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
            flow = self._flows[name] = _Flow()
            if w.tenant is not None:
                flow.rank, flow.weight = w.tenant.policy.rank, w.tenant.policy.weight
        flow.waiters.append(w)
        if len(flow.waiters) == 1:
            self._tag(name, flow)

    def _tag(self, name: str, flow: _Flow) -> None:
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

    def head(self) -> _Waiter | None:
        """The waiter to admit next (not removed)."""
        if not self.fair:
            return self._fifo[0] if self._fifo else None
        best: _Waiter | None = None
        best_rank = 0
        for flow in self._flows.values():
            if not flow.waiters:
                continue
            w = flow.waiters[0]
            if best is None or (flow.rank, w.tag) < (best_rank, best.tag):
                best, best_rank = w, flow.rank
        return best

    def flow_heads(self) -> list[_Waiter]:
        """Each tenant's first waiter (fair queuing; none with one FIFO)."""
        return [f.waiters[0] for f in self._flows.values() if f.waiters] if self.fair else []

    def pop(self, w: _Waiter) -> None:
        """``w`` (the head, or a flow's head going over the running cap) is admitted:
        virtual time moves to its tag."""
        if self.fair:
            self._vtime = max(self._vtime, w.tag)
        self.discard(w, admitted=True)

    def discard(self, w: _Waiter, admitted: bool = False) -> None:
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

    def newest_below(self, rank: int) -> _Waiter | None:
        """The most recent waiter of a class below ``rank`` (a larger rank number)."""
        victims = [f.waiters[-1] for f in self._flows.values() if f.waiters and f.rank > rank]
        return max(victims, key=lambda w: w.seq, default=None)

    def drain(self) -> list[_Waiter]:
        out = [*self._fifo, *(w for f in self._flows.values() for w in f.waiters)]
        self._fifo.clear()
        self._flows.clear()
        self._len = 0
        return out
