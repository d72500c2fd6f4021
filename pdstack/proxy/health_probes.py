"""The proxy's health probes: each backend's ``/health`` every round (and the ones out of
rotation more often, so a restarted engine is back within seconds), and what a failed probe
means: an unreachable host with a leg stuck on it is ejected at once, a slow probe of a busy
engine is not (slow is not dead: :mod:`pdstack.proxy.progress`), and an ejected backend's
silent streams end (their clients get an error event, or a migration: :mod:`.migration`).
A base of :class:`pdstack.proxy.app.Proxy`, which owns the state named here."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from pdstack.proxy.backends import BackendRegistry, BackendState, PendingLegs, probe_reason
from pdstack.proxy.config import ProxyConfig
from pdstack.proxy.metrics import ProxyMetrics
from pdstack.proxy.progress import ProgressWatch

log = logging.getLogger("pdstack.proxy")


class HealthProbes:
    config: ProxyConfig
    registry: BackendRegistry
    session: aiohttp.ClientSession | None
    progress: ProgressWatch
    metrics: ProxyMetrics
    _probing: set[str]

    async def probe_all(self) -> None:
        backends = [b for b in self.registry.backends.values() if b.name not in self._probing]
        await asyncio.gather(*(self.probe(b) for b in backends))
        self.progress.round()  # wedged engines: stuck legs, confirmed by a generation
        self.registry.refresh_rotation()  # standbys in or out, logged without traffic too

    def _readmit_pace(self) -> float:
        """The re-admission loop's sleep: readmit_interval_s, or the health round's when that
        is shorter or the loop is off (0: it then finds nothing the rounds do not probe)."""
        fast = self.config.readmit_interval_s
        slow = self.config.health_interval_s
        return fast if 0 < fast < slow else slow

    async def probe_down(self) -> None:
        """Probe the backends out of rotation between health rounds (never admitted yet, or
        ejected; not wedged, not removed): a restarted engine is routable again within about
        readmit_after x readmit_interval_s of its /health passing, not readmit_after health
        rounds."""
        fast = self.config.readmit_interval_s
        if not 0 < fast < self.config.health_interval_s:
            return
        down = [b for b in self.registry.backends.values()
                if not b.healthy and not b.wedged and not b.removed and b.name not in self._probing]
        await asyncio.gather(*(self.probe(b) for b in down))

    async def probe(self, backend: BackendState) -> bool:
        """Check the engine's /health now (and record it); True when it passed."""
        assert self.session is not None
        self._probing.add(backend.name)
        ok, error, unreachable = False, "", False
        started = time.monotonic()
        sample = self.progress.sample(backend)  # its /metrics too, while legs are on it
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
            async with self.session.get(f"{backend.url}/health", timeout=timeout) as resp:
                await resp.read()
                ok = resp.status == 200
                error = "" if ok else f"/health answered {resp.status}"
            if ok and backend.wedged:
                ok, error = await self.progress.readmissible(backend)
        except TimeoutError:
            error = "/health timed out"
            if backend.last_success >= started or await self.progress.busy(backend, sample):
                # it answered real requests meanwhile, or its /metrics answers with legs on
                # it: a slow probe (busy event loop or busy engine) is no evidence of death
                return True
            unreachable = True
        except aiohttp.ClientError as exc:
            error = f"/health failed: {exc.__class__.__name__} {exc}".strip()
            unreachable = True
        finally:
            self._probing.discard(backend.name)
        if unreachable:  # before the probe counts: the more specific diagnosis ejects first,
            # also where this failure is the eject_after-th (a host starved before its link
            # went: an earlier timeout; the two-node lab's flake of stop 47)
            self._eject_if_unreachable(backend, error)
        self.registry.record_probe(backend, ok, error, self.config)
        if not ok and not backend.healthy:
            self._end_silent_streams(backend)  # ejected before its streams went quiet
        return ok

    def _eject_if_unreachable(self, backend: BackendState, error: str) -> None:
        """A backend whose /health could not be reached (timed out, refused) while a leg has
        waited on it longer than the wedge budget with nothing from it since it was sent: its
        host is lost (a link down, a machine gone), so it is ejected now and its waiting legs
        re-routed (``_on_eject``), at this probe, not after ``eject_after`` probes or a wedge
        probe's timeout (issue 38: a cut KV pull waited 12 s). Not the last usable backend of
        its role (its legs could go nowhere; the health budget decides for it), and not on a
        probe alone: a backend with no leg stuck on it, or that answered since, stays in."""
        after = self.config.wedge_after_s
        if after <= 0 or not backend.healthy:
            return
        oldest = backend.pending.oldest()
        now = time.monotonic()
        if oldest is None or now - oldest <= after or backend.last_success >= oldest:
            return
        others = self.registry.by_role(backend.role, standbys=True)  # a standby stands in
        if not any(b.usable and b is not backend for b in others):
            return
        self.registry.eject(
            backend, f"unreachable: {error}, and a leg waited {now - oldest:.1f}s with nothing "
            f"from it", probe_reason(error)
        )

    def _on_eject(self, backend: BackendState) -> None:
        self.metrics.ejections.labels(backend.name, backend.eject_reason or "other").inc()
        # its legs that have sent nothing to a client: abort now, so they are re-routed
        pending, backend.pending = backend.pending, PendingLegs()
        for proto in pending:
            proto.abort()
        self._end_silent_streams(backend)

    def _end_silent_streams(self, backend: BackendState) -> None:
        """An ejected backend's streams, when none of them sent a byte for the wedge budget:
        the engine is gone (its host lost, a link down), so they end now with an error event
        to each client (pdstack.proxy.legs), not after the stream idle timeout. Called at the
        ejection and at each failed probe after it; streams that still flow are left alone
        (a slow /health is no evidence of death)."""
        silent = time.monotonic() - backend.last_success
        if backend.streaming and silent >= self.config.wedge_after_s:
            log.warning(
                "ending %d stream(s) of ejected backend %s: no data from it for %.1fs",
                len(backend.streaming), backend.name, silent,
            )
            streams, backend.streaming = backend.streaming, PendingLegs()
            for proto in streams:
                proto.abort()
