"""OpenTelemetry traces of the proxy: the real proxy and the real OTel SDK with its
in-memory exporter, engines are FakeEngine test doubles. One root span per request with the
routing / prefill leg / kv wait / decode leg children, the X-Request-Id on every span, and a
traceparent upstream so engine spans join the trace."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from pdstack.proxy import tracing
from pdstack.testing.fake_engine import Faults
from pdstack.testing.proxy_harness import (
    backend,
    engines,
    running_proxy,
    serve,
    stream_completion,
    table,
)

PROMPT = "You are a helpful assistant. " * 20 + "question"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    tracing.configure(provider)
    try:
        yield exp
    finally:
        tracing.disable()


async def test_pd_request_has_four_child_spans_with_request_id(exporter) -> None:
    async with engines("p0", "d0", output_tokens=4) as e:
        t = table("nixl", [backend("p0", "prefill", e["p0"]), backend("d0", "decode", e["d0"])])
        async with running_proxy(t) as rp:
            res = await stream_completion(rp.session, rp.url, PROMPT,
                                          headers={"X-Request-Id": "trace-me-1"}, max_tokens=3)
            assert res.status == 200
    spans = exporter.get_finished_spans()
    by_name = {s.name: s for s in spans}
    assert sorted(by_name) == ["decode leg", "kv wait", "pdstack.request", "prefill leg",
                               "routing"], [s.name for s in spans]
    assert len(spans) == 5
    root = by_name["pdstack.request"]
    assert root.parent is None
    assert root.attributes["pdstack.outcome"] == "ok"
    assert root.attributes["pdstack.route"] == "pd"
    for name in ("routing", "prefill leg", "kv wait", "decode leg"):
        span = by_name[name]
        assert span.parent is not None and span.parent.span_id == root.context.span_id, name
        assert span.context.trace_id == root.context.trace_id
        assert span.attributes["pdstack.request_id"] == "trace-me-1", name
        assert root.start_time <= span.start_time <= span.end_time <= root.end_time, name
    assert by_name["prefill leg"].attributes["pdstack.backend"] == "p0"
    assert by_name["decode leg"].attributes["pdstack.backend"] == "d0"
    assert by_name["kv wait"].attributes["pdstack.backend"] == "d0"
    # order: routing, then the prefill leg, then the decode leg (which holds the kv wait)
    assert by_name["routing"].end_time <= by_name["prefill leg"].start_time
    assert by_name["prefill leg"].end_time <= by_name["decode leg"].start_time
    assert by_name["decode leg"].start_time <= by_name["kv wait"].start_time
    # each leg sent its own span as the engine's parent (W3C traceparent)
    for eng, name in (("p0", "prefill leg"), ("d0", "decode leg")):
        (seen,) = e[eng].seen()
        span = by_name[name]
        assert seen.headers["traceparent"].startswith(
            f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-"), eng


async def test_client_traceparent_is_the_parent_and_failed_leg_is_an_error(exporter) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent = "00f067aa0ba902b7"
    async with engines("p0", "d0", output_tokens=2) as e:
        t = table("nixl", [backend("p0", "prefill", e["p0"]), backend("d0", "decode", e["d0"])])
        async with running_proxy(t, eject_after=100, decode_fallback=False) as rp:
            # the only prefiller fails, and its /health confirms it: 502 to the client (a 5xx
            # with a passing /health would go to the client as is)
            e["p0"].faults = Faults(status=500, health_status=503)
            res = await stream_completion(
                rp.session, rp.url, PROMPT,
                headers={"X-Request-Id": "trace-me-2", "traceparent": f"00-{trace_id}-{parent}-01"},
                max_tokens=2)
            assert res.status == 502
    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.name == "pdstack.request")
    assert f"{root.context.trace_id:032x}" == trace_id
    assert root.parent is not None and f"{root.parent.span_id:016x}" == parent
    assert root.status.status_code == StatusCode.ERROR
    assert root.attributes["pdstack.outcome"] == "upstream_error"
    (leg,) = [s for s in spans if s.name == "prefill leg"]
    assert leg.status.status_code == StatusCode.ERROR
    assert leg.attributes["pdstack.backend"] == "p0"
    assert leg.attributes["pdstack.request_id"] == "trace-me-2"
    assert not [s for s in spans if s.name in ("decode leg", "kv wait")]


async def test_tracing_off_sends_no_traceparent() -> None:
    assert not tracing.enabled()
    async with engines("p0", "d0", output_tokens=2) as e:
        t = table("nixl", [backend("p0", "prefill", e["p0"]), backend("d0", "decode", e["d0"])])
        async with running_proxy(t) as rp:
            res = await stream_completion(rp.session, rp.url, PROMPT, max_tokens=2)
            assert res.status == 200
    assert "traceparent" not in e["p0"].seen()[0].headers


def test_configure_from_env_needs_an_endpoint() -> None:
    assert tracing.configure_from_env({}) is None
    assert not tracing.enabled()


async def test_spans_reach_an_otlp_http_endpoint() -> None:
    """The OTLP/HTTP exporter that OTEL_EXPORTER_OTLP_TRACES_ENDPOINT turns on, against an
    in-process HTTP receiver decoding the protobuf export requests."""
    from aiohttp import web
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    received: list[ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        received.append(msg)
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    async with serve(app) as base:
        endpoint = f"{base}/v1/traces"
        try:
            assert tracing.configure_from_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
                                               "OTEL_SERVICE_NAME": "proxy-under-test"}) == endpoint
            async with engines("p0", "d0", output_tokens=2) as e:
                t = table("nixl", [backend("p0", "prefill", e["p0"]),
                                   backend("d0", "decode", e["d0"])])
                async with running_proxy(t) as rp:
                    res = await stream_completion(rp.session, rp.url, PROMPT,
                                                  headers={"X-Request-Id": "otlp-1"}, max_tokens=2)
                    assert res.status == 200
            # the exporter posts from its own thread: flush there, not on this loop
            import asyncio

            assert await asyncio.to_thread(tracing.flush)
        finally:
            tracing.disable()
    spans = [(rs, s) for m in received for rs in m.resource_spans
             for ss in rs.scope_spans for s in ss.spans]
    names = sorted(s.name for _, s in spans)
    assert names == ["decode leg", "kv wait", "pdstack.request", "prefill leg", "routing"]
    for rs, s in spans:
        attrs = {a.key: a.value.string_value for a in s.attributes}
        assert attrs["pdstack.request_id"] == "otlp-1", s.name
        service = {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"]
        assert service == "proxy-under-test"
