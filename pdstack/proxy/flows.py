"""The request flows, by KV mode; each picks backends and runs the legs
(:mod:`pdstack.proxy.legs`).

Request flow (``/v1/completions``, ``/v1/chat/completions``):
1. API key (if configured); the body, read within ``body_timeout_s`` and the byte limits
   of :mod:`pdstack.proxy.limits`; input checks (400 naming the field, 404 for a model
   not served); then admission (over ``max_concurrency`` -> 429 + Retry-After).
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
6. Decode fallback (``decode_fallback``, on by default): when no prefiller can take the
   request (none usable with a usable paired decoder, or every prefill try failed: left
   none usable, or failed without timing out, as on a prefiller that crashed), one leg
   with the original request to a decoder (p2c), which computes the prompt itself; route
   ``decode_fallback``, counted in ``decode_fallback_total``. The same after every decode
   try of a P/D request failed before its first byte (502/503, not a timeout): e.g. a
   decoder cut while it pulled the KV from a prefiller that a rolling upgrade stopped. That
   prefiller counts the decode leg in its ``in_flight`` until the leg's first byte, so a
   drain waits for the pull, not only for the prefill answer.
Retries: a failed prefill leg, or a decode leg that has not produced its first byte,
is retried on another backend (which failures count against a backend, and the circuit
breaker: :mod:`pdstack.proxy.breaker`); each leg waits at most its budget
(:class:`pdstack.proxy.limits.LegBudget`, from the prompt length) for the prefill answer
or the first byte; never after bytes reached the client (then a stream that can migrate
goes on on another engine, :mod:`pdstack.proxy.migration`; else it ends with an OpenAI
error event and ``data: [DONE]``). Client disconnect cancels the
handler, which closes the upstream connection(s), so the engines abort.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdstack.proxy import tracing
from pdstack.proxy.admission import AdmissionRejected, prompt_tokens
from pdstack.proxy.backends import BackendState
from pdstack.proxy.errors import error_response
from pdstack.proxy.kv_events_route import KvRouting, RequestBlocks
from pdstack.proxy.lmcache_pd import LmcachePdFlow
from pdstack.proxy.migration_fallback import DecodeFallback
from pdstack.proxy.request_context import RequestContext
from pdstack.proxy.routing import (
    HashRing,
    PrefixIndex,
    pick_bounded_load,
    pick_p2c,
    prompt_text,
    stable_hash,
)
from pdstack.proxy.tenants import RateLimited, TenantState

log = logging.getLogger("pdstack.proxy")


Flow = Callable[[web.Request, RequestContext], Awaitable[web.StreamResponse]]


class Flows(LmcachePdFlow, DecodeFallback):
    """Mixin of :class:`pdstack.proxy.app.Proxy`: one flow per KV mode (``lmcache-pd``'s in
    :class:`pdstack.proxy.lmcache_pd.LmcachePdFlow`; decode fallback in
    :class:`pdstack.proxy.migration_fallback.DecodeFallback`)."""

    flow: Flow  # pick_flow(), set once at start

    index: PrefixIndex
    kv_routing: KvRouting
    skip_threshold_tokens: int
    _rings: dict[str, tuple[int, HashRing]]  # role -> (registry version, ring)

    def pick_flow(self) -> Flow:
        """The flow of this proxy's KV mode (the mode is fixed: picked once, at start)."""
        mode = self.registry.mode
        if not mode.disaggregated:
            return self._serve_colocated
        if mode.lmcache_push:
            return self._serve_lmcache_pd
        return self._serve_pd

    def tenant_refused(
        self, request_id: str, exc: RateLimited, label: str, admitted: bool
    ) -> web.Response:
        raise NotImplementedError  # pdstack.proxy.app.Proxy

    def admission_refused(
        self, exc: AdmissionRejected, tenant: TenantState | None, request_id: str,
        admitted: bool,
    ) -> web.Response:
        """The client's answer to admission's refusal: 429 when it is the tenant's doing
        (over its share, or a batch tenant), else 503; ``Retry-After`` and OpenAI error JSON
        either way. ``admitted``: the request holds a tenant ticket (its outcome is counted
        at its end), else it was refused at arrival."""
        self.metrics.admission_rejected.labels(exc.reason).inc()
        retry = max(exc.retry_after_s, self.config.retry_after_s)
        if exc.tenant_fault and tenant is not None:
            limited = RateLimited(tenant.name, exc.reason, str(exc), retry)
            return self.tenant_refused(request_id, limited, tenant.label, admitted)
        if tenant is not None:
            self.metrics.tenant_rejected(tenant.label, exc.reason)
            if not admitted:
                self.metrics.tenant_outcome(tenant.label, "rejected")
        return error_response(
            503,
            str(exc),
            "server_error",
            headers={"Retry-After": str(max(1, math.ceil(retry))), "X-Request-Id": request_id},
        )

    async def _serve(self, request: web.Request, ctx: RequestContext) -> web.StreamResponse:
        if not ctx.tokens:
            ctx.tokens = prompt_tokens(ctx.body, len(self._key_text_full(ctx)),
                                       self.config.chars_per_token)
        return await self.flow(request, ctx)

    async def _serve_colocated(
        self, request: web.Request, ctx: RequestContext
    ) -> web.StreamResponse:
        """One leg to an engine chosen by prefix affinity (bounded load)."""
        ctx.route = "colocated"
        key_hash = self._affinity_hash(ctx)
        rejected = await self._admit(ctx, lambda: self.registry.by_role("colocated"))
        if rejected is not None:
            return rejected
        # what each engine holds of the prompt, from its KV events (None: not followed)
        blocks = await self.kv_routing.blocks_for(
            ctx.body, ctx.path, self.registry.by_role("colocated")
        )
        return await self._final_leg(
            request,
            ctx,
            lambda tried: self._pick_affinity(
                "colocated", key_hash, tried, ctx.tokens, ctx.request_id, blocks, ctx
            ),
            lambda backend: ctx.raw,
        )

    async def _serve_pd(self, request: web.Request, ctx: RequestContext) -> web.StreamResponse:
        """Prefill then decode (NIXL / shared-l1), or one decode leg when the skip-prefill
        decider finds the prompt's prefix in a node's LMCache store."""
        registry = self.registry
        if self.skip_threshold_tokens > 0 and registry.mode.skip_prefill:
            skipped = await self._try_skip_prefill(request, ctx)
            if skipped is not None:
                return skipped

        # ---- admission: the decoders' KV, before any prefill work is spent
        rejected = await self._admit(ctx, lambda: registry.by_role("decode"))
        if rejected is not None:
            return rejected

        # ---- no usable prefiller: the decoders serve whole requests (decode fallback)
        if self._prefill_down():
            return await self._serve_decode_fallback(request, ctx, "no usable prefiller")

        # ---- leg 1: prefill
        handoff = _Handoff()

        # the engines' KV events: the decoder holding most of the prompt pulls the least
        engines = [*registry.by_role("prefill"), *registry.by_role("decode")]
        blocks = await self.kv_routing.blocks_for(ctx.body, ctx.path, engines)

        async def prefill_leg(prefill: BackendState, attempt: int) -> None:
            handoff.plan(*self._decode_path(prefill, blocks, "cache_salt" in ctx.body))
            handoff.kv_params = await self._prefill(prefill, ctx, nixl=handoff.kv_path == "nixl")

        try:
            return await self._prefill_then_decode(request, ctx, prefill_leg, handoff)
        finally:
            handoff.unplan()

    async def _prefill_then_decode(
        self,
        request: web.Request,
        ctx: RequestContext,
        prefill_leg: Callable[[BackendState, int], Awaitable[None]],
        handoff: _Handoff,
    ) -> web.StreamResponse:
        """Leg 1 through ``prefill_leg`` (which fills ``handoff``: the decode path and the
        NIXL params), then the decode leg on that path."""
        registry = self.registry
        answered = await self._run_prefill_leg(ctx, prefill_leg)
        if not isinstance(answered, BackendState):
            if not self._fallback_after_prefill(ctx, answered):
                return answered
            ctx.outcome = "ok"  # every prefill try failed: the decoders compute it
            return await self._serve_decode_fallback(request, ctx, "every prefill try failed")
        prefill = answered
        if self.skip_threshold_tokens > 0 and registry.mode.skip_prefill:
            self.index.insert((prefill.node, prefill.generation), self._hashes(ctx))

        # ---- leg 2: decode
        chosen_prefill = prefill
        decode_raw: dict[str, bytes] = {}

        def decode_payload(backend: BackendState) -> bytes:
            path = registry.pairings.get(chosen_prefill.name, {}).get(backend.name, "")
            kv_params = handoff.kv_params
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
                for d, p in self._paired_decoders(chosen_prefill, tried_decoders)
                if d.name not in tried_decoders
            ]
            if not pairs:
                return None
            same_path = [d for d, p in pairs if p == handoff.kv_path] or [d for d, _ in pairs]
            chosen = self._pick_decoder(ctx, same_path)
            if chosen is not None:
                self.metrics.pair(chosen_prefill, chosen).inc()
            return chosen

        prefill.in_flight += 1  # until the decode leg's first byte (RequestContext.kv_source)
        ctx.kv_source = prefill
        try:
            answer = await self._final_leg(
                request, ctx, pick_decoder, decode_payload, no_backend_hint=chosen_prefill
            )
        finally:
            ctx.release_kv_source()
        if not self._fallback_after_decode(ctx, answer):
            return answer
        ctx.outcome = "ok"  # no decode try got a first byte: a decoder computes it whole
        return await self._serve_decode_fallback(request, ctx, "every decode try failed")

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
        # the prefillers' KV events: the one holding most of the prompt computes least
        prefillers = self.registry.by_role("prefill")
        blocks = await self.kv_routing.blocks_for(ctx.body, ctx.path, prefillers)

        async def run(prefill: BackendState, attempt: int) -> None:
            with tracing.leg(ctx, prefill):
                await leg(prefill, attempt)

        result = await self._with_retries(
            ctx,
            "prefill",
            lambda tried: self._pick_affinity("prefill", key_hash, tried, None, "", blocks, ctx),
            run,
            on_retryable,
        )
        return result if isinstance(result, web.StreamResponse) else result[0]

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
        tenant = ctx.ticket.tenant if ctx.ticket is not None else None
        try:
            await self.admission.wait_open(candidates, ctx.tokens, tenant, ctx.request_id)
        except AdmissionRejected as exc:
            ctx.outcome = "rejected"
            return self.admission_refused(exc, tenant, ctx.request_id, admitted=True)
        # hold the tokens now (P/D: the decoder is picked after the prefill leg)
        self.admission.hold(candidates(), ctx.request_id, ctx.tokens)
        return None

    def _pick_decoder(
        self, ctx: RequestContext, decoders: list[BackendState]
    ) -> BackendState | None:
        """A decoder among ``decoders``: those with KV headroom first; by session affinity
        (bounded load) when the request names a session, else power of two choices."""
        open_ones = self.admission.prefer_open(decoders, ctx.tokens, ctx.request_id)
        by_cost = self.kv_routing.pick_decoder(  # their KV events, when all are fresh
            open_ones, self.kv_routing.blocks_of(ctx.body), self.config.load_factor,
            "cache_salt" in ctx.body,
        )
        if by_cost is not None:
            return by_cost
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
        """The prompt's chain-hashed blocks (the prefix index's size), computed once a
        request: admission's KV count and the prefix index both read them."""
        if ctx.blocks is None:
            ctx.blocks = self.index.block_hashes(self._key_text_full(ctx))
        return ctx.blocks

    def _paired_decoders(self, prefill: BackendState,
                         out: Collection[str] = ()) -> list[tuple[BackendState, str]]:
        """Usable paired decoders (a standby for one in ``out``), shared-l1 ones first."""
        pairs = self.registry.decoders_for(prefill, out)
        pairs.sort(key=lambda pair: pair[1] != "shared-l1")
        return pairs

    def _decode_path(
        self, prefill: BackendState, blocks: RequestBlocks | None = None, salted: bool = False
    ) -> tuple[str, BackendState | None]:
        """The KV path of this request's decode leg, chosen before the prefill (which must
        know whether to hand off over NIXL), and the decoder it was chosen for: the paired
        decoder with the fewest decodes running or planned, the same-node store (shared-l1)
        on a tie. shared-l1+nixl on one H200 (issue 35) sent every request to the same-node
        decoder while the other node's, NIXL-paired one stayed idle."""
        pairs = self._paired_decoders(prefill)
        if not pairs:
            return "nixl", None
        # by the decoders' KV events when they are all fresh (pdstack.proxy.kv_events_route)
        by_cost = self.kv_routing.pick_decoder(
            [d for d, _ in pairs], blocks, self.config.load_factor, salted, count=False
        )
        if by_cost is not None:
            return next(path for d, path in pairs if d is by_cost), by_cost
        decoder, path = min(pairs, key=lambda p: p[0].in_flight + p[0].planned_decodes)
        return path, decoder

    def _pick_affinity(
        self,
        role: str,
        key_hash: int,
        tried: set[str],
        tokens: int | None = None,
        request_id: str = "",
        blocks: RequestBlocks | None = None,
        ctx: RequestContext | None = None,
    ) -> BackendState | None:
        """Bounded-load consistent hashing over usable ``role`` backends (a standby for one
        ``tried``); with ``tokens`` (gated roles) the ones with KV headroom for it first."""
        registry = self.registry
        ring = self._ring_for(role)
        if role == "prefill":
            candidates = {b.name: b for b in registry.by_role("prefill")
                          if b.usable and b.name not in tried and registry.decoders_for(b)}
        else:  # a standby stands in for one tried: a retry needs no ejection first
            candidates = {b.name: b for b in registry.by_role(role, out=tried)
                          if b.usable and b.name not in tried}
        closed: frozenset[str] = frozenset()
        if tokens is not None:
            roomy = self.admission.prefer_open(list(candidates.values()), tokens, request_id)
            if blocks is not None and self.kv_routing.config.headroom == "cost":
                closed = frozenset(candidates) - {b.name for b in roomy}
            else:
                candidates = {b.name: b for b in roomy}
        if blocks is not None and ctx is not None:  # by cost (pdstack.proxy.kv_events_route)
            return self.kv_routing.pick(ring, key_hash, candidates, self.config.load_factor,
                                        blocks, request_id, "cache_salt" in ctx.body, closed)
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


@dataclass
class _Handoff:
    """One P/D request's handoff: the decode leg's KV path, the prefill's NIXL params, and the
    decoder counted as planned (``planned_decodes``) until the request ends."""

    kv_path: str = ""
    kv_params: dict[str, Any] | None = None
    planned: BackendState | None = None

    def plan(self, kv_path: str, decoder: BackendState | None) -> None:
        self.unplan()  # a retried prefill chooses again
        self.kv_path, self.planned = kv_path, decoder
        if decoder is not None:
            decoder.planned_decodes += 1

    def unplan(self) -> None:
        if self.planned is not None:
            self.planned.planned_decodes -= 1
            self.planned = None
