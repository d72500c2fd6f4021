"""Optional OpenTelemetry traces of the proxy (off unless configured).

One span per client request (``pdstack.request``, SERVER) with children:
- ``routing``: from the request's arrival to the first leg's start (prompt hashing, the
  skip-prefill index lookup, the affinity pick);
- ``prefill leg`` / ``decode leg`` (``engine leg`` for colocated): one per try, CLIENT,
  tagged with the backend's name, node, role, generation; a ``traceparent`` header goes
  upstream, so vLLM's own spans (``--otlp-traces-endpoint``) join the trace;
- ``kv wait``: in ``lmcache-pd`` the wait for LMCache's ProxyNotif; in the other P/D modes
  the decode leg's start to its first byte (the decoder pulls / loads the prompt's KV and
  computes the first token: the proxy cannot split the two).
Every span carries ``pdstack.request_id`` (the X-Request-Id); the request span also
``pdstack.tenant`` when tenants are configured (:mod:`pdstack.proxy.tenants`).

Enabled by :func:`configure_from_env` (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, OTLP/HTTP,
set by ``pdstack render`` from ``pdstack_observability.otlp_traces_endpoint``) or by
:func:`configure` with any SDK ``TracerProvider`` (tests: the in-memory exporter). When off,
every helper is a no-op that allocates nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pdstack.proxy.backends import BackendState

_tracer: Any = None
_propagator: Any = None
_provider: Any = None
_NULL = contextlib.nullcontext()
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"


class TracedRequest(Protocol):
    """What tracing reads and writes of a request: the fields of the proxy's
    ``pdstack.proxy.request_context.RequestContext`` it uses (a protocol, so that this module, which
    the request's code imports, imports none of it)."""

    request_id: str
    path: str
    route: str
    outcome: str
    upstream_headers: dict[str, str]
    trace: Any  # the RequestTrace while traced, else None


class TracingUnavailable(RuntimeError):
    pass


def configure(provider: Any) -> None:
    """Trace with ``provider`` (an ``opentelemetry.sdk.trace.TracerProvider``)."""
    global _tracer, _propagator, _provider
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _provider = provider
    _tracer = provider.get_tracer("pdstack.proxy")
    _propagator = TraceContextTextMapPropagator()


def disable() -> None:
    global _tracer, _propagator, _provider
    _tracer = _propagator = _provider = None


def flush(timeout_ms: int = 5000) -> bool:
    """Export every finished span now (the SDK also flushes at exit)."""
    return bool(_provider is None or _provider.force_flush(timeout_ms))


def enabled() -> bool:
    return _tracer is not None


def configure_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """Export spans over OTLP/HTTP when ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set;
    returns the endpoint (None: tracing stays off)."""
    endpoint = environ.get(ENDPOINT_ENV, "").strip()
    if not endpoint:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable(
            f"{ENDPOINT_ENV}={endpoint} but OpenTelemetry is not installed "
            f"(pip install 'pdstack[tracing]'): {exc}"
        ) from exc
    resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME", "pdstack-proxy")})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    configure(provider)
    return endpoint


@dataclass
class RequestTrace:
    span: Any
    context: Any
    start_ns: int
    routed: bool = False
    final_start_ns: int = 0
    final_backend: str = ""
    kv_waited: bool = False


def _backend_attrs(ctx: TracedRequest, backend: BackendState) -> dict[str, str]:
    return {
        "pdstack.request_id": ctx.request_id,
        "pdstack.backend": backend.name,
        "pdstack.node": backend.node,
        "pdstack.role": backend.role,
        "pdstack.generation": backend.generation,
    }


def _fail(span: Any, exc: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    if not isinstance(exc, asyncio.CancelledError):
        span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, type(exc).__name__))


