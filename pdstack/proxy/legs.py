"""The legs: the prefill leg, the final (client-facing) leg with its retry loop, the
upstream calls over the relay, and how an upstream answer is classified (retry here,
pass through to the client, or count against the backend: :mod:`pdstack.proxy.breaker`)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import aiohttp
from aiohttp import web

from pdstack.proxy import tracing
from pdstack.proxy.backends import BackendState
from pdstack.proxy.errors import (
    describe_failure,
    engine_error,
    error_event_status,
    error_response,
)
from pdstack.proxy.kv_events_route import KvRouting
from pdstack.proxy.migration import Migration
from pdstack.proxy.migration_stream import with_token_ids
from pdstack.proxy.relay import RelayError, RelayProtocol, build_request, split_url
from pdstack.proxy.request_context import RequestContext
from pdstack.proxy.sse import (
    cached_tokens,
    first_event,
    leading_error,
    start_stream,
    usage_rewriter,
)

log = logging.getLogger("pdstack.proxy")
R = TypeVar("R")


class Retryable(Exception):
    """A leg failed before any byte reached the client: another backend may try."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class Passthrough(Exception):
    """An upstream 4xx: the client's fault; answer it as is (no retry)."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.body = body
        self.content_type = content_type


class Legs(Migration):
    """Mixin of :class:`pdstack.proxy.app.Proxy`: the legs and upstream calls (the rest of
    a stream after its first byte, and its migration: :class:`Migration`)."""

    # and Migration's: registry, config, metrics, relay, breaker, admission, progress
    # (leg_deadline: a busy engine's legs are not cut while it progresses)
    session: aiohttp.ClientSession | None
    _addresses: dict[str, tuple[str, int, str]]
    kv_routing: KvRouting

    # ------------------------------------------------------------------ legs
    async def _prefill(
        self,
        backend: BackendState,
        ctx: RequestContext,
        nixl: bool,
        kv_request: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """Run the prefill leg; returns the response's kv_transfer_params.
        ``kv_request``: the leg's kv_transfer_params (lmcache-pd's disagg_spec)."""
        assert self.session is not None
        body = dict(ctx.body)
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body["stream"] = False
        body.pop("stream_options", None)
        body.pop("min_tokens", None)
        if nixl:
            body["kv_transfer_params"] = {"do_remote_decode": True}
        elif kv_request is not None:
            body["kv_transfer_params"] = kv_request
        else:
            body.pop("kv_transfer_params", None)
        started = time.perf_counter()
        timeout = self.config.prefill_timeout_s or ctx.budget_s
        data, status, headers = await self._whole_call(
            backend, ctx, json.dumps(body).encode(), timeout, "prefill"
        )
        self.metrics.leg_prefill.observe(time.perf_counter() - started)
        if status != 200:
            await self._upstream_status(backend, status, data, headers)
        self.breaker.success(backend)
        backend.last_success = time.monotonic()
        try:
            answer = json.loads(data)
            params = answer.get("kv_transfer_params")
            ctx.cached_tokens = cached_tokens(answer.get("usage"))
        except (json.JSONDecodeError, AttributeError):
            params = None
        if nixl and not params:
            log.warning(
                "prefiller %s returned no kv_transfer_params for %s", backend.name, ctx.request_id
            )
        return params

    async def _with_retries(
        self,
        ctx: RequestContext,
        leg: str,
        pick: Callable[[set[str]], BackendState | None],
        run: Callable[[BackendState, int], Awaitable[R]],
        on_retryable: Callable[[], None] | None = None,
        no_backend_hint: BackendState | None = None,
    ) -> tuple[BackendState, R] | web.Response:
        """The one retry loop: ``run(backend, attempt)`` on what ``pick(tried)`` gives,
        on another backend after a retryable failure (``on_retryable`` undoes the
        attempt's side state). Returns (the backend that answered, its result), or the
        client's reply: the engine's own (passed through), else 502/503/504."""
        tried: set[str] = set()
        last_error = ""
        timed_out = False
        for attempt in range(self.config.max_retries + 1):
            backend = pick(tried)
            if backend is None:
                break
            if attempt:
                self.metrics.retries.labels(leg).inc()
            tried.add(backend.name)
            try:
                return backend, await run(backend, attempt)
            except Retryable as exc:
                last_error = str(exc)
                timed_out = exc.timed_out
                log.info("%s leg of request %s failed (%s)", leg, ctx.request_id, last_error)
                if on_retryable is not None:
                    on_retryable()
            except Passthrough as exc:
                ctx.outcome = "client_error"
                return self._passthrough(exc, ctx)
        prefix = "prefill " if leg == "prefill" else ""
        return self._no_answer(ctx, last_error, timed_out, no_backend_hint, leg=prefix)

    async def _final_leg(
        self,
        request: web.Request,
        ctx: RequestContext,
        pick: Callable[[set[str]], BackendState | None],
        payload: Callable[[BackendState], bytes],
        no_backend_hint: BackendState | None = None,
    ) -> web.StreamResponse:
        """The leg whose bytes go to the client; retried until its first byte."""

        async def run(backend: BackendState, attempt: int) -> web.StreamResponse:
            self.admission.reserve(backend, ctx.request_id, ctx.tokens)
            try:
                with tracing.leg(ctx, backend):
                    if not ctx.stream:
                        return await self._unary_leg(ctx, backend, payload(backend))
                    return await self._stream_leg(request, ctx, backend, payload(backend))
            finally:
                self.admission.release(backend, ctx.request_id)

        result = await self._with_retries(ctx, "decode", pick, run, None, no_backend_hint)
        return result if isinstance(result, web.StreamResponse) else result[1]

    def _no_answer(
        self,
        ctx: RequestContext,
        last_error: str,
        timed_out: bool,
        no_backend_hint: BackendState | None = None,
        leg: str = "",
    ) -> web.Response:
        """502 (504 when the last try timed out) after failed tries, 503 with none."""
        headers = {"X-Request-Id": ctx.request_id}
        if last_error:
            ctx.outcome = "upstream_error"
            status = 504 if timed_out else 502
            message = f"{leg}failed on every try: {last_error}"
            return error_response(status, message, headers=headers)
        ctx.outcome = "no_backend"
        if no_backend_hint is not None:
            p = no_backend_hint
            message = f"no healthy decoder for prefiller {p.name} on node {p.node}"
        else:
            message = self.registry.describe_unroutable()
        return error_response(503, message, headers=headers)

    async def _stream_leg(
        self, request: web.Request, ctx: RequestContext, backend: BackendState, payload: bytes
    ) -> web.StreamResponse:
        """A streaming final leg: retryable until its first event reaches the client."""
        started = time.perf_counter()
        backend.in_flight += 1
        proto: RelayProtocol | None = None
        response: web.StreamResponse | None = None
        timeout = self.config.decode_first_byte_timeout_s or ctx.budget_s
        if self._migratable(ctx, backend):
            payload = with_token_ids(payload)
        try:
            # ---------- before the first byte: everything here may be retried elsewhere
            try:
                async with self.progress.leg_deadline(backend, timeout):
                    proto = await self._open(backend, ctx.path, payload, ctx.upstream_headers)
                    if proto.status == 200:
                        first, pending = await first_event(proto, backend)
                    else:
                        await proto.done
            except (RelayError, OSError, TimeoutError) as exc:
                error = f"{backend.role} {backend.name}: {describe_failure(exc, timeout)}"
                self.breaker.failure(backend, error, isinstance(exc, TimeoutError))
                raise Retryable(error, isinstance(exc, TimeoutError)) from exc
            finally:
                if proto is not None:
                    backend.pending.discard(proto)
            if proto.status != 200:
                await self._upstream_status(backend, proto.status, proto.take_buffered(),
                                            proto.headers)
            opened_with = leading_error(first)
            if opened_with is not None:
                await self._leading_error(backend, opened_with)

            # ---------- first byte: from here on, never retry (a stream that can migrate
            # goes on on another engine instead: pdstack.proxy.migration)
            ctx.release_kv_source()
            backend.last_success = time.monotonic()  # it answers: progress (not wedged)
            response, chunked = await start_stream(request, ctx.request_id, proto)
            out = self._client_stream(ctx, request, response, chunked)
            first = out.rewrite(first)
            if ctx.ticket is not None:  # the tenant's real usage (tpm settles with it)
                out.rewrite = ctx.ticket.meter.wrap(out.rewrite, first)
            await response.write(first)
            self.admission.landed(backend, ctx.request_id)
            self.admission.streamed(backend, ctx.request_id, first.count(b"data: {"))
            self.metrics.leg_decode_first.observe(self._first_byte(ctx) - started)
            taken, proto = proto, None  # _relay_to_end owns it
            await self._relay_to_end(ctx, backend, taken, out, pending, started)
            return response
        except ConnectionError:
            # the client went away while we wrote: abort upstream (finally) and stop
            if not ctx.answered:
                ctx.outcome = "client_disconnect"
            return response if response is not None else web.Response(status=499)
        finally:
            backend.in_flight -= 1
            if proto is not None:
                proto.abort()  # the engine sees a disconnect and aborts the request

    async def _open(
        self, backend: BackendState, path: str, payload: bytes, headers: dict[str, str]
    ) -> RelayProtocol:
        """Send one request on a kept-alive (or new) connection; returns it with the
        response head parsed. A reused connection that the engine had closed meanwhile
        is retried once on a fresh one. The caller owns (releases or aborts) it, and
        discards it from ``backend.pending`` (where it is until it sends to a client:
        ejecting the backend aborts it)."""
        host, port, prefix = self._address(backend)
        wire = build_request(host, port, prefix + path, payload, headers)
        for attempt in (0, 1):
            proto, reused = await self.relay.acquire(host, port, self.config.connect_timeout_s)
            if not backend.healthy and backend.ejections:
                proto.abort()  # ejected while we connected
                raise RelayError(f"{backend.name} was ejected")
            backend.pending.add(proto)
            try:
                proto.send(wire)
                await proto.head_done
                return proto
            except RelayError:
                proto.abort()
                backend.pending.discard(proto)
                if not (reused and attempt == 0) or not backend.healthy:
                    raise
            except BaseException:
                proto.abort()
                backend.pending.discard(proto)
                raise
        raise AssertionError("unreachable")

    async def _whole_call(
        self, backend: BackendState, ctx: RequestContext, payload: bytes, timeout: float,
        label: str,
    ) -> tuple[bytes, int, dict[str, str]]:
        """One non-streaming leg within ``timeout``, counted in ``backend.in_flight``; a
        transport error or timeout is recorded against the backend and raised Retryable."""
        backend.in_flight += 1
        try:
            async with self.progress.leg_deadline(backend, timeout):
                return await self._call(backend, ctx.path, payload, ctx.upstream_headers)
        except (RelayError, OSError, TimeoutError) as exc:
            error = f"{label} {backend.name}: {describe_failure(exc, timeout)}"
            self.breaker.failure(backend, error, isinstance(exc, TimeoutError))
            raise Retryable(error, isinstance(exc, TimeoutError)) from exc
        finally:
            backend.in_flight -= 1

    async def _call(
        self, backend: BackendState, path: str, payload: bytes, headers: dict[str, str]
    ) -> tuple[bytes, int, dict[str, str]]:
        """A whole request/response (non-streaming) over the relay."""
        proto = await self._open(backend, path, payload, headers)
        try:
            await proto.done
        except BaseException:
            proto.abort()
            raise
        finally:
            backend.pending.discard(proto)
        data = proto.take_buffered()
        host, port, _ = self._address(backend)
        self.relay.release(host, port, proto)
        return data, proto.status, proto.headers

    def _address(self, backend: BackendState) -> tuple[str, int, str]:
        cached = self._addresses.get(backend.url)
        if cached is None:
            cached = self._addresses[backend.url] = split_url(backend.url)
        return cached

    async def _upstream_status(
        self, backend: BackendState, status: int, data: bytes, headers: Any
    ) -> None:
        """Raise for a non-200 upstream answer. A 4xx, and a 5xx from an engine whose
        /health still passes, go back to the client as is (the request was the
        problem); a 5xx that /health confirms ejects the backend and retries."""
        content_type = headers.get("content-type") or headers.get("Content-Type")
        passthrough = Passthrough(status, data, content_type or "application/json")
        if status < 500:
            raise passthrough
        error = f"{backend.role} {backend.name} answered {status}: " + data[:200].decode(
            errors="replace"
        )
        if await self.breaker.confirm_5xx(backend, error):
            raise Retryable(error)
        log.info("%s; its /health passes: answering the client as is", error)
        raise passthrough

    async def _leading_error(self, backend: BackendState, payload: bytes) -> NoReturn:
        """Raise for an error event that a stream opened with (``payload``: its JSON; no
        token reached the client): a 4xx passed through, a 5xx retried elsewhere and
        confirmed by /health (what counts: :mod:`pdstack.proxy.breaker`)."""
        status = error_event_status(payload)
        assert status is not None
        if status < 500:
            raise Passthrough(status, payload, "application/json")
        error = (f"{backend.role} {backend.name} streamed an error ({status}) before its "
                 "first token: " + payload[:200].decode(errors="replace"))
        await self.breaker.confirm_5xx(backend, error)
        raise Retryable(error)

    async def _unary_leg(
        self, ctx: RequestContext, backend: BackendState, payload: bytes
    ) -> web.StreamResponse:
        """A non-streaming final leg: all or nothing, so always retryable."""
        started = time.perf_counter()
        config = self.config
        timeout = config.request_timeout_s
        max_tokens = ctx.body.get("max_tokens") or ctx.body.get("max_completion_tokens")
        if isinstance(max_tokens, int):
            first = config.decode_first_byte_timeout_s or ctx.budget_s
            timeout = min(timeout, first + config.unary_per_token_s * max_tokens)
        data, status, headers = await self._whole_call(
            backend, ctx, payload, timeout, backend.role
        )
        if status != 200:
            await self._upstream_status(backend, status, data, headers)
        self.breaker.success(backend)
        backend.last_success = time.monotonic()
        backend.served += 1
        self.metrics.leg_decode.observe(self._first_byte(ctx) - started)
        rewrite = usage_rewriter(ctx.cached_tokens)
        if rewrite is not None:
            data = rewrite(data)
        if ctx.ticket is not None:
            ctx.ticket.meter.feed(data)
        return web.Response(
            body=data,
            status=200,
            headers={
                "Content-Type": headers.get("content-type", "application/json"),
                "X-Request-Id": ctx.request_id,
            },
        )

    def _first_byte(self, ctx: RequestContext) -> float:
        """The client gets its first byte now: traced and timed (TTFT by route), its prompt no
        longer queued on its engine (the KV-event router's load); now."""
        tracing.first_byte(ctx)
        self.kv_routing.prefilled(ctx.request_id)
        now = time.perf_counter()
        self.metrics.ttft_route[ctx.route].observe(now - ctx.started)
        return now

    def _passthrough(self, exc: Passthrough, ctx: RequestContext) -> web.Response:
        """The engine's error, in the proxy's error vocabulary (errors.engine_error)."""
        return web.Response(
            body=engine_error(exc.status, exc.body),
            status=exc.status,
            headers={"Content-Type": "application/json", "X-Request-Id": ctx.request_id},
        )

