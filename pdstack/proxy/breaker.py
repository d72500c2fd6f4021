"""Fault classification and a circuit breaker per backend (like vllm-router's).

What counts against a backend, and what does not:
- an engine's 4xx is the client's fault: answered as is, never retried, never counted;
- an engine's 5xx counts only when the engine's own ``/health`` fails right after
  (it is confirmed): then the backend is ejected and the request retried elsewhere;
  with a passing ``/health`` the request was the problem, and its 5xx goes back to the
  client as is (so no client input can eject a healthy backend);
- an engine's error event that a stream opens with (answered 200, then no token: vLLM's
  generation failed, e.g. its NIXL KV pull) is a failure before the first byte: a 4xx as
  an engine's 4xx; a 5xx is retried elsewhere whatever ``/health`` says (vLLM's
  "retryable request-level internal error"), and counts only when ``/health`` fails too;
  an error event after tokens reached the client is passed on (rewritten as the proxy's
  error), never retried, and its 5xx counts the same way;
- a connection error or a timeout counts at once, and the backend is *suspected*: its
  ``/health`` is probed right away, and a failing probe ejects it then (a frozen engine
  is out after one timeout, not after three);
- but a leg timeout on a backend that makes progress (legs on it answer, or its ``/metrics``
  counters move: :meth:`pdstack.proxy.progress.ProgressWatch.progressing`) does not count:
  the engine is busy, not dead (issue 54: a flood ejected every engine in turn); and a
  ``/health`` that times out while its ``/metrics`` answers with legs on it is load, not a
  failed probe (:meth:`pdstack.proxy.progress.ProgressWatch.busy`);
- ``eject_after`` consecutive counted failures eject it too.

Each ejection names its reason (:data:`pdstack.proxy.backends.EJECT_REASONS`), counted in
``pdstack_proxy_ejections_total{backend,reason}``.

States: closed (healthy) -> open (ejected: no traffic; ``/health`` probed every
``readmit_interval_s``, 0.5 s) -> half-open after ``readmit_after`` passing probes (traffic
again; one counted failure re-opens it at once) -> closed after ``close_after``
successful legs. Ejection aborts the backend's legs that have sent nothing to the
client, so their requests are re-routed at once instead of waiting out a timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from pdstack.proxy.backends import BackendRegistry, BackendState, probe_reason

log = logging.getLogger("pdstack.proxy")

Probe = Callable[[BackendState], Awaitable[bool]]


class Breaker:
    def __init__(
        self, registry: BackendRegistry, probe: Probe, eject_after: int, close_after: int = 2
    ) -> None:
        self.registry = registry
        self.probe = probe
        self.eject_after = eject_after
        self.close_after = close_after
        self._suspicions: dict[str, asyncio.Task[None]] = {}
        self._probes: dict[str, asyncio.Future[bool]] = {}
        # does the backend make progress now? (the proxy wires ProgressWatch.progressing)
        self.progressing: Callable[[BackendState], bool] = lambda backend: False

    async def _probe(self, backend: BackendState) -> bool:
        """One /health probe at a time per backend: concurrent callers (say, fifty
        requests answered 5xx at once) share it."""
        task = self._probes.get(backend.name)
        if task is None:
            task = asyncio.ensure_future(self.probe(backend))
            self._probes[backend.name] = task
            name = backend.name

            def forget(_: asyncio.Future[bool]) -> None:
                self._probes.pop(name, None)

            task.add_done_callback(forget)
        return await asyncio.shield(task)

    def failure(self, backend: BackendState, error: str, timed_out: bool = False) -> None:
        """A connection error or timeout: count it, and probe the backend now; a timeout
        on a backend that makes progress is not counted (busy, not dead)."""
        if timed_out and self.progressing(backend):
            backend.last_error = error
            log.info("%s; %s makes progress: busy, not counted", error, backend.name)
            return
        if backend.half_open and backend.healthy:
            backend.last_error = error
            backend.consecutive_failures += 1
            self.registry.eject(backend, f"failed while half-open: {error}", "half_open")
            return
        self.registry.record_failure(backend, error, self.eject_after)
        if backend.healthy:
            self.suspect(backend)

    def suspect(self, backend: BackendState) -> None:
        if backend.name in self._suspicions:
            return

        async def check() -> None:
            try:
                ok = await self._probe(backend)
                if not ok and backend.healthy:
                    evidence = f"suspected, then /health failed: {backend.last_error}"
                    self.registry.eject(backend, evidence, probe_reason(backend.last_error))
            finally:
                self._suspicions.pop(backend.name, None)

        self._suspicions[backend.name] = asyncio.get_running_loop().create_task(check())

    async def confirm_5xx(self, backend: BackendState, error: str) -> bool:
        """Probe the engine after a 5xx; True (and ejected) when its /health fails too."""
        if await self._probe(backend):
            return False
        backend.last_error = error
        backend.consecutive_failures += 1
        if backend.healthy:
            self.registry.eject(backend, f"{error} (and /health failed)", "engine_5xx")
        return True

    def success(self, backend: BackendState) -> None:
        backend.consecutive_failures = 0
        if backend.half_open:
            backend.half_open_successes += 1
            if backend.half_open_successes >= self.close_after:
                backend.half_open = False
                backend.half_open_successes = 0

    def close(self) -> None:
        for task in self._suspicions.values():
            task.cancel()
        for probe in self._probes.values():
            probe.cancel()
        self._suspicions.clear()
        self._probes.clear()
