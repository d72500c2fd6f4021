"""A frozen engine's streams move within seconds; a slow engine's stay (issue 55, with issue
54's "slow is not dead").

An engine with streams that can migrate (:mod:`pdstack.proxy.migration`) and that sent no
data on any leg for ``stall_probe_after_s`` is asked a cheap question: ``GET /health``
within ``stall_probe_timeout_s`` (one watcher and one probe at a time per engine, at most
one probe per ``stall_probe_after_s`` of silence). vLLM's API server is a process of its
own beside the EngineCore that computes: a busy engine (a flood, a core shared with another
engine, a step of 10-16 s on a loaded CPU) still answers it, in milliseconds to a few
hundred (measured on 2 loaded cores: docs/self-healing.md), while a frozen one (its
processes SIGSTOPped, its machine frozen, its link down) answers nothing, not even on a
connection the kernel accepted for it; a dead one refuses it. No answer (or a refusal), and
still no data from the engine: it is **frozen**, and its streams migrate now (reason
``frozen``), instead of after the wedge confirmation (``--wedge-after`` + its no-progress
budget, ~18 s) or ``--stream-idle-timeout``. Any answer, whatever its status: its streams
wait, however long it takes, and it is probed again after another ``stall_probe_after_s``.

Only the streams that can go somewhere move: another usable engine of their role and
generation, and a migration left (``--max-migrations``); the others wait as before.

The freeze never ejects the engine, nor counts against it: it is only *suspected*
(:meth:`pdstack.proxy.breaker.Breaker.suspect`: its ``/health`` with the full
``--health-timeout`` budget, where a ``/metrics`` that answers while legs are on it is
load), which ejects it (``unreachable``) when that fails too. Not seen here: an engine whose
API server answers while its EngineCore alone is stopped (``/health`` stays 200); that one
is wedge detection's (:mod:`pdstack.proxy.progress`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from pdstack.proxy.backends import BackendState

FROZEN = "frozen: "  # how a frozen leg's failure text begins (migration.failure_reason)

# a stream's two callbacks: can it move now; it is frozen (the evidence)
Watched = tuple[Callable[[], bool], Callable[[str], None]]


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


class StallWatch:
    """The engines' streams that can migrate, one watcher task per engine that has any."""

    def __init__(self, session: Callable[[], aiohttp.ClientSession | None],
                 after_s: float, timeout_s: float) -> None:
        self._session = session
        self.after_s = after_s
        self.timeout_s = timeout_s
        self._streams: dict[str, dict[object, Watched]] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}

    def add(self, backend: BackendState, key: object, can_move: Callable[[], bool],
            frozen: Callable[[str], None]) -> None:
        """Watch a stream of ``backend`` (``key``: its leg) until :meth:`discard`."""
        self._streams.setdefault(backend.name, {})[key] = (can_move, frozen)
        if backend.name not in self._watchers:
            task = asyncio.get_running_loop().create_task(self._watch(backend))
            self._watchers[backend.name] = task

    def discard(self, backend: BackendState, key: object) -> None:
        streams = self._streams.get(backend.name)
        if streams is not None:
            streams.pop(key, None)

    async def _watch(self, backend: BackendState) -> None:
        probed_at = 0.0
        try:
            while self._streams.get(backend.name):
                quiet = backend.last_success
                now = time.monotonic()
                wake = max(quiet, probed_at) + self.after_s
                if now < wake:
                    await asyncio.sleep(wake - now)
                    continue
                probed_at = now
                session = self._session()
                if session is None or not any(
                        can() for can, _ in self._streams[backend.name].values()):
                    continue
                error = await health_answers(session, backend.url, self.timeout_s)
                probed_at = time.monotonic()
                if error and backend.last_success <= quiet:
                    evidence = f"{FROZEN}no data from it for {probed_at - quiet:.1f}s and {error}"
                    for can, frozen in list(self._streams.get(backend.name, {}).values()):
                        if can():
                            frozen(evidence)
        finally:
            self._watchers.pop(backend.name, None)
            if not self._streams.get(backend.name):
                self._streams.pop(backend.name, None)

    def close(self) -> None:
        for task in self._watchers.values():
            task.cancel()
        self._watchers.clear()
        self._streams.clear()
