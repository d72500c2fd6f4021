"""The proxy's aiohttp application: OpenAI front door, P/D two-leg flow, admin API.

Request flow (``/v1/completions``, ``/v1/chat/completions``):
1. API key (if configured), admission (over ``max_concurrency`` -> 429 + Retry-After).
2. ``colocated``: one leg to an engine chosen by prefix affinity (bounded load).
3. Skip-prefill (shared-l1 modes, threshold > 0): when the prefix index says the
   uncached part of the prompt is below the threshold on some node, one leg straight to
   a decoder on that node (p2c), which reads the prefix from the node's LMCache store.
4. Otherwise two legs: prefill (prefix affinity, bounded load) with ``max_tokens=1``,
   ``stream=false``, no ``stream_options`` / ``min_tokens``, and in NIXL pairings
   ``kv_transfer_params={"do_remote_decode": true}``; then the original request to a
   decoder paired with that prefiller (same generation; shared-l1 = same node; p2c),
   carrying the prefill's ``kv_transfer_params`` in NIXL pairings. One ``X-Request-Id``
   on both legs and on the response.
5. ``lmcache-pd`` (LMCache's legacy push, see :mod:`pdstack.proxy.lmcache_pd`): the
   decoder is chosen first (paired, usable, p2c); the prefill leg carries
   ``kv_transfer_params={"disagg_spec": {"req_id", "receiver_host",
   "receiver_init_port": [..], "receiver_alloc_port": [..]}}`` naming it (``req_id`` =
   the X-Request-Id, suffixed on a retry or clash); the proxy waits (at most
   ``lmcache_pd_notify_timeout_s``) for the prefiller's ZMQ ``ProxyNotif(req_id)`` on
   its PULL socket, then sends the original request to that decoder. No notification
   in time: logged + counted, the decode leg goes anyway (the decoder recomputes).
Retries: a failed prefill leg, or a decode leg that has not produced its first byte,
is retried on another backend; never after bytes reached the client (then the stream
ends with an OpenAI error event and ``data: [DONE]``). Client disconnect cancels the
handler, which closes the upstream connection(s), so the engines abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from pdstack.proxy import affinity, tracing
from pdstack.proxy.admission import AdmissionRejected, KvAdmission, prompt_tokens
from pdstack.proxy.backends import BackendRegistry, BackendState
from pdstack.proxy.config import ProxyConfig
from pdstack.proxy.lmcache_pd import NotifyListener, disagg_spec
from pdstack.proxy.metrics import ProxyMetrics
from pdstack.proxy.relay import RelayError, RelayPool, RelayProtocol, build_request, split_url
from pdstack.proxy.routing import (
    HashRing,
    PrefixIndex,
    pick_bounded_load,
    pick_p2c,
    prompt_text,
    stable_hash,
)

log = logging.getLogger("pdstack.proxy")

PROXY_KEY: web.AppKey[Proxy] = web.AppKey("pdstack_proxy", object)  # type: ignore[arg-type]
SSE_END = b"\n\n"
_HIGH_WATER = 1 << 20  # client write buffer above which the engine is not read
_LOW_WATER = 1 << 18


def error_body(message: str, err_type: str, code: int | str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": None, "code": code}}


def error_response(
    status: int, message: str, err_type: str = "server_error", headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(error_body(message, err_type, status), status=status, headers=headers)


def error_event(message: str, code: int = 502) -> bytes:
    payload = json.dumps(error_body(message, "server_error", code))
    return b"data: " + payload.encode() + b"\n\ndata: [DONE]\n\n"


class _Retryable(Exception):
    """A leg failed before any byte reached the client: another backend may try."""


class _Passthrough(Exception):
    """An upstream 4xx: the client's fault; answer it as is (no retry)."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"upstream answered {status}")
        self.status = status
        self.body = body
        self.content_type = content_type


@dataclass
class RequestContext:
    request_id: str
    path: str
    body: dict[str, Any]
    raw: bytes
    stream: bool
    started: float
    route: str = "pd"
    text: str | None = None
    outcome: str = "ok"
    session: str | None = None  # session affinity key (X-Session-ID header or `user`)
    tokens: int = 0  # prompt tokens (exact for token-id prompts, else estimated)
    upstream_headers: dict[str, str] = field(default_factory=dict)
    trace: Any = None  # tracing.RequestTrace while traced


