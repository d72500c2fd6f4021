"""Stream migration (issue 55): a stream whose leg fails after its first byte goes on on
another engine, in the same client stream.

A streamed ``/v1/completions`` or ``/v1/chat/completions`` request with ``n=1`` (what
cannot be migrated: :func:`pdstack.proxy.migration_stream.cannot_migrate`) asks its engine
for the token ids of its output. When its leg fails mid-stream (reason ``cut``: the
connection closed; ``frozen``: no data, and its engine's ``/health`` unanswered within
``stall_probe_timeout_s``, :mod:`pdstack.proxy.migration_stall`; ``stall``: no data for
``stream_idle_timeout_s``; ``error_event``: the engine's 5xx error event, held back from
the client; ``ejected``: the proxy ejected the engine, which aborts its legs), the proxy
sends the prompt's token ids plus the output's so far to another usable engine of the same
role and generation (never another generation's: the rule of upgrades' pairings) as a
``/v1/completions`` stream with ``max_tokens`` reduced by as many, and relays it into the
same client stream
(:class:`pdstack.proxy.migration_stream.StreamTracker`: same ``id``, no token twice or
missing, ``usage`` of what the client received, ``finish_reason`` of the engine that
finished). In P/D the next decoder computes the prompt itself (no KV handoff). At most
``max_migrations`` continuations a request; after that, or with no engine left, the client
gets today's error event. Each migration is logged once and counted in
``migrations_total{reason, outcome}``; its gap (the failed engine's last data, so noticing
a frozen engine counts, -> the next engine's first event to the client) in
``migration_gap_seconds``. A non-streamed request has no partial
answer to keep: it is retried whole before its answer (:mod:`pdstack.proxy.legs`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from pdstack.proxy.admission import KvAdmission
from pdstack.proxy.backends import BackendRegistry, BackendState
from pdstack.proxy.breaker import Breaker
from pdstack.proxy.config import ProxyConfig
from pdstack.proxy.errors import describe_failure, engine_error_event, error_event
from pdstack.proxy.metrics import ProxyMetrics
from pdstack.proxy.migration_stall import FROZEN, StallWatch
from pdstack.proxy.migration_stream import DONE, SSE_END, StreamTracker, cannot_migrate
from pdstack.proxy.progress import ProgressWatch
from pdstack.proxy.relay import RelayError, RelayPool, RelayProtocol
from pdstack.proxy.routing import pick_p2c
from pdstack.proxy.sse import ErrorEvents, first_event, leading_error, relay_body, stream_rewriter
from pdstack.proxy.tenants import tenant_note

if TYPE_CHECKING:
    from pdstack.proxy.request_context import RequestContext

log = logging.getLogger("pdstack.proxy")


@dataclass
class ClientStream:
    """The client's side of a stream that reached it: where its events go, their rewrite
    (``tracker`` first when the stream may be migrated) and the engine's error events."""

    response: web.StreamResponse
    chunked: bool
    client: asyncio.BaseTransport | None
    rewrite: Callable[[bytes], bytes]
    errors: ErrorEvents
    tracker: StreamTracker | None


def failure_reason(backend: BackendState, failure: str, tracker: StreamTracker | None) -> str:
    """Why a leg's stream ended early ("" when it did not): ``frozen``, ``stall``,
    ``ejected``, ``cut``, ``error_event`` (:mod:`pdstack.proxy.migration`)."""
    if failure:
        if failure.startswith(FROZEN):
            return "frozen"
        if failure.startswith("no data for"):
            return "stall"
        return "ejected" if not backend.healthy and backend.ejections else "cut"
    return "error_event" if tracker is not None and tracker.error is not None else ""


def _noting_end(ctx: RequestContext, rewrite: Callable[[bytes], bytes]) -> Callable[[bytes], bytes]:
    """``rewrite``, noting in ``ctx.answered`` when what it gives the client ends the
    stream (``data: [DONE]``)."""

    def noted(data: bytes) -> bytes:
        out = rewrite(data)
        if DONE in out:
            ctx.answered = True
        return out

    return noted


def _silent_for(backend: BackendState) -> float:
    """Seconds since the engine's last sign of progress (a chunk of one of its streams)."""
    return max(0.0, time.monotonic() - backend.last_success) if backend.last_success else 0.0


