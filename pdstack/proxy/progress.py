"""Wedge detection: an engine that accepts requests and makes no progress.

``/health`` only says the engine's API server answers: vLLM's passes while its engine core
is stuck (a stopped or blocked EngineCore, a request parked for good in
``WAITING_FOR_REMOTE_KVS``), and such an engine takes every request routed to it and answers
none. The proxy sees it from its own legs, at no cost while the engine works:

- a *suspect*: a leg to the backend has waited longer than ``wedge_after_s`` for its answer
  (prefill) or first byte (decode), and no leg on that backend got one since that leg was
  sent (``BackendState.pending`` ages vs ``last_success``); or legs are streaming from it
  and no chunk came from any of them for ``wedge_after_s`` (``BackendState.streaming``). A
  busy engine answers other legs meanwhile and is never suspected; one long request alone
  is, once;
- the *confirmation*: a real one-token generation with a deadline (``wedge_probe_timeout_s``)
  on the suspect. It answers: the engine is slow, not wedged (nothing happens). It does
  not: the backend is **wedged** — ejected (its waiting legs are aborted and re-routed at
  once, not after their budget; its stalled streams end with an error event), counted in
  ``pdstack_proxy_wedged_total{backend}``, logged as ``wedged backend NAME (URL): ...``, and
  re-admitted only when that generation answers again (a bare ``/health`` is no evidence
  for it).

Replacing a wedged engine (a restart) is not the proxy's job: the engine container's own
healthcheck sees the same thing from the engine's ``/metrics`` (requests waiting or
running, progress counters flat) and ends the engine, and the restart policy starts it
again (docs/CONTRACTS.md, "Self-healing").
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from pdstack.proxy.backends import BackendRegistry, BackendState, PendingLegs

log = logging.getLogger("pdstack.proxy")


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
    """Suspects stuck backends each health round and confirms them with a generation."""

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

    def stuck_for(self, backend: BackendState, now: float) -> float:
        """Seconds ``backend`` has kept a leg waiting with no sign of progress (0: not
        stuck): the oldest leg waiting for its answer or first byte, when nothing came
        from the backend since it was sent; or, while legs stream, the time since the
        last chunk or answer from any leg (a core that stops mid-stream leaves its streams
        hanging, and a router that balances by load then sends it nothing new)."""
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

    async def probe(self, backend: BackendState) -> str:
        session = self._session()
        if session is None:
            return "no client session"
        return await generation_probe(
            session,
            backend,
            self._registry().served_model_name,
            self._headers(),
            self.config.wedge_probe_timeout_s,
        )

    async def _confirm(self, backend: BackendState, stuck: float) -> None:
        try:
            error = await self.probe(backend)
            if not error or not backend.healthy:
                return
            backend.wedged = True
            reason = f"wedged: a leg waited {stuck:.1f}s with no progress, and {error}"
            log.warning(
                "wedged backend %s (%s): accepts requests, makes no progress (%s)",
                backend.name,
                backend.url,
                error,
            )
            self._on_wedged(backend)
            self._registry().eject(backend, reason)
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
        for task in self._checks.values():
            task.cancel()
        self._checks.clear()
