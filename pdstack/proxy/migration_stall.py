"""A frozen engine's streams move within seconds; a slow engine's stay (issue 55, with issue
54's "slow is not dead").

A stream that can migrate (:mod:`pdstack.proxy.migration`) and has had no data for
``stall_probe_after_s``, on an engine that sent nothing on any leg for as long, makes the
proxy ask the engine a cheap question: ``GET /health`` within ``stall_probe_timeout_s``
(one probe at a time per engine, shared by its stalled streams, at most one per
``stall_probe_after_s``). vLLM's API server is a process of its own beside the EngineCore
that computes: a busy engine (a flood, a core shared with another engine, a step of 10-16 s
on a loaded CPU) still answers it, in milliseconds to a few hundred (measured on 2 loaded
cores: docs/self-healing.md), while a frozen one (its processes SIGSTOPped, its machine
frozen, its link down) answers nothing, not even to a new connection the kernel accepted
for it; a dead one refuses it. No answer (or a refusal), and still no data from the
stream or its engine: the stream is **frozen** and migrates now (reason ``frozen``),
instead of after the wedge confirmation (``--wedge-after`` + its no-progress budget,
~18 s) or ``--stream-idle-timeout``. Any answer, whatever its status: the stream waits,
however long the engine takes, and is probed again after another ``stall_probe_after_s``
of silence.

Only where the stream can go somewhere: another usable engine of its role and generation,
and a migration left (``--max-migrations``); otherwise it waits as before.

The stall never ejects, nor counts against the engine: the engine whose streams moved is
only *suspected* (:meth:`pdstack.proxy.breaker.Breaker.suspect`: its ``/health`` with the
full ``--health-timeout`` budget, where a ``/metrics`` that answers while legs are on it is
load), which ejects it (``unreachable``) when that fails too. Not seen here: an engine
whose API server answers while its EngineCore alone is stopped (``/health`` stays 200);
that one is wedge detection's (:mod:`pdstack.proxy.progress`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from pdstack.proxy.backends import BackendState

FROZEN = "frozen: "  # how a frozen leg's failure text begins (migration.failure_reason)


async def health_answers(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str:
    """"" when ``url``'s /health answered at all (any status) within ``timeout_s``; else
    what failed."""
    try:
        async with session.get(f"{url}/health",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await resp.read()
        return ""
    except TimeoutError:
        return f"its /health did not answer within {timeout_s:g}s"
    except aiohttp.ClientError as exc:
        return f"its /health failed ({exc.__class__.__name__})"


class StallProbes:
    """The engines' stall probes: one at a time per engine, shared by its streams."""

    def __init__(self) -> None:
        # engine name -> (time.monotonic() the probe was sent, the probe)
        self._probes: dict[str, tuple[float, asyncio.Task[str]]] = {}

    async def verdict(self, backend: BackendState, session: aiohttp.ClientSession,
                      timeout_s: float, since: float) -> str:
        """The answer ("" or what failed) of a probe of ``backend`` sent at or after
        ``since`` (a running or finished one, else a new one)."""
        held = self._probes.get(backend.name)
        if held is None or held[0] < since:
            task = asyncio.get_running_loop().create_task(
                health_answers(session, backend.url, timeout_s))
            held = self._probes[backend.name] = (time.monotonic(), task)
        return await asyncio.shield(held[1])

    def close(self) -> None:
        for _, task in self._probes.values():
            task.cancel()
        self._probes.clear()


async def watch_frozen(
    probes: StallProbes,
    backend: BackendState,
    session: aiohttp.ClientSession,
    after_s: float,
    timeout_s: float,
    last_data: Callable[[], float],
    can_move: Callable[[], bool],
) -> str:
    """Watch one stream of ``backend`` (``last_data()``: its last chunk's
    ``time.monotonic()``) until it is frozen: returns the evidence (``FROZEN`` + ...); the
    caller cancels it when the stream ends first."""
    probed_at = 0.0
    while True:
        quiet = max(last_data(), backend.last_success)
        now = time.monotonic()
        wake = max(quiet, probed_at) + after_s
        if now < wake:
            await asyncio.sleep(wake - now)
            continue
        if not can_move():
            probed_at = now
            continue
        # a probe sent since this silence began, and not more than after_s ago, will do
        error = await probes.verdict(backend, session, timeout_s, max(quiet, now - after_s))
        probed_at = time.monotonic()
        if error and max(last_data(), backend.last_success) <= quiet:
            return f"{FROZEN}no data for {probed_at - quiet:.1f}s and {error}"
