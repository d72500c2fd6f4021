"""The proxy's aiohttp application: routes, the generation entry point (auth, body,
input checks, admission), health, models, metrics. The flows are in
:mod:`pdstack.proxy.flows`, the legs in :mod:`pdstack.proxy.legs` and
:mod:`pdstack.proxy.sse`, auth and the admin API in :mod:`pdstack.proxy.admin`, the routes
forwarded to an engine as they are (``/tokenize``, ``/detokenize``, ``/v1/models/{model}``)
in :mod:`pdstack.proxy.engine_routes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from typing import Any

import aiohttp
from aiohttp import web

from pdstack.proxy import affinity, tracing
from pdstack.proxy.admin import AdminAPI, _bearer
from pdstack.proxy.admission import AdmissionRejected, KvAdmission, prompt_tokens
from pdstack.proxy.backends import BackendRegistry
from pdstack.proxy.breaker import Breaker
from pdstack.proxy.config import ProxyConfig
from pdstack.proxy.engine_routes import EngineRoutes
from pdstack.proxy.errors import ProxyRunner, error_response, openai_errors
from pdstack.proxy.flows import Flows
from pdstack.proxy.health_probes import HealthProbes
from pdstack.proxy.kv_events_route import KvRouting
from pdstack.proxy.limits import (
    BodyBudget,
    FailureLimiter,
    LegBudget,
    check_body,
    read_body,
)
from pdstack.proxy.limits import request_id as valid_request_id
from pdstack.proxy.lmcache_pd import NotifyListener
from pdstack.proxy.metrics import ProxyMetrics
from pdstack.proxy.periodic import LoopLag, every
from pdstack.proxy.progress import ProgressWatch
from pdstack.proxy.relay import RelayPool
from pdstack.proxy.request_context import RequestContext
from pdstack.proxy.routing import (
    HashRing,
    PrefixIndex,
    prompt_text,
    settle_prompt,
)
from pdstack.proxy.tenants import (
    RateLimited,
    TenantState,
    TenantTable,
    max_tokens_of,
)

log = logging.getLogger("pdstack.proxy")
_ABSENT = object()  # a key missing from a body (not even null)

PROXY_KEY: web.AppKey[Proxy] = web.AppKey("pdstack_proxy", object)  # type: ignore[arg-type]


class Proxy(HealthProbes, AdminAPI, EngineRoutes, Flows):
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
        cfg = self.config
        self.breaker = Breaker(registry, self.probe, cfg.eject_after, cfg.close_after)
        self.progress = ProgressWatch(
            lambda: self.registry, lambda: self.session, self._auth_headers, cfg,
            lambda b: self.metrics.wedged.labels(b.name).inc(),
        )
        self.breaker.progressing = self.progress.progressing  # busy is not dead (issue 54)
        self.body_budget = BodyBudget(cfg.max_body_bytes_held)
        self.admin_failures = FailureLimiter(cfg.admin_auth_failures_per_min, 60.0)
        self.leg_budget = LegBudget(
            cfg.leg_budget_base_s, cfg.leg_budget_per_1k_tokens_s, cfg.chars_per_token
        )
        self.index = PrefixIndex(self.config.index_block_chars, self.config.index_capacity)
        self.kv_routing = KvRouting(  # the engines' KV events (issue 56); idle without them
            self.config.kv_events, lambda: self.session, self._auth_headers, self.metrics.registry
        )
        self.session: aiohttp.ClientSession | None = None
        self.relay = RelayPool()
        self._addresses: dict[str, tuple[str, int, str]] = {}
        self._rings: dict[str, tuple[int, HashRing]] = {}  # role -> (registry version, ring)
        self.admission = KvAdmission(
            self.config.admission,
            lambda: self.registry.backends.values(),
            self._auth_headers,
            block_chars=self.config.index_block_chars,
        )
        if self.config.admission.enabled:
            self.metrics.watch_admission(self.admission)
        self.tenants = TenantTable(
            cfg.tenants, cfg.tenant_keys, cfg.tenant_window_s, plain_keys=cfg.api_keys
        )
        if self.tenants.configured:
            ledger = self.admission.ledger if self.config.admission.enabled else None
            self.metrics.watch_tenants(self.tenants, ledger)
            self.admission.on_wait = lambda t, s: self.metrics.tenant_waited(t, s)
        self._health_task: asyncio.Task[None] | None = None
        self._readmit_task: asyncio.Task[None] | None = None
        self.loop_lag = LoopLag(self.metrics.registry)
        self._lag_task: asyncio.Task[None] | None = None
        self._probing: set[str] = set()
        threshold = self.config.skip_prefill_threshold_tokens
        if threshold is None:
            threshold = registry.skip_prefill_threshold_tokens
        self.skip_threshold_tokens = threshold
        self.notifier: NotifyListener | None = None
        self._served_for: str | None = None
        self._served: frozenset[str] = frozenset()
        self.flow = self.pick_flow()
        self.app = self._make_app()

    # ------------------------------------------------------------------ app wiring
    def _make_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_body_bytes, middlewares=[openai_errors]
        )
        app[PROXY_KEY] = self
        app.router.add_post("/v1/completions", self.handle_generate)
        app.router.add_post("/v1/chat/completions", self.handle_generate)
        app.router.add_get("/v1/models", self.handle_models)
        self.add_engine_routes(app)  # /tokenize, /detokenize, /v1/models/{model}
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
        self._health_task = asyncio.create_task(
            every(lambda: self.config.health_interval_s, self.probe_all, "health round failed")
        )
        self._readmit_task = asyncio.create_task(
            every(self._readmit_pace, self.probe_down, "re-admission round failed")
        )
        self._lag_task = asyncio.create_task(self.loop_lag.run())
        await self.admission.start(self.session)
        await self.kv_routing.start()

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
        await self.kv_routing.close()
        if self.notifier is not None:
            await self.notifier.close()
            self.notifier = None
        for task in (self._health_task, self._readmit_task, self._lag_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.breaker.close()
        self.progress.close()
        if "stall_watch" in self.__dict__:  # made at the first migratable stream
            self.stall_watch.close()
        if self.session is not None:
            await self.session.close()
        self.relay.close()

    def runner(self) -> web.AppRunner:
        # handler_cancellation: a client disconnect cancels the handler -> upstream abort;
        # keepalive_timeout: aiohttp closes a connection without a request head that long
        # after it opened or after its last response (the idle timeout)
        return ProxyRunner(
            self.app,
            header_timeout=self.config.header_timeout_s,
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=self.config.idle_timeout_s,
        )

    # ------------------------------------------------------------------ simple endpoints
    async def handle_health(self, request: web.Request) -> web.Response:
        """200 ``{"status": "ok"}`` when every backend is healthy, 200 ``degraded`` when
        some route is usable, 503 ``degraded`` when none is. Backend names, states and
        the reason only with the admin token (an unauthorized caller learns nothing more;
        a wrong token counts as a failed admin authentication)."""
        routable = self._routable()
        backends = [b for b in self.registry.backends.values() if not b.removed]
        all_ok = routable and all(b.usable or b.drained for b in backends)
        body: dict[str, Any] = {"status": "ok" if all_ok else "degraded"}
        given = request.headers.get("Authorization") or request.headers.get("X-Admin-Token")
        # a client's API key (a poller that sends it everywhere) is no failed admin login
        client_key = bool(self.config.api_keys) and self._client_authorized(request)
        admin = bool(given and self.config.admin_token and not client_key)
        if admin and self._admin_error(request) is None:
            body["kv_mode"] = self.registry.kv_mode
            body["backends"] = {b.name: b.state for b in backends}
            if not routable:
                body["reason"] = self.registry.describe_unroutable()
        return web.json_response(body, status=200 if routable else 503)

    def _routable(self) -> bool:
        if not self.registry.mode.disaggregated:
            return any(b.usable for b in self.registry.by_role("colocated"))
        if any(
            p.usable and self.registry.decoders_for(p) for p in self.registry.by_role("prefill")
        ):
            return True
        # the decode fallback (pdstack.proxy.flows): decoders serve whole requests
        return self.config.decode_fallback and any(
            d.usable for d in self.registry.by_role("decode")
        )

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def handle_models(self, request: web.Request) -> web.StreamResponse:
        """The engines' model list (decoders first), else the served names."""
        if not self._client_authorized(request):
            return error_response(401, "invalid or missing API key", "authentication_error")
        doc = self.model_list(await self.engine_models())
        if doc is None:
            return error_response(503, self.registry.describe_unroutable())
        return web.json_response(doc)

    def _auth_headers(self) -> dict[str, str]:
        key = self.config.engine_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    # ------------------------------------------------------------------ generation
    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        metrics = self.metrics
        config = self.config
        if not self._client_authorized(request):
            metrics.outcome["unauthorized"].inc()
            return error_response(401, "invalid or missing API key", "authentication_error")
        tenant: TenantState | None = None
        if self.tenants.configured:  # a named key's tenant, else the default one
            tenant = self.tenants.lookup(_bearer(request)) or self.tenants.default
        rid = valid_request_id(request.headers.get("X-Request-Id"))
        rid_header = {"X-Request-Id": rid}
        # past capacity a request that would wait past its budget is refused on its headers:
        # under a flood the refusal must be cheap (its body is neither read nor parsed)
        try:
            self.admission.refuse_at_arrival(tenant)
        except AdmissionRejected as exc:
            metrics.outcome["rejected"].inc()
            # its unread body: aiohttp reads it away after the answer (keep-alive goes on);
            # one that never comes (half-open) closes the connection after lingering_time
            return self.admission_refused(exc, tenant, rid, admitted=False)
        # the body first (bounded in size, bytes held at once, and time), admission after:
        # a slow client holds a connection, never a slot
        raw, taken = await read_body(
            request, self.body_budget, config.max_body_bytes, config.body_timeout_s
        )
        try:
            if isinstance(raw, web.Response):
                metrics.outcome["bad_request"].inc()
                raw.headers.update(rid_header)
                return raw
            return await self._generate(request, raw, rid, tenant)
        finally:
            self.body_budget.give(taken)

    async def _generate(
        self, request: web.Request, raw: bytes, rid: str, tenant: TenantState | None = None
    ) -> web.StreamResponse:
        metrics = self.metrics
        rid_header = {"X-Request-Id": rid}
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            metrics.outcome["bad_request"].inc()
            return error_response(400, f"body is not valid JSON: {exc}", headers=rid_header)
        if not isinstance(body, dict):
            metrics.outcome["bad_request"].inc()
            return error_response(400, "body must be a JSON object", headers=rid_header)
        served = self._served_names()
        invalid = check_body(body, request.path.endswith("/chat/completions"), served)
        if invalid is not None:
            metrics.outcome["bad_request"].inc()
            invalid.headers.update(rid_header)
            return invalid
        settle_prompt(body)  # token ids as a tuple: out of the collector's way
        if self.in_flight >= self.config.max_concurrency:
            metrics.outcome["rejected"].inc()
            return error_response(
                429,
                f"proxy at its concurrency limit ({self.config.max_concurrency}); retry later",
                headers={"Retry-After": str(self.config.retry_after_s), **rid_header},
            )
        self.in_flight += 1
        ctx: RequestContext | None = None
        try:
            if self._decide(body, tenant):
                raw = json.dumps(body).encode()
            ctx = RequestContext(
                request_id=rid,
                path=request.path,
                body=body,
                raw=raw,
                stream=body.get("stream") is True,
                started=time.perf_counter(),
                session=affinity.session_key(request.headers, body),
            )
            ctx.text = prompt_text(body)
            if self.config.admission.enabled:  # its expected KV (its prompt hashed once)
                self.admission.expect(
                    rid, max_tokens_of(body), self._hashes(ctx), len(ctx.text), ctx.stream
                )
            ctx.budget_s = self.leg_budget.for_chars(len(ctx.text))
            ctx.upstream_headers = {
                "Content-Type": "application/json",
                "X-Request-Id": rid,
                **self._auth_headers(),
            }
            with tracing.request(ctx, request.headers, tenant.name if tenant else ""):
                if tenant is None:
                    response = await self._serve(request, ctx)
                else:
                    response = await self._serve_tenant(request, ctx, tenant)
            metrics.outcome[ctx.outcome].inc()
            return response
        except asyncio.CancelledError:
            if ctx is not None and ctx.answered:  # it had its whole answer, then went
                metrics.outcome[ctx.outcome].inc()
            else:
                metrics.outcome["client_disconnect"].inc()
                if ctx is not None:
                    ctx.outcome = "client_disconnect"
            raise
        finally:
            self.in_flight -= 1
            if ctx is not None:
                self.admission.forget(ctx.request_id)  # a hold its final leg never took
                self.kv_routing.prefilled(ctx.request_id)  # one that never got a first byte
                if ctx.ticket is not None:
                    self._tenant_done(ctx, ctx.ticket.tenant)

    # ------------------------------------------------------------------ tenants
    def _decide(self, body: dict[str, Any], tenant: TenantState | None) -> bool:
        """What only the proxy decides, never a client: where KV comes from (a client's
        ``kv_transfer_params`` dropped) and, on engines with vLLM's priority scheduling, who
        goes first (``priority`` = the tenant's class rank: interactive 0, batch 1; lower
        is earlier). True when ``body`` changed."""
        changed = body.pop("kv_transfer_params", _ABSENT) is not _ABSENT
        if self.config.engine_priority:
            rank = tenant.policy.rank if tenant is not None else 0
            changed = changed or body.get("priority") != rank
            body["priority"] = rank
        return changed

    async def _serve_tenant(
        self, request: web.Request, ctx: RequestContext, tenant: TenantState
    ) -> web.StreamResponse:
        """The tenant's limits first (429 naming the one it is over), then the flow."""
        ctx.tokens = prompt_tokens(ctx.body, len(ctx.text or ""), self.config.chars_per_token)
        try:
            ctx.ticket = self.tenants.admit(tenant, ctx.tokens, max_tokens_of(ctx.body))
        except RateLimited as exc:
            ctx.outcome = "rejected"
            return self.tenant_refused(ctx.request_id, exc, tenant.label, admitted=False)
        return await self._serve(request, ctx)

    def tenant_refused(
        self, request_id: str, exc: RateLimited, label: str, admitted: bool
    ) -> web.Response:
        """A tenant limit's 429 (``Retry-After``, ``code: rate_limit_exceeded``); a request
        never admitted is counted here (admitted ones at their end)."""
        self.metrics.tenant_rejected(label, exc.limit)
        if not admitted:
            self.metrics.tenant_outcome(label, "rejected")
        log.info("429: tenant %s over %s (request %s)", exc.tenant, exc.limit, request_id)
        return exc.response(request_id)

    def _tenant_done(self, ctx: RequestContext, tenant: TenantState) -> None:
        assert ctx.ticket is not None
        served = ctx.outcome == "ok"
        used = self.tenants.release(ctx.ticket, served)
        self.metrics.tenant_outcome(tenant.label, ctx.outcome)
        if used:
            prompt = min(ctx.tokens, used)
            self.metrics.tenant_tokens(tenant.label, prompt, used - prompt)

    def _served_names(self) -> frozenset[str]:
        name = self.registry.served_model_name
        if name != self._served_for:
            self._served_for = name
            self._served = frozenset(n.strip() for n in name.split(",") if n.strip())
        return self._served