class _IdleWatchdog:
    """Closes an upstream response that stays silent for ``idle_s`` (no per-chunk timers:
    the hot path only stores a timestamp)."""

    def __init__(self, close: Callable[[], None], idle_s: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.close = close
        self.idle_s = idle_s
        self.last = self.loop.time()
        self.fired = False
        self._handle = self.loop.call_at(self.last + idle_s, self._check)

    def _check(self) -> None:
        now = self.loop.time()
        if now - self.last >= self.idle_s:
            self.fired = True
            self.close()
        else:
            self._handle = self.loop.call_at(self.last + self.idle_s, self._check)

    def cancel(self) -> None:
        self._handle.cancel()


class Proxy:
    """One proxy instance: backends, routers, metrics, the aiohttp app."""

    def __init__(
        self,
        registry: BackendRegistry,
        config: ProxyConfig | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.registry = registry
        self.config = config or ProxyConfig()
        self.rng = rng or random.Random()
        self.in_flight = 0
        self.metrics = ProxyMetrics(lambda: self.registry, lambda: self.in_flight)
        registry.on_eject = self._on_eject
        self.index = PrefixIndex(self.config.index_block_chars, self.config.index_capacity)
        self.session: aiohttp.ClientSession | None = None
        self.relay = RelayPool()
        self._addresses: dict[str, tuple[str, int, str]] = {}
        self._rings: dict[str, tuple[int, HashRing]] = {}  # role -> (registry version, ring)
        self.admission = KvAdmission(
            self.config.admission, lambda: self.registry.backends.values(), self._auth_headers
        )
        if self.config.admission.enabled:
            self.metrics.watch_admission(self.admission)
        self._health_task: asyncio.Task[None] | None = None
        self._probing: set[str] = set()
        threshold = self.config.skip_prefill_threshold_tokens
        if threshold is None:
            threshold = registry.skip_prefill_threshold_tokens
        self.skip_threshold_tokens = threshold
        self.notifier: NotifyListener | None = None
        self.app = self._make_app()

    # ------------------------------------------------------------------ app wiring
    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app[PROXY_KEY] = self
        app.router.add_post("/v1/completions", self.handle_generate)
        app.router.add_post("/v1/chat/completions", self.handle_generate)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/admin/backends", self.admin_list)
        app.router.add_post("/admin/backends", self.admin_upsert)
        app.router.add_post("/admin/backends/{name:.+}/drain", self.admin_drain)
        app.router.add_post("/admin/backends/{name:.+}/undrain", self.admin_undrain)
        app.router.add_delete("/admin/backends/{name:.+}", self.admin_remove)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(
            limit=0, limit_per_host=0, keepalive_timeout=30, enable_cleanup_closed=False
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        if self.registry.mode.lmcache_push:
            await self._start_notifier()
        await self.probe_all()
        self._health_task = asyncio.create_task(self._health_loop())
        await self.admission.start(self.session)

    async def _start_notifier(self) -> None:
        table = self.registry.lmcache_pd_notify or {}
        port = self.config.lmcache_pd_notify_port
        if port is None:
            port = table.get("port")
        if port is None:
            log.error(
                "lmcache-pd: no notify port (backend table lmcache_pd_notify or "
                "--lmcache-pd-notify-port): decode legs will not wait for the KV push"
            )
            return
        host = self.config.lmcache_pd_notify_host or table.get("host") or self.config.host
        counter = self.metrics.lmcache_pd_notify
        notifier = NotifyListener(
            host, int(port), on_unmatched=lambda outcome: counter.labels(outcome).inc()
        )
        await notifier.start()
        self.notifier = notifier

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.admission.stop()
        if self.notifier is not None:
            await self.notifier.close()
            self.notifier = None
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.session is not None:
            await self.session.close()
        self.relay.close()

    def runner(self) -> web.AppRunner:
        # handler_cancellation: a client disconnect cancels the handler -> upstream abort
        return web.AppRunner(self.app, handler_cancellation=True, access_log=None)

    # ------------------------------------------------------------------ health
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.probe_all()
            except Exception:  # never let the loop die
                log.exception("health round failed")

    async def probe_all(self) -> None:
        backends = [b for b in self.registry.backends.values() if b.name not in self._probing]
        await asyncio.gather(*(self.probe(b) for b in backends))

    async def probe(self, backend: BackendState) -> None:
        assert self.session is not None
        self._probing.add(backend.name)
        ok, error = False, ""
        started = time.monotonic()
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
            async with self.session.get(f"{backend.url}/health", timeout=timeout) as resp:
                await resp.read()
                ok = resp.status == 200
                error = "" if ok else f"/health answered {resp.status}"
        except TimeoutError:
            error = "/health timed out"
            if backend.last_success >= started:
                # it answered real requests meanwhile: a slow probe (busy event loop or
                # busy engine) is no evidence of death
                return
        except aiohttp.ClientError as exc:
            error = f"/health failed: {exc.__class__.__name__} {exc}".strip()
        finally:
            self._probing.discard(backend.name)
        self.registry.record_probe(backend, ok, error, self.config)

    def _on_eject(self, backend: BackendState) -> None:
        self.metrics.ejections.labels(backend.name).inc()

    def _record_failure(self, backend: BackendState, error: str) -> None:
        self.registry.record_failure(backend, error, self.config.eject_after)

    # ------------------------------------------------------------------ auth helpers
    def _client_authorized(self, request: web.Request) -> bool:
        keys = self.config.api_keys
        if not keys:
            return True
        auth = request.headers.get("Authorization", "")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        return any(hmac.compare_digest(token, k) for k in keys)

    def _admin_error(self, request: web.Request) -> web.Response | None:
        token = self.config.admin_token
        if not token:
            return error_response(
                403, "admin API disabled: set PDSTACK_ADMIN_TOKEN", "permission_error"
            )
        auth = request.headers.get("Authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        given = given or request.headers.get("X-Admin-Token", "")
        if not hmac.compare_digest(given, token):
            return error_response(401, "admin token missing or wrong", "authentication_error")
        return None

    # ------------------------------------------------------------------ simple endpoints
    async def handle_health(self, request: web.Request) -> web.Response:
        routable = self._routable()
        body = {
            "status": "ok" if routable else "unavailable",
            "kv_mode": self.registry.kv_mode,
            "backends": {b.name: b.state for b in self.registry.backends.values()},
        }
        if not routable:
            body["reason"] = self.registry.describe_unroutable()
        return web.json_response(body, status=200 if routable else 503)

    def _routable(self) -> bool:
        if not self.registry.mode.disaggregated:
            return any(b.usable for b in self.registry.by_role("colocated"))
        return any(
            p.usable and self.registry.decoders_for(p) for p in self.registry.by_role("prefill")
        )

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def handle_models(self, request: web.Request) -> web.StreamResponse:
        if not self._client_authorized(request):
            return error_response(401, "invalid or missing API key", "authentication_error")
        assert self.session is not None
        role = "decode" if self.registry.mode.disaggregated else "colocated"
        for backend in self.registry.by_role(role):
            if not backend.usable:
                continue
            try:
                timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s + 3)
                async with self.session.get(
                    f"{backend.url}/v1/models", timeout=timeout, headers=self._auth_headers()
                ) as resp:
                    if resp.status == 200:
                        return web.Response(body=await resp.read(), content_type="application/json")
            except (aiohttp.ClientError, TimeoutError):
                continue
        name = self.registry.served_model_name
        if not name:
            return error_response(503, self.registry.describe_unroutable())
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": name, "object": "model", "created": 0, "owned_by": "pdstack"}],
            }
        )

    def _auth_headers(self) -> dict[str, str]:
        key = self.config.engine_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    # ------------------------------------------------------------------ admin API
    async def admin_list(self, request: web.Request) -> web.Response:
        if (err := self._admin_error(request)) is not None:
            return err
        data = self.registry.to_json()
        data["in_flight"] = self.in_flight
        data["skip_prefill_threshold_tokens"] = self.skip_threshold_tokens
        return web.json_response(data)

    def _named(self, request: web.Request) -> BackendState | web.Response:
        name = request.match_info["name"]
        backend = self.registry.backends.get(name)
        if backend is None:
            return error_response(404, f"no backend named {name!r}", "not_found_error")
        return backend

    async def admin_drain(self, request: web.Request) -> web.Response:
        return await self._set_drained(request, True)

    async def admin_undrain(self, request: web.Request) -> web.Response:
        return await self._set_drained(request, False)

    async def _set_drained(self, request: web.Request, drained: bool) -> web.Response:
        if (err := self._admin_error(request)) is not None:
            return err
        backend = self._named(request)
        if isinstance(backend, web.Response):
            return backend
        backend.drained = drained
        log.warning("%s backend %s", "drained" if drained else "undrained", backend.name)
        return web.json_response(backend.to_json())

    async def admin_upsert(self, request: web.Request) -> web.Response:
        if (err := self._admin_error(request)) is not None:
            return err
        try:
            spec = await request.json()
            if not isinstance(spec, dict):
                raise ValueError("body must be a JSON object")
            for key in ("name", "role", "url"):
                if not spec.get(key):
                    raise ValueError(f"missing field {key!r}")
            old = self.registry.backends.get(str(spec["name"]))
            backend = self.registry.upsert(spec)
        except (ValueError, KeyError, json.JSONDecodeError) as exc:
            return error_response(400, f"bad backend: {exc}", "invalid_request_error")
        await self.probe(backend)  # answer with its first health state
        log.warning("%s backend %s (%s)", "replaced" if old else "added", backend.name, backend.url)
        return web.json_response(backend.to_json(), status=200 if old else 201)

    async def admin_remove(self, request: web.Request) -> web.Response:
        if (err := self._admin_error(request)) is not None:
            return err
        backend = self._named(request)
        if isinstance(backend, web.Response):
            return backend
        self.registry.remove(backend.name)
        return web.json_response(backend.to_json())

    # ------------------------------------------------------------------ generation
    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        metrics = self.metrics
        if not self._client_authorized(request):
            metrics.outcome["unauthorized"].inc()
            return error_response(401, "invalid or missing API key", "authentication_error")
        if self.in_flight >= self.config.max_concurrency:
            metrics.outcome["rejected"].inc()
            return error_response(
                429,
                f"proxy at its concurrency limit ({self.config.max_concurrency}); retry later",
                "rate_limit_error",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )
        self.in_flight += 1
        ctx: RequestContext | None = None
        try:
            raw = await request.read()
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                metrics.outcome["bad_request"].inc()
                return error_response(
                    400, f"body is not valid JSON: {exc}", "invalid_request_error"
                )
            if not isinstance(body, dict):
                metrics.outcome["bad_request"].inc()
                return error_response(400, "body must be a JSON object", "invalid_request_error")
            if "kv_transfer_params" in body:
                # only the proxy decides where KV comes from: never a client
                del body["kv_transfer_params"]
                raw = json.dumps(body).encode()
            request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
            ctx = RequestContext(
                request_id=request_id,
                path=request.path,
                body=body,
                raw=raw,
                stream=bool(body.get("stream")),
                started=time.perf_counter(),
                session=affinity.session_key(request.headers, body),
            )
            ctx.upstream_headers = {
                "Content-Type": "application/json",
                "X-Request-Id": request_id,
                **self._auth_headers(),
            }
            with tracing.request(ctx, request.headers):
                response = await self._serve(request, ctx)
            metrics.outcome[ctx.outcome].inc()
            return response
        except asyncio.CancelledError:
            metrics.outcome["client_disconnect"].inc()
            raise
        finally:
            self.in_flight -= 1
            if ctx is not None:
                self.admission.forget(ctx.request_id)  # a hold its final leg never took

    async def _serve(self, request: web.Request, ctx: RequestContext) -> web.StreamResponse:
        registry = self.registry
        ctx.tokens = prompt_tokens(ctx.body, len(self._key_text_full(ctx)),
                                   self.config.chars_per_token)
        if not registry.mode.disaggregated:
            ctx.route = "colocated"
            key_hash = self._affinity_hash(ctx)
            rejected = await self._admit(ctx, lambda: registry.by_role("colocated"))
            if rejected is not None:
                return rejected
            return await self._final_leg(
                request,
                ctx,
                lambda tried: self._pick_affinity("colocated", key_hash, tried, ctx.tokens),
                lambda backend: ctx.raw,
            )

        if registry.mode.lmcache_push:
            return await self._serve_lmcache_pd(request, ctx)

        if self.skip_threshold_tokens > 0 and registry.mode.skip_prefill:
            skipped = await self._try_skip_prefill(request, ctx)
            if skipped is not None:
                return skipped

        # ---- admission: the decoders' KV, before any prefill work is spent
        rejected = await self._admit(ctx, lambda: registry.by_role("decode"))
        if rejected is not None:
            return rejected

        # ---- leg 1: prefill
        kv_params: dict[str, Any] | None = None
        kv_path = ""

        async def prefill_leg(prefill: BackendState, attempt: int) -> None:
            nonlocal kv_params, kv_path
            decoders = self._paired_decoders(prefill)
            kv_path = decoders[0][1] if decoders else "nixl"
            kv_params = await self._prefill(prefill, ctx, nixl=kv_path == "nixl")

        answered = await self._run_prefill_leg(ctx, prefill_leg)
        if not isinstance(answered, BackendState):
            return answered
        prefill = answered
        if self.skip_threshold_tokens > 0 and registry.mode.skip_prefill:
            self.index.insert((prefill.node, prefill.generation), self._hashes(ctx))

        # ---- leg 2: decode
        chosen_prefill = prefill
        decode_raw: dict[str, bytes] = {}

        def decode_payload(backend: BackendState) -> bytes:
            path = registry.pairings.get(chosen_prefill.name, {}).get(backend.name, "")
            if path == "nixl" and kv_params is not None:
                if "nixl" not in decode_raw:
                    decode_raw["nixl"] = json.dumps(
                        {**ctx.body, "kv_transfer_params": kv_params}
                    ).encode()
                return decode_raw["nixl"]
            return ctx.raw

        def pick_decoder(tried_decoders: set[str]) -> BackendState | None:
            pairs = [
                (d, p)
                for d, p in self._paired_decoders(chosen_prefill)
                if d.name not in tried_decoders
            ]
            if not pairs:
                return None
            same_path = [d for d, p in pairs if p == kv_path] or [d for d, _ in pairs]
            chosen = self._pick_decoder(ctx, same_path)
            if chosen is not None:
                self.metrics.pair(chosen_prefill, chosen).inc()
            return chosen

        return await self._final_leg(
            request, ctx, pick_decoder, decode_payload, no_backend_hint=chosen_prefill
        )

    async def _serve_lmcache_pd(
        self, request: web.Request, ctx: RequestContext
    ) -> web.StreamResponse:
        """Decoder first, prefill with its disagg_spec, wait for ProxyNotif, decode there."""
        notifier = self.notifier
        decoder: BackendState | None = None
        waiter: asyncio.Future[None] | None = None
        req_id = ""

        async def prefill_leg(prefill: BackendState, attempt: int) -> None:
            nonlocal decoder, waiter, req_id
            paired = [d for d, _ in self._paired_decoders(prefill)]
            if decoder is None or decoder not in paired:
                decoder = pick_p2c(paired, self.rng)  # kept across prefill retries
            kv_request: dict[str, Any] | None = None
            if decoder is not None and decoder.lmcache_pd is not None:
                base = ctx.request_id if attempt == 0 else f"{ctx.request_id}-r{attempt}"
                if notifier is not None:
                    req_id = notifier.unique_id(base)
                    waiter = notifier.expect(req_id)
                else:
                    req_id = base
                kv_request = disagg_spec(req_id, decoder.lmcache_pd)
            await self._prefill(prefill, ctx, nixl=False, kv_request=kv_request)

        def forget_waiter() -> None:
            nonlocal waiter
            if notifier is not None and waiter is not None:
                notifier.forget(req_id)
                waiter = None

        try:
            answered = await self._run_prefill_leg(ctx, prefill_leg, forget_waiter)
            if not isinstance(answered, BackendState):
                return answered
            prefill = answered

            # ---- the KV push: wait (bounded) for the prefiller's ProxyNotif
            if decoder is not None and decoder.lmcache_pd is None:
                self.metrics.lmcache_pd_notify.labels("no_receiver").inc()
            elif waiter is not None:
                with tracing.kv_wait(ctx):
                    await self._await_notify(waiter, req_id, prefill, decoder)
        finally:
            if notifier is not None and waiter is not None and not waiter.done():
                notifier.forget(req_id)

        # ---- leg 2: decode, on the decoder the KV went to (a retry elsewhere recomputes)
        chosen_prefill = prefill
        first_choice = decoder

        def pick_decoder(tried_decoders: set[str]) -> BackendState | None:
            nonlocal first_choice
            chosen = None
            if (
                first_choice is not None
                and first_choice.usable
                and first_choice.name not in tried_decoders
            ):
                chosen = first_choice
            else:
                others = [
                    d
                    for d, _ in self._paired_decoders(chosen_prefill)
                    if d.name not in tried_decoders
                ]
                chosen = pick_p2c(others, self.rng)
            first_choice = None
            if chosen is not None:
                self.metrics.pair(chosen_prefill, chosen).inc()
            return chosen

        return await self._final_leg(
            request, ctx, pick_decoder, lambda backend: ctx.raw, no_backend_hint=chosen_prefill
        )

    async def _run_prefill_leg(
        self,
        ctx: RequestContext,
        leg: Callable[[BackendState, int], Awaitable[None]],
        on_retryable: Callable[[], None] | None = None,
    ) -> BackendState | web.StreamResponse:
        """Pick a prefiller by prefix affinity and run ``leg(prefiller, attempt)`` on it,
        on another one after a retryable failure (``on_retryable`` undoes the attempt's
        side state). Returns the prefiller that answered, or the client's error response."""
        key_hash = self._affinity_hash(ctx)
        tried: set[str] = set()
        last_error = ""
        for attempt in range(self.config.max_retries + 1):
            prefill = self._pick_affinity("prefill", key_hash, tried)
            if prefill is None:
                break
            if attempt:
                self.metrics.retries.labels("prefill").inc()
            tried.add(prefill.name)
            try:
                with tracing.leg(ctx, prefill):
                    await leg(prefill, attempt)
                return prefill
            except _Retryable as exc:
                last_error = str(exc)
                if on_retryable is not None:
                    on_retryable()
            except _Passthrough as exc:
                ctx.outcome = "client_error"
                return self._passthrough(exc, ctx)
        headers = {"X-Request-Id": ctx.request_id}
        if last_error:
            ctx.outcome = "upstream_error"
            return error_response(
                502, f"prefill failed on every try: {last_error}", headers=headers
            )
        ctx.outcome = "no_backend"
        return error_response(503, self.registry.describe_unroutable(), headers=headers)

    async def _await_notify(
        self,
        waiter: asyncio.Future[None],
        req_id: str,
        prefill: BackendState,
        decoder: BackendState | None,
    ) -> None:
        started = time.perf_counter()
        timeout = self.config.lmcache_pd_notify_timeout_s
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(waiter)
        except TimeoutError:
            self.metrics.lmcache_pd_notify.labels("timeout").inc()
            log.warning(
                "lmcache-pd: no ProxyNotif for %s from %s within %gs; decoding on %s anyway "
                "(it recomputes the prompt)",
                req_id,
                prefill.name,
                timeout,
                decoder.name if decoder is not None else "?",
            )
        else:
            self.metrics.lmcache_pd_notify.labels("received").inc()
        finally:
            self.metrics.lmcache_pd_notify_wait.observe(time.perf_counter() - started)

    def _key_text(self, ctx: RequestContext) -> str:
        return self._key_text_full(ctx)[: self.config.prefix_chars]

    def _key_text_full(self, ctx: RequestContext) -> str:
        if ctx.text is None:
            ctx.text = prompt_text(ctx.body)
        return ctx.text

    def _affinity_hash(self, ctx: RequestContext) -> int:
        """Session affinity when the request names its session, else prefix affinity."""
        if ctx.session is not None:
            return stable_hash(f"session:{ctx.session}")
        return stable_hash(self._key_text(ctx))

    async def _admit(
        self, ctx: RequestContext, candidates: Callable[[], list[BackendState]]
    ) -> web.Response | None:
        """KV-aware admission (a no-op unless enabled): wait until some candidate has KV
        headroom; None = go on, else the client's 503."""
        usable = lambda: [b for b in candidates() if b.usable]  # noqa: E731
        try:
            await self.admission.wait_open(usable, ctx.tokens)
        except AdmissionRejected as exc:
            ctx.outcome = "rejected"
            self.metrics.admission_rejected.labels(exc.reason).inc()
            return error_response(
                503,
                str(exc),
                "server_error",
                headers={
                    "Retry-After": str(self.config.retry_after_s),
                    "X-Request-Id": ctx.request_id,
                },
            )
        # hold the tokens now (P/D: the decoder is picked after the prefill leg)
        self.admission.hold(usable(), ctx.request_id, ctx.tokens)
        return None

    def _pick_decoder(
        self, ctx: RequestContext, decoders: list[BackendState]
    ) -> BackendState | None:
        """A decoder among ``decoders``: those with KV headroom first; by session affinity
        (bounded load) when the request names a session, else power of two choices."""
        open_ones = self.admission.open_among(decoders, ctx.tokens) or decoders
        if ctx.session is not None:
            ring = self._ring_for("decode")
            chosen = pick_bounded_load(
                ring, self._affinity_hash(ctx), {d.name: d for d in open_ones},
                self.config.load_factor,
            )
            if chosen is not None:
                return chosen
        return pick_p2c(open_ones, self.rng)

    def _ring_for(self, role: str) -> HashRing:
        version, ring = self._rings.get(role, (-1, HashRing(())))
        if version != self.registry.version:
            ring = HashRing(b.name for b in self.registry.backends.values() if b.role == role)
            self._rings[role] = (self.registry.version, ring)
        return ring

    def _hashes(self, ctx: RequestContext) -> list[int]:
        if ctx.text is None:
            ctx.text = prompt_text(ctx.body)
        return self.index.block_hashes(ctx.text)

    def _paired_decoders(self, prefill: BackendState) -> list[tuple[BackendState, str]]:
        """Usable paired decoders, preferring shared-l1 (same-node) pairings first."""
        pairs = self.registry.decoders_for(prefill)
        pairs.sort(key=lambda pair: pair[1] != "shared-l1")
        return pairs

    def _pick_affinity(
        self, role: str, key_hash: int, tried: set[str], tokens: int | None = None
    ) -> BackendState | None:
        """Bounded-load consistent hashing over usable ``role`` backends; with ``tokens``
        (gated roles) the ones with KV headroom for it come first."""
        registry = self.registry
        ring = self._ring_for(role)
        if role == "prefill":
            candidates = {
                b.name: b
                for b in registry.by_role("prefill")
                if b.usable and b.name not in tried and registry.decoders_for(b)
            }
        else:
            candidates = {
                b.name: b for b in registry.by_role(role) if b.usable and b.name not in tried
            }
        if tokens is not None:
            open_names = {b.name for b in self.admission.open_among(candidates.values(), tokens)}
            if open_names:
                candidates = {n: b for n, b in candidates.items() if n in open_names}
        return pick_bounded_load(ring, key_hash, candidates, self.config.load_factor)

    async def _try_skip_prefill(
        self, request: web.Request, ctx: RequestContext
    ) -> web.StreamResponse | None:
        hashes = self._hashes(ctx)
        assert ctx.text is not None
        decoders = [d for d in self.registry.by_role("decode") if d.usable]
        stores = {(d.node, d.generation) for d in decoders}
        store, cached = self.index.best_store(stores, hashes)
        self.metrics.index_lookup(cached > 0)
        if store is None:
            return None
        uncached_tokens = (len(ctx.text) - cached) / self.config.chars_per_token
        if uncached_tokens >= self.skip_threshold_tokens:
            return None
        local = [d for d in decoders if (d.node, d.generation) == store]
        if not local:
            return None
        ctx.route = "skip_prefill"
        self.metrics.skip_prefill.inc()

        def pick(tried: set[str]) -> BackendState | None:
            return pick_p2c([d for d in local if d.name not in tried and d.usable], self.rng)

        return await self._final_leg(request, ctx, pick, lambda backend: ctx.raw)

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
        backend.in_flight += 1
        try:
            async with asyncio.timeout(self.config.prefill_timeout_s):
                data, status, headers = await self._call(
                    backend, ctx.path, json.dumps(body).encode(), ctx.upstream_headers
                )
        except (RelayError, OSError, TimeoutError) as exc:
            error = f"prefill {backend.name}: {_describe(exc)}"
            self._record_failure(backend, error)
            raise _Retryable(error) from exc
        finally:
            backend.in_flight -= 1
        self.metrics.leg_prefill.observe(time.perf_counter() - started)
        if status != 200:
            self._upstream_status(backend, status, data, headers)
        _mark_success(backend)
        try:
            params = json.loads(data).get("kv_transfer_params")
        except (json.JSONDecodeError, AttributeError):
            params = None
        if nixl and not params:
            log.warning(
                "prefiller %s returned no kv_transfer_params for %s", backend.name, ctx.request_id
            )
        return params

    async def _final_leg(
        self,
        request: web.Request,
        ctx: RequestContext,
        pick: Callable[[set[str]], BackendState | None],
        payload: Callable[[BackendState], bytes],
        no_backend_hint: BackendState | None = None,
    ) -> web.StreamResponse:
        """The leg whose bytes go to the client; retried until its first byte."""
        tried: set[str] = set()
        last_error = ""
        for attempt in range(self.config.max_retries + 1):
            backend = pick(tried)
            if backend is None:
                break
            if attempt:
                self.metrics.retries.labels("decode").inc()
            tried.add(backend.name)
            self.admission.reserve(backend, ctx.request_id, ctx.tokens)
            try:
                with tracing.leg(ctx, backend):
                    return await self._stream_leg(request, ctx, backend, payload(backend))
            except _Retryable as exc:
                last_error = str(exc)
            except _Passthrough as exc:
                ctx.outcome = "client_error"
                return self._passthrough(exc, ctx)
            finally:
                self.admission.release(backend, ctx.request_id)
        headers = {"X-Request-Id": ctx.request_id}
        if last_error:
            ctx.outcome = "upstream_error"
            return error_response(502, f"failed on every try: {last_error}", headers=headers)
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
        if not ctx.stream:
            return await self._unary_leg(ctx, backend, payload)
        config = self.config
        metrics = self.metrics
        started = time.perf_counter()
        host, port, _ = self._address(backend)
        backend.in_flight += 1
        proto: RelayProtocol | None = None
        response: web.StreamResponse | None = None
        try:
            # ---------- before the first byte: everything here may be retried elsewhere
            try:
                async with asyncio.timeout(config.decode_first_byte_timeout_s):
                    proto = await self._open(backend, ctx.path, payload, ctx.upstream_headers)
                    if proto.status != 200:
                        await proto.done
                        data = proto.take_buffered()
                        self._upstream_status(backend, proto.status, data, proto.headers)
                    first, pending = await self._first_event(proto, backend)
            except (RelayError, OSError, TimeoutError) as exc:
                error = f"{backend.role} {backend.name}: {_describe(exc)}"
                self._record_failure(backend, error)
                raise _Retryable(error) from exc

            # ---------- first byte: from here on, never retry
            response = web.StreamResponse(
                status=200,
                headers={
                    "Content-Type": proto.headers.get("content-type", "text/event-stream"),
                    "Cache-Control": "no-cache",
                    "X-Request-Id": ctx.request_id,
                },
            )
            chunked = request.version >= aiohttp.HttpVersion11
            if chunked:
                response.enable_chunked_encoding()
            else:
                response.force_close()  # HTTP/1.0: the body ends when the connection does
            await response.prepare(request)
            await response.write(first)
            self.admission.landed(backend, ctx.request_id)
            tracing.first_byte(ctx)
            now = time.perf_counter()
            metrics.ttft_route[ctx.route].observe(now - ctx.started)
            metrics.leg_decode_first.observe(now - started)
            client = request.transport
            if client is None or client.is_closing():
                raise ConnectionResetError("client went away")
            failure = await self._relay_body(proto, client, chunked, pending)
            if failure:
                message = f"{backend.role} {backend.name} failed mid-stream: {failure}"
                log.warning("%s (request %s)", message, ctx.request_id)
                self._record_failure(backend, message)
                ctx.outcome = "stream_error"
                await response.write(error_event(message))
            else:
                _mark_success(backend)
                backend.served += 1
                self.relay.release(host, port, proto)
                proto = None
            metrics.leg_decode.observe(time.perf_counter() - started)
            with contextlib.suppress(ConnectionError):
                await response.write_eof()
            return response
        except ConnectionError:
            # the client went away while we wrote: abort upstream (finally) and stop
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
        is retried once on a fresh one. The caller owns (releases or aborts) it."""
        host, port, prefix = self._address(backend)
        wire = build_request(host, port, prefix + path, payload, headers)
        for attempt in (0, 1):
            proto, reused = await self.relay.acquire(host, port, self.config.connect_timeout_s)
            try:
                proto.send(wire)
                await proto.head_done
                return proto
            except RelayError:
                proto.abort()
                if not (reused and attempt == 0):
                    raise
            except BaseException:
                proto.abort()
                raise
        raise AssertionError("unreachable")

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
        data = proto.take_buffered()
        host, port, _ = self._address(backend)
        self.relay.release(host, port, proto)
        return data, proto.status, proto.headers

    async def _first_event(
        self, proto: RelayProtocol, backend: BackendState
    ) -> tuple[bytes, bytes]:
        """Wait for the first complete SSE event; returns (it, what follows it)."""
        loop = asyncio.get_running_loop()
        acc = b""
        while True:
            acc += proto.take_buffered()
            cut = acc.rfind(SSE_END)
            if cut >= 0:
                proto.on_data = None
                return acc[: cut + 2], acc[cut + 2 :]
            if proto.done.done():
                proto.done.result()  # raises the connection error, if any
                if acc:
                    return acc, b""
                raise RelayError(f"{backend.role} {backend.name} closed before the first event")
            woke: asyncio.Future[None] = loop.create_future()
            proto.on_data = lambda fut=woke: None if fut.done() else fut.set_result(None)
            await woke

    async def _relay_body(
        self, proto: RelayProtocol, client: asyncio.BaseTransport, chunked: bool, pending: bytes
    ) -> str:
        """Forward the rest of the body, event-aligned, straight from the upstream
        protocol's callbacks to the client transport. Returns a failure text or ""."""
        loop = asyncio.get_running_loop()
        write = client.write  # type: ignore[attr-defined]
        buffer_size = client.get_write_buffer_size  # type: ignore[attr-defined]
        upstream = proto.transport
        assert upstream is not None
        watchdog = _IdleWatchdog(proto.abort, self.config.stream_idle_timeout_s)
        state: dict[str, Any] = {"pending": pending, "paused": False}

        def resume_when_drained() -> None:
            if client.is_closing() or proto.closed:
                return
            if buffer_size() > _LOW_WATER:
                loop.call_later(0.01, resume_when_drained)
                return
            state["paused"] = False
            upstream.resume_reading()

        def sink(data: bytes) -> None:
            watchdog.last = loop.time()
            held = state["pending"]
            if held:
                data = held + data
                state["pending"] = b""
            if not data.endswith(SSE_END):
                cut = data.rfind(SSE_END)
                if cut < 0:
                    state["pending"] = data
                    return
                state["pending"] = data[cut + 2 :]
                data = data[: cut + 2]
            if chunked:
                write(b"%x\r\n%b\r\n" % (len(data), data))
            else:
                write(data)
            if not state["paused"] and buffer_size() > _HIGH_WATER:
                state["paused"] = True  # a slow client: stop reading the engine for now
                upstream.pause_reading()
                loop.call_later(0.01, resume_when_drained)

        rest = proto.take_buffered()
        proto.sink = sink
        if rest:
            sink(rest)
        failure = ""
        try:
            await proto.done
        except RelayError as exc:
            failure = str(exc)
        finally:
            watchdog.cancel()
        if watchdog.fired:
            return f"no data for {self.config.stream_idle_timeout_s:g}s"
        if not failure and state["pending"]:
            tail = state["pending"]
            write(b"%x\r\n%b\r\n" % (len(tail), tail) if chunked else tail)
        return failure

    def _address(self, backend: BackendState) -> tuple[str, int, str]:
        cached = self._addresses.get(backend.url)
        if cached is None:
            cached = self._addresses[backend.url] = split_url(backend.url)
        return cached

    def _upstream_status(
        self, backend: BackendState, status: int, data: bytes, headers: Any
    ) -> None:
        """Raise for a non-200 upstream answer: 4xx passes through, the rest retries."""
        content_type = headers.get("content-type") or headers.get("Content-Type")
        if 400 <= status < 500 and status not in (408, 429):
            raise _Passthrough(status, data, content_type or "application/json")
        error = f"{backend.role} {backend.name} answered {status}: " + data[:200].decode(
            errors="replace"
        )
        if status >= 500:
            self._record_failure(backend, error)
        raise _Retryable(error)

    async def _unary_leg(
        self, ctx: RequestContext, backend: BackendState, payload: bytes
    ) -> web.StreamResponse:
        """A non-streaming final leg: all or nothing, so always retryable."""
        started = time.perf_counter()
        backend.in_flight += 1
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                data, status, headers = await self._call(
                    backend, ctx.path, payload, ctx.upstream_headers
                )
        except (RelayError, OSError, TimeoutError) as exc:
            error = f"{backend.role} {backend.name}: {_describe(exc)}"
            self._record_failure(backend, error)
            raise _Retryable(error) from exc
        finally:
            backend.in_flight -= 1
        if status != 200:
            self._upstream_status(backend, status, data, headers)
        _mark_success(backend)
        backend.served += 1
        tracing.first_byte(ctx)
        now = time.perf_counter()
        self.metrics.ttft_route[ctx.route].observe(now - ctx.started)
        self.metrics.leg_decode.observe(now - started)
        return web.Response(
            body=data,
            status=200,
            headers={
                "Content-Type": headers.get("content-type", "application/json"),
                "X-Request-Id": ctx.request_id,
            },
        )

    def _passthrough(self, exc: _Passthrough, ctx: RequestContext) -> web.Response:
        return web.Response(
            body=exc.body,
            status=exc.status,
            headers={"Content-Type": exc.content_type, "X-Request-Id": ctx.request_id},
        )


def _mark_success(backend: BackendState) -> None:
    backend.consecutive_failures = 0
    backend.last_success = time.monotonic()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc)
    return f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__