class Migration:
    """Mixin of :class:`pdstack.proxy.legs.Legs`: the rest of a stream after its first byte,
    and its migration."""

    registry: BackendRegistry
    config: ProxyConfig
    metrics: ProxyMetrics
    relay: RelayPool
    breaker: Breaker
    progress: ProgressWatch
    admission: KvAdmission
    rng: random.Random
    session: aiohttp.ClientSession | None

    async def _open(self, backend: BackendState, path: str, payload: bytes,
                    headers: dict[str, str]) -> RelayProtocol:
        raise NotImplementedError  # pdstack.proxy.legs.Legs

    def _address(self, backend: BackendState) -> tuple[str, int, str]:
        raise NotImplementedError  # pdstack.proxy.legs.Legs

    @functools.cached_property
    def stall_watch(self) -> StallWatch:
        """Frozen engines' streams (:mod:`pdstack.proxy.migration_stall`)."""
        return StallWatch(lambda: self.session, self.config.stall_probe_after_s,
                          self.config.stall_probe_timeout_s)

    def _migratable(self, ctx: RequestContext, backend: BackendState | None = None) -> bool:
        """Whether the request's stream may be migrated (its legs then ask for token ids).
        On ``backend`` (its first streaming leg's engine), only when another engine of its
        role and generation is planned: with none (one engine per role) the stream has
        nowhere to go, and nothing is asked of the engine or done per event for it."""
        if ctx.migratable is None:
            ctx.migratable = (
                self.config.max_migrations > 0
                and cannot_migrate(ctx.path, ctx.body) is None
                and (backend is None or any(  # a standby too: it stands in for a failed one
                    b is not backend and b.generation == backend.generation
                    for b in self.registry.by_role(backend.role, standbys=True)))
            )
        return ctx.migratable

    def _client_stream(self, ctx: RequestContext, request: web.Request,
                       response: web.StreamResponse, chunked: bool) -> ClientStream:
        errors = ErrorEvents()
        rewrite = stream_rewriter(ctx.cached_tokens, errors)
        tracker = None
        if self._migratable(ctx):
            tracker = StreamTracker(ctx.path.endswith("/chat/completions"),
                                    ctx.body.get("return_token_ids") is True, rewrite)
            rewrite = tracker
        return ClientStream(response, chunked, request.transport, _noting_end(ctx, rewrite),
                            errors, tracker)

    async def _relay_leg(self, ctx: RequestContext, backend: BackendState,
                         proto: RelayProtocol, out: ClientStream, pending: bytes) -> str:
        """Relay a leg's stream to the client until it ends: "" or what failed."""
        client = out.client
        if client is None or client.is_closing():
            raise ConnectionResetError("client went away")
        backend.streaming.add(proto)

        def progress(chunk: bytes) -> None:
            backend.last_success = time.monotonic()
            # its KV grows by a token per event: the gate's output still to come shrinks
            self.admission.streamed(backend, ctx.request_id, chunk.count(b"data: {"))

        frozen = self._watch_frozen(backend, proto, out)
        try:
            failure = await relay_body(proto, client, out.chunked, pending,
                                       self.config.stream_idle_timeout_s, out.rewrite, progress)
        finally:
            backend.streaming.discard(proto)
            if frozen is not None:
                self.stall_watch.discard(backend, proto)
        return frozen[0] if frozen else failure

    def _watch_frozen(self, backend: BackendState, proto: RelayProtocol,
                      out: ClientStream) -> list[str] | None:
        """A stream that can migrate, watched for a frozen engine (its leg is aborted when
        it is, and the evidence put in the list returned: :mod:`.migration_stall`); None
        when it cannot migrate, or that is off."""
        tracker, config = out.tracker, self.config
        if tracker is None or config.stall_probe_after_s <= 0:
            return None
        evidence: list[str] = []

        def can_move() -> bool:
            return (tracker.migratable and tracker.migrations < config.max_migrations
                    and any(b.usable and b is not backend and b.generation == backend.generation
                            for b in self.registry.by_role(backend.role, out=(backend.name,))))

        def frozen(why: str) -> None:
            if not evidence:
                evidence.append(why)
                proto.abort()  # relay_body returns; the stream migrates (reason frozen)

        self.stall_watch.add(backend, proto, can_move, frozen)
        return evidence

    def _leg_failed(self, backend: BackendState, failure: str, message: str) -> None:
        """A leg failed mid-stream: counted against its engine, unless it was frozen (a
        stalled stream whose engine did not answer a short /health: only suspected, its
        /health then probed with the full budget, which ejects it if that fails too)."""
        if failure.startswith(FROZEN):
            self.breaker.suspect(backend)
        else:
            self.breaker.failure(backend, message)

    async def _relay_to_end(self, ctx: RequestContext, backend: BackendState,
                            proto: RelayProtocol, out: ClientStream, pending: bytes,
                            started: float) -> None:
        """The rest of a stream whose first event reached the client (``proto``: owned here,
        released or aborted), on other engines when its leg fails and it can migrate; then
        the end of the client's stream."""
        host, port, _ = self._address(backend)
        confirm: str | None = None  # a 5xx error event mid-stream, for /health to confirm
        held: RelayProtocol | None = proto
        try:
            failure = await self._relay_leg(ctx, backend, proto, out, pending)
            tracker = out.tracker
            reason = failure_reason(backend, failure, tracker)
            if reason and tracker is not None and tracker.finished:
                reason = ""  # the answer is whole: only its end was lost
                if not tracker.done:
                    ctx.answered = True
                    await out.response.write(DONE + SSE_END)
            if reason:
                if failure:
                    message = f"{backend.role} {backend.name} failed mid-stream: {failure}"
                    self._leg_failed(backend, failure, message)
                else:
                    assert tracker is not None and tracker.error is not None
                    message = (f"{backend.role} {backend.name} sent an error mid-stream "
                               f"({tracker.error[0]})")
                    confirm = message
                log.warning("%s (request %s%s)", message, ctx.request_id, tenant_note(ctx.ticket))
                proto.abort()  # the engine sees a disconnect and aborts the request
                held = None
                ending = self._error_ending(tracker, message)
                if tracker is not None and tracker.migratable:
                    ending = await self._migrate(ctx, backend, reason, message, out)
                if ending:
                    ctx.outcome = "stream_error"
                    await out.response.write(ending)
            elif out.errors.status is not None:
                # the engine's own error event after tokens (passed on, rewritten): a 4xx
                # is the request's fault; a 5xx counts once /health confirms it (below)
                status = out.errors.status
                message = (f"{backend.role} {backend.name} sent an error mid-stream "
                           f"({status}): {out.errors.text}")
                log.warning("%s (request %s%s)", message, ctx.request_id, tenant_note(ctx.ticket))
                ctx.outcome = "client_error" if status < 500 else "stream_error"
                confirm = message if status >= 500 else None
            else:
                self.breaker.success(backend)
                backend.last_success = time.monotonic()
                backend.served += 1
            if held is not None:
                self.relay.release(host, port, held)
                held = None
            self.metrics.leg_decode.observe(time.perf_counter() - started)
            with contextlib.suppress(ConnectionError):
                await out.response.write_eof()
        finally:
            if held is not None:
                held.abort()
            if confirm is not None:  # after the client's answer ended
                await self.breaker.confirm_5xx(backend, confirm)

    @staticmethod
    def _error_ending(tracker: StreamTracker | None, message: str) -> bytes:
        """The client's last events when its stream cannot go on: the engine's held-back
        error event in the proxy's vocabulary, else the proxy's own."""
        if tracker is not None and tracker.error is not None:
            status, payload = tracker.error
            return engine_error_event(status, payload) + SSE_END + b"data: [DONE]" + SSE_END
        return error_event(message)

    def _migration_target(self, ctx: RequestContext, failed: BackendState,
                          tried: set[str]) -> BackendState | None:
        """A usable engine of the failed one's role and generation, not tried yet (KV
        headroom first, then power of two choices)."""
        pool = [b for b in self.registry.by_role(failed.role, out=tried)
                if b.usable and b.generation == failed.generation and b.name not in tried]
        return pick_p2c(self.admission.prefer_open(pool, ctx.tokens, ctx.request_id), self.rng)

    async def _migrate(self, ctx: RequestContext, failed: BackendState, reason: str,
                       message: str, out: ClientStream) -> bytes:
        """Continue the client's stream on other engines, at most ``max_migrations`` tries;
        returns b"" once it ended well, else the client's last events (an error event)."""
        tracker = out.tracker
        assert tracker is not None
        # the gap counts from the failed engine's last data: noticing a frozen engine is
        # part of it (a cut connection is noticed at once)
        detected = time.perf_counter() - _silent_for(failed)
        tried = {failed.name}
        for _ in range(self.config.max_migrations):
            target = self._migration_target(ctx, failed, tried)
            plan = tracker.continuation(ctx.body) if tracker.migratable else None
            if target is None or plan is None:
                if target is None:
                    message += (f"; no other usable {failed.role} of generation "
                                f"{failed.generation!r} to continue on")
                break
            tried.add(target.name)
            next_reason, error, streamed = await self._continue_on(ctx, target, plan, out,
                                                                   detected, reason)
            if next_reason is None:
                return b""
            log.warning("migration of request %s to %s %s failed (%s): %s", ctx.request_id,
                        target.role, target.name, next_reason, error)
            message, reason = error, next_reason
            if streamed:  # the gap of the next one counts from this engine's last data
                detected = time.perf_counter() - _silent_for(target)
        self.metrics.migrations.labels(reason, "failed").inc()
        return self._error_ending(tracker, message)

    async def _continue_on(self, ctx: RequestContext, target: BackendState,
                           plan: tuple[str, bytes], out: ClientStream, detected: float,
                           reason: str) -> tuple[str | None, str, bool]:
        """One continuation on ``target``: (None, "", True) when the stream ended well
        there; else (why it failed, what failed, whether it had streamed to the client)."""
        tracker = out.tracker
        assert tracker is not None
        path, payload = plan
        headers = {**ctx.upstream_headers,
                   "X-Request-Id": f"{ctx.request_id}-m{tracker.migrations + 1}"}
        timeout = self.config.decode_first_byte_timeout_s or ctx.budget_s
        target.in_flight += 1
        self.admission.reserve(target, ctx.request_id, ctx.tokens + len(tracker.token_ids))
        proto: RelayProtocol | None = None
        try:
            try:
                async with self.progress.leg_deadline(target, timeout):
                    proto = await self._open(target, path, payload, headers)
                    if proto.status != 200:
                        await proto.done
                        text = proto.take_buffered()[:200].decode(errors="replace")
                        error = f"{target.role} {target.name} answered {proto.status}: {text}"
                        return "cut", error, False
                    first, pending = await first_event(proto, target)
            except (RelayError, OSError, TimeoutError) as exc:
                error = f"{target.role} {target.name}: {describe_failure(exc, timeout)}"
                self.breaker.failure(target, error, isinstance(exc, TimeoutError))
                return "cut", error, False
            finally:
                if proto is not None:
                    target.pending.discard(proto)
            if leading_error(first) is not None:
                return "error_event", f"{target.role} {target.name} streamed an error first", False
            tracker.resume()
            await out.response.write(out.rewrite(first))
            gap = time.perf_counter() - detected
            self.metrics.migration_gap.observe(gap)
            self.metrics.migrations.labels(reason, "continued").inc()
            log.warning("migrated request %s to %s %s after %d tokens (reason %s, gap %.3f s)",
                        ctx.request_id, target.role, target.name, tracker.carried, reason, gap)
            self.admission.landed(target, ctx.request_id)
            target.last_success = time.monotonic()
            failure = await self._relay_leg(ctx, target, proto, out, pending)
            next_reason = failure_reason(target, failure, tracker)
            if next_reason and tracker.finished:
                next_reason = ""
                if not tracker.done:
                    ctx.answered = True
                    await out.response.write(DONE + SSE_END)
            if not next_reason:
                self.breaker.success(target)
                target.served += 1
                host, port, _ = self._address(target)
                self.relay.release(host, port, proto)
                proto = None
                return None, "", True
            if failure:
                error = f"{target.role} {target.name} failed mid-stream: {failure}"
                self._leg_failed(target, failure, error)
            else:
                error = f"{target.role} {target.name} sent an error mid-stream"
            return next_reason, error, True
        finally:
            target.in_flight -= 1
            self.admission.release(target, ctx.request_id)
            if proto is not None:
                proto.abort()
