"""Wedge detection: an engine that accepts requests and makes no progress; slow is not dead.

``/health`` only says the engine's API server answers: vLLM's passes while its engine core
is stuck (a stopped or blocked EngineCore, a request parked for good in
``WAITING_FOR_REMOTE_KVS``), and such an engine takes every request routed to it and answers
none. A busy engine (a flood, a core shared with another engine, a step blocked on KV loads)
is slow, not dead: it must never be ejected for it. The proxy tells them apart from what the
engine does, at no cost while it works:

- *progress*: a leg on it answered or streamed a chunk, or its ``/metrics`` progress counters
  moved (``vllm:prompt_tokens_total`` + ``vllm:generation_tokens_total`` +
  ``vllm:request_success_total``, what the engine container's watchdog reads:
  :mod:`pdstack.sidecars`) between two reads. A backend with legs in flight has its
  ``/metrics`` read with each ``/health`` probe (:meth:`ProgressWatch.sample`); either sign
  sets ``BackendState.last_success``;
- a *suspect*: a leg to the backend has waited longer than ``wedge_after_s`` for its answer
  (prefill) or first byte (decode) with no progress since it was sent, or legs stream from
  it and none got a chunk for ``wedge_after_s`` with no progress meanwhile;
- the *confirmation*: a real one-token generation and, meanwhile, the engine's counters read
  again and again, for the no-progress budget: ``wedge_probe_timeout_s`` x (1 + requests it
  holds / 4), at most 6 x (a busy engine's probe queues behind everything, and one step of
  a loaded CPU engine may take 10-16 s). The counters move or the generation answers: slow,
  not wedged (nothing happens). Neither, for the whole budget: **wedged** -- ejected (reason
  ``wedged_no_progress``; ``unreachable`` when no ``/metrics`` read answered either), its
  waiting legs aborted and re-routed at once, its stalled streams ended with an error event,
  counted in ``pdstack_proxy_wedged_total{backend}``, logged as ``wedged backend NAME (URL):
  ...``, and re-admitted only when that generation answers again (a bare ``/health`` is no
  evidence for it);
- a ``/health`` probe that times out while the engine's ``/metrics`` answers, with legs on
  it, is load, not death (:meth:`ProgressWatch.busy`: not counted); one where nothing
  answers is (the host unreachable: a link down, a machine gone);
- a leg's budget (``ctx.budget_s``, sized by its prompt) that runs out while its engine makes
  progress is extended (:meth:`ProgressWatch.leg_deadline`) by steps of ``wedge_after_s``,
  up to the budget x (1 + requests the engine holds) and ``request_timeout_s``: it waits
  behind the engine's queue instead of being cut; a leg timeout on a progressing engine does
  not count against it (:mod:`pdstack.proxy.breaker`).

Replacing a wedged engine (a restart) is not the proxy's job: the engine container's own
healthcheck sees the same thing from the engine's ``/metrics`` (requests waiting or
running, progress counters flat) and ends the engine, and the restart policy starts it
again (docs/CONTRACTS.md, "Self-healing").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from pdstack.proxy.backends import BackendRegistry, BackendState, PendingLegs
from pdstack.proxy.engine_metrics import parse_engine_metrics

log = logging.getLogger("pdstack.proxy")

HELD_PER_BUDGET = 4  # requests held that add one wedge_probe_timeout_s to the budget
MAX_BUDGETS = 6  # the no-progress budget is at most this many wedge_probe_timeout_s
# what the confirmation's own 1-token generation may add to the counters (its prompt's few
# tokens, one generated, one finished): moving by no more than this is no progress
PROBE_SLACK = 4.0


async def generation_probe(
    session: aiohttp.ClientSession,
    backend: BackendState,
    model: str,
    headers: dict[str, str],
    timeout_s: float,
) -> str:
    """One real 1-token completion on ``backend`` within ``timeout_s``: "" when it answered
    200, else what went wrong."""
    body = {"prompt": "ping", "max_tokens": 1, "stream": False, "temperature": 0}
    if model:
        body["model"] = model
    try:
        async with session.post(
            f"{backend.url}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **headers},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            await resp.read()
            return "" if resp.status == 200 else f"a 1-token generation answered {resp.status}"
    except TimeoutError:
        return f"a 1-token generation did not answer within {timeout_s:g}s"
    except aiohttp.ClientError as exc:
        return f"a 1-token generation failed: {exc.__class__.__name__} {exc}".strip()


class ProgressWatch:
    """Reads engines' progress, suspects stuck backends each health round and confirms them
    (a generation and the counters, for the no-progress budget); extends the legs of
    backends that make progress."""

    def __init__(
        self,
        registry: Callable[[], BackendRegistry],
        session: Callable[[], aiohttp.ClientSession | None],
        headers: Callable[[], dict[str, str]],
        config: Any,
        on_wedged: Callable[[BackendState], None],
    ) -> None:
        self._registry = registry
        self._session = session
        self._headers = headers
        self.config = config
        self._on_wedged = on_wedged
        self._checks: dict[str, asyncio.Task[None]] = {}
        self._reads: dict[str, asyncio.Task[bool | None]] = {}

    # ------------------------------------------------------------------ the engine's progress
    async def read(self, backend: BackendState, credit: bool = True) -> bool | None:
        """Read the engine's /metrics (within ``health_timeout_s``): None when it did not
        answer; else whether its progress counters moved since the previous read (which then
        counts as progress, with ``credit``: ``last_success`` is set to that previous read's
        time)."""
        session = self._session()
        if session is None:
            return None
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        try:
            async with session.get(
                f"{backend.url}/metrics", headers=self._headers(), timeout=timeout
            ) as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
            return None
        series = parse_engine_metrics(text)
        progress = series.get("progress")
        held = int(series.get("running", 0.0) + series.get("waiting", 0.0))
        now = time.monotonic()
        mark, mark_at = backend.progress_mark, backend.progress_mark_at
        backend.progress_mark, backend.progress_mark_at = progress, now
        backend.engine_held = held
        moved = progress is not None and mark is not None and progress != mark
        if moved and credit:
            # it progressed after the previous read at the latest: credit that time (a
            # conservative one when reads are far apart)
            backend.last_success = max(backend.last_success, mark_at)
        return moved

    def sample(self, backend: BackendState) -> asyncio.Task[bool | None] | None:
        """A read of ``backend``'s /metrics alongside its /health probe, when legs are in
        flight on it (None: none, or wedge detection off); one at a time per backend."""
        if self.config.wedge_after_s <= 0:
            return None
        if not (backend.in_flight or backend.pending or backend.streaming):
            return None
        task = self._reads.get(backend.name)
        if task is None or task.done():
            # while a confirmation runs its own probe may move the counters: not credited
            credit = backend.name not in self._checks
            task = asyncio.get_running_loop().create_task(self.read(backend, credit))
            self._reads[backend.name] = task
        return task

    async def busy(self, backend: BackendState, sample: asyncio.Task[bool | None] | None) -> bool:
        """After its /health timed out: True when ``backend`` is loaded, not gone -- legs are
        in flight on it and its /metrics answered (``sample``); its counters, flat or not,
        are then the wedge confirmation's to judge, not a health probe's."""
        if sample is None:
            return False
        moved = await sample
        if moved is None:
            return False
        log.debug(
            "backend %s (%s): /health timed out while its /metrics answered (counters %s, "
            "%d request(s) held): load, not death", backend.name, backend.url,
            "moving" if moved else "flat", self.held(backend),
        )
        return True

    def held(self, backend: BackendState) -> int:
        """Requests the engine holds: its own gauges at the last read, or the proxy's legs
        on it when more."""
        return max(backend.engine_held, backend.in_flight)

    def progressing(self, backend: BackendState) -> bool:
        """``backend`` showed progress within the last ``wedge_after_s`` + a health round
        (the reads' pace); False with wedge detection off."""
        after = self.config.wedge_after_s
        window = after + self.config.health_interval_s
        return after > 0 and time.monotonic() - backend.last_success <= window

    def budget(self, backend: BackendState) -> float:
        """How long the engine's counters must stay flat, a generation unanswered, before it
        is wedged: ``wedge_probe_timeout_s`` x (1 + held / 4), at most 6 x."""
        scale = min(float(MAX_BUDGETS), 1.0 + self.held(backend) / HELD_PER_BUDGET)
        return self.config.wedge_probe_timeout_s * scale

    @contextlib.asynccontextmanager
    async def leg_deadline(self, backend: BackendState, budget: float) -> AsyncIterator[None]:
        """``asyncio.timeout(budget)`` for a leg on ``backend``, except that a budget that
        runs out while the engine makes progress is extended by steps of ``wedge_after_s``,
        up to ``budget`` x (1 + requests it holds) and ``request_timeout_s``: a leg queued
        behind a busy engine's work is not cut (TimeoutError when it is)."""
        step = self.config.wedge_after_s
        if step <= 0:
            async with asyncio.timeout(budget):
                yield
            return
        loop = asyncio.get_running_loop()
        start = loop.time()
        handles: list[asyncio.TimerHandle] = []
        async with asyncio.timeout(None) as deadline:

            # check gets itself from its timer: a closure that names itself is a reference
            # cycle, freed by a garbage collection only (benchmarks/loop_lag.py)
            def check(again: Callable[[Any], None]) -> None:
                now = loop.time()
                cap = min(self.config.request_timeout_s, budget * (1 + self.held(backend)))
                if now - start < cap and self.progressing(backend):
                    handles[0] = loop.call_at(min(now + step, start + cap), again, again)
                else:
                    deadline.reschedule(now)

            handles.append(loop.call_at(start + budget, check, check))
            try:
                yield
            finally:
                handles.pop().cancel()

    # ------------------------------------------------------------------ suspects
    def stuck_for(self, backend: BackendState, now: float) -> float:
        """Seconds ``backend`` has kept a leg waiting with no sign of progress (0: not
        stuck): the oldest leg waiting for its answer or first byte, when no progress came
        from the backend since it was sent; or, while legs stream, the time since the
        last progress (a core that stops mid-stream leaves its streams hanging, and a
        router that balances by load then sends it nothing new)."""
        stuck = 0.0
        oldest = backend.pending.oldest()
        if oldest is not None and backend.last_success < oldest:
            stuck = now - oldest
        if backend.streaming:
            stuck = max(stuck, now - backend.last_success)
        return stuck

    def round(self) -> None:
        """Start a confirmation on every healthy backend stuck past ``wedge_after_s``."""
        after = self.config.wedge_after_s
        if after <= 0:
            return
        now = time.monotonic()
        for b in list(self._registry().backends.values()):
            if not b.healthy or b.removed or b.name in self._checks:
                continue
            stuck = self.stuck_for(b, now)
            if stuck > after:
                task = asyncio.get_running_loop().create_task(self._confirm(b, stuck))
                self._checks[b.name] = task

    async def probe(self, backend: BackendState, timeout_s: float | None = None) -> str:
        session = self._session()
        if session is None:
            return "no client session"
        return await generation_probe(
            session,
            backend,
            self._registry().served_model_name,
            self._headers(),
            timeout_s or self.config.wedge_probe_timeout_s,
        )

    async def _watch(self, backend: BackendState, budget: float) -> tuple[str, bool, str]:
        """The confirmation: a generation, and the counters read every ``budget`` / 5 (at
        most 1 s), until one shows progress or the budget ends. Returns (the generation's
        error, "" when it answered or progress was seen; whether /metrics answered; the
        counters' evidence)."""
        probe = asyncio.get_running_loop().create_task(self.probe(backend, budget))
        try:
            started = time.monotonic()
            answered = await self.read(backend, credit=False) is not None
            base = backend.progress_mark
            poll = max(0.05, min(1.0, budget / 5))
            while not probe.done():
                left = started + budget - time.monotonic()
                if left <= 0:
                    break
                await asyncio.wait({probe}, timeout=min(left, poll))
                if probe.done():
                    break
                answered = await self.read(backend, credit=False) is not None or answered
                if base is None:
                    base = backend.progress_mark
                elif self._advanced(backend, base):
                    backend.last_success = time.monotonic()
                    return "", True, (f"its progress counters moved from {base:g} to "
                                      f"{backend.progress_mark:g}")
            if probe.done():
                error = probe.result()
            else:
                error = f"a 1-token generation did not answer within {budget:.1f}s"
            if not answered:
                evidence = "its /metrics did not answer either"
            elif base is None:
                evidence = "it exports no progress counters"
            else:
                evidence = (f"its progress counters stayed at {base:g} for "
                            f"{time.monotonic() - started:.1f}s with "
                            f"{self.held(backend)} request(s) held")
            return error, answered, evidence
        finally:
            if not probe.done():
                probe.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await probe

    @staticmethod
    def _advanced(backend: BackendState, base: float) -> bool:
        """The counters moved from ``base`` by more than the probe's own share (or went back:
        the engine restarted)."""
        mark = backend.progress_mark
        return mark is not None and abs(mark - base) > PROBE_SLACK

    async def _confirm(self, backend: BackendState, stuck: float) -> None:
        try:
            budget = self.budget(backend)
            error, answered, evidence = await self._watch(backend, budget)
            if not error or not backend.healthy:
                if not error:
                    log.info("backend %s (%s) is slow, not wedged (a leg waited %.1fs): %s",
                             backend.name, backend.url, stuck, evidence or "a generation answered")
                return
            backend.wedged = True
            reason = "wedged_no_progress" if answered else "unreachable"
            evidence = f"wedged: a leg waited {stuck:.1f}s with no progress, {evidence}, and " \
                f"{error}"
            log.warning(
                "wedged backend %s (%s): accepts requests, makes no progress (%s)",
                backend.name,
                backend.url,
                error,
            )
            self._on_wedged(backend)
            self._registry().eject(backend, evidence, reason)
            # its streams have stalled with it: end them now (an error event to each
            # client, pdstack.proxy.legs) instead of after the stream idle timeout
            streams, backend.streaming = backend.streaming, PendingLegs()
            for proto in streams:
                proto.abort()
        finally:
            self._checks.pop(backend.name, None)

    async def readmissible(self, backend: BackendState) -> tuple[bool, str]:
        """For a wedged backend whose /health passes: does it generate again?"""
        error = await self.probe(backend)
        if error:
            return False, f"still wedged: {error}"
        backend.wedged = False
        log.warning("backend %s (%s) makes progress again", backend.name, backend.url)
        return True, ""

    def close(self) -> None:
        for task in (*self._checks.values(), *self._reads.values()):
            task.cancel()
        self._checks.clear()
        self._reads.clear()