@contextlib.contextmanager
def _request(ctx: TracedRequest, headers: Mapping[str, str], tenant: str) -> Iterator[None]:
    from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

    parent = _propagator.extract(headers)
    start = time.time_ns()
    span = _tracer.start_span(
        "pdstack.request", context=parent, kind=SpanKind.SERVER, start_time=start,
        attributes={"pdstack.request_id": ctx.request_id, "http.route": ctx.path},
    )
    if tenant:
        span.set_attribute("pdstack.tenant", tenant)
    ctx.trace = RequestTrace(span, set_span_in_context(span), start)
    try:
        yield
    except BaseException as exc:
        _fail(span, exc)
        if isinstance(exc, asyncio.CancelledError):
            span.set_attribute("pdstack.outcome", "client_disconnect")
        raise
    else:
        span.set_attribute("pdstack.outcome", ctx.outcome)
        if ctx.outcome not in ("ok", "client_error"):
            span.set_status(Status(StatusCode.ERROR, ctx.outcome))
    finally:
        span.set_attribute("pdstack.route", ctx.route)
        span.end()


def request(
    ctx: TracedRequest, headers: Mapping[str, str], tenant: str = ""
) -> contextlib.AbstractContextManager:
    """The request's root span (a ``traceparent`` from the client becomes its parent),
    tagged ``pdstack.tenant`` when tenants are configured."""
    return _NULL if _tracer is None else _request(ctx, headers, tenant)


def _routing(t: RequestTrace, ctx: TracedRequest, backend: BackendState) -> None:
    if t.routed:
        return
    t.routed = True
    span = _tracer.start_span(
        "routing", context=t.context, start_time=t.start_ns,
        attributes={"pdstack.request_id": ctx.request_id, "pdstack.route": ctx.route,
                    "pdstack.first_backend": backend.name},
    )
    span.end()


@contextlib.contextmanager
def _leg(ctx: TracedRequest, backend: BackendState) -> Iterator[None]:
    from opentelemetry.trace import SpanKind, set_span_in_context

    t: RequestTrace = ctx.trace
    _routing(t, ctx, backend)
    name = {"prefill": "prefill leg", "decode": "decode leg"}.get(backend.role, "engine leg")
    span = _tracer.start_span(
        name, context=t.context, kind=SpanKind.CLIENT, attributes=_backend_attrs(ctx, backend)
    )
    if backend.role != "prefill":
        t.final_start_ns = time.time_ns()
        t.final_backend = backend.name
    headers: MutableMapping[str, str] = ctx.upstream_headers
    _propagator.inject(headers, context=set_span_in_context(span))
    try:
        yield
    except BaseException as exc:
        _fail(span, exc)
        raise
    finally:
        span.end()


def leg(ctx: TracedRequest, backend: BackendState) -> contextlib.AbstractContextManager:
    """One try of a leg on ``backend`` (its ``traceparent`` goes upstream)."""
    return _NULL if ctx.trace is None else _leg(ctx, backend)


@contextlib.contextmanager
def _kv_wait(ctx: TracedRequest) -> Iterator[None]:
    t: RequestTrace = ctx.trace
    t.kv_waited = True
    span = _tracer.start_span(
        "kv wait", context=t.context,
        attributes={"pdstack.request_id": ctx.request_id, "pdstack.kv_wait": "lmcache-pd notify"},
    )
    try:
        yield
    finally:
        span.end()


def kv_wait(ctx: TracedRequest) -> contextlib.AbstractContextManager:
    """lmcache-pd: the wait for the prefiller's ProxyNotif."""
    return _NULL if ctx.trace is None else _kv_wait(ctx)


def first_byte(ctx: TracedRequest) -> None:
    """The final leg's first byte: in the P/D route without a ProxyNotif wait, the span
    from the decode leg's start to here is the KV wait."""
    t: RequestTrace | None = ctx.trace
    if t is None or t.kv_waited or ctx.route != "pd" or not t.final_start_ns:
        return
    t.kv_waited = True
    span = _tracer.start_span(
        "kv wait", context=t.context, start_time=t.final_start_ns,
        attributes={"pdstack.request_id": ctx.request_id, "pdstack.backend": t.final_backend,
                    "pdstack.kv_wait": "decode leg start to first byte"},
    )
    span.end()
