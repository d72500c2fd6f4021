"""Decode fallback: a decoder serves a P/D request whole (it computes the prompt itself, no
KV handoff) when no prefiller can take it, when every prefill try failed, or when every
decode try failed before its first byte; the request moves to another engine before its
first byte, as :mod:`pdstack.proxy.migration` moves a stream after it (the flow:
:mod:`pdstack.proxy.flows`, item 6)."""

from __future__ import annotations

import logging

from aiohttp import web

from pdstack.proxy.backends import BackendState
from pdstack.proxy.legs import Legs
from pdstack.proxy.request_context import RequestContext

log = logging.getLogger("pdstack.proxy")


class DecodeFallback(Legs):
    """Mixin of :class:`pdstack.proxy.flows.Flows`: when and how a decoder serves a request
    whole."""

    def _pick_decoder(
        self, ctx: RequestContext, decoders: list[BackendState]
    ) -> BackendState | None:
        raise NotImplementedError  # pdstack.proxy.flows.Flows

    def _fallback_after_decode(self, ctx: RequestContext, answer: web.StreamResponse) -> bool:
        """Every decode try failed before its first byte (``answer``: the client's 502 or
        503; nothing was sent): a usable decoder serves the request whole instead (it
        recomputes the prompt), as after failed prefill tries. A decoder cut while it pulled
        the KV from a prefiller that stopped (a rolling upgrade's) was such a 502. Not after
        a timed-out try (504: the client has waited a budget already)."""
        return (
            ctx.outcome in ("no_backend", "upstream_error")
            and answer.status in (502, 503)
            and not answer.prepared
            and self._decoder_up()
        )

    def _prefill_down(self) -> bool:
        """No prefiller can take a request now, and some decoder can serve it whole."""
        registry = self.registry
        if any(p.usable and registry.decoders_for(p) for p in registry.by_role("prefill")):
            return False
        return self._decoder_up()

    def _fallback_after_prefill(self, ctx: RequestContext, answer: web.StreamResponse) -> bool:
        """Every prefill try failed (``answer``: the client's error): does a decoder serve
        the request whole instead? Yes when no prefiller is usable now; and when the last try
        failed without timing out (refused or cut: a prefiller that crashed, which the breaker
        ejects only after its /health probe) while some decoder is usable: never a 502 that a
        decoder could have served. Not after a timed-out try with prefillers still in (the
        client has waited a leg budget already), nor for the engine's own answer (a 4xx)."""
        if ctx.outcome not in ("no_backend", "upstream_error"):
            return False
        return self._prefill_down() or (answer.status != 504 and self._decoder_up())

    def _decoder_up(self) -> bool:
        """Decode fallback is on and some decoder can serve a request whole."""
        return self.config.decode_fallback and any(
            d.usable for d in self.registry.by_role("decode")
        )

    async def _serve_decode_fallback(
        self, request: web.Request, ctx: RequestContext, why: str
    ) -> web.StreamResponse:
        """One leg to a decoder (p2c, KV headroom first) with the original request: it
        computes the prompt itself (no KV handoff), as a colocated engine would."""
        ctx.route = "decode_fallback"
        self.metrics.decode_fallback.inc()
        log.info("%s: decoder serves request %s whole", why, ctx.request_id)

        def pick(tried: set[str]) -> BackendState | None:
            decoders = [d for d in self.registry.by_role("decode", out=tried)
                        if d.usable and d.name not in tried]
            return self._pick_decoder(ctx, decoders)

        return await self._final_leg(request, ctx, pick, lambda backend: ctx.raw)
