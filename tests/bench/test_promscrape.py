"""promscrape: preemptions, external prefix-cache hits, LMCache metrics and the load
gauges, from a saved /metrics text with vLLM 0.26's names (vllm/v1/metrics/loggers.py)
and the shape of an OTel-exported LMCache MP counter and gauge."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from aiohttp import web

from pdstack.bench import promscrape, report, runner
from pdstack.testing.proxy_harness import serve

DATA = Path(__file__).parent / "data"
BEFORE = (DATA / "vllm_metrics_before.prom").read_text()
AFTER = (DATA / "vllm_metrics_after.prom").read_text()


def test_counter_deltas_per_endpoint_and_total() -> None:
    before = {"a": promscrape.parse_samples(BEFORE), "b": promscrape.parse_samples(BEFORE)}
    after = {"a": promscrape.parse_samples(AFTER), "b": promscrape.parse_samples(AFTER)}
    out = promscrape.summarize_deltas(before, after)
    one = out["endpoints"]["a"]
    assert one["preemptions"] == 42.0  # engine 0: 5 -> 47, engine 1: 1 -> 1
    assert (one["external_prefix_cache_hits"], one["external_prefix_cache_queries"]) == (
        7000.0, 10000.0)
    assert one["external_prefix_cache_hit_ratio"] == pytest.approx(0.7)
    assert one["prefix_cache_hit_ratio"] == pytest.approx(0.7)
    lm = one["lmcache"]
    assert lm["lmcache_mp_l1_lookup_hits_total{otel_scope_name=lmcache.l1}"] == 100.0
    assert lm["lmcache_mp_l1_usage_bytes"] == 5000.0  # a gauge: its value at the end
    total = out["total"]
    assert total["preemptions"] == 84.0
    assert total["external_prefix_cache_hits"] == 14000.0
    assert total["lmcache"] == {"lmcache_mp_l1_lookup_hits_total{otel_scope_name=lmcache.l1}":
                                200.0}


def test_parse_gauges_reads_only_the_load_gauges() -> None:
    # KV: the fullest engine; running/waiting: summed; waiting_by_reason is not waiting
    assert promscrape.parse_gauges(AFTER) == {
        "kv_cache_usage": 0.97, "num_requests_running": 42.0, "num_requests_waiting": 10.0}
    assert promscrape.parse_gauges("vllm:gpu_cache_usage_perc 0.5\n") == {"kv_cache_usage": 0.5}
    assert promscrape.kv_capacity_tokens(promscrape.parse_samples(AFTER)) == 6032 * 64


def test_parse_gauges_reads_the_proxys_gate_per_engine() -> None:
    """The proxy's gate gauges: the projection summed over its engines, the base scale the
    largest (NaN: an engine with no request in its last scrape, left out)."""
    text = "\n".join([
        "# TYPE pdstack_proxy_engine_projected_tokens gauge",
        'pdstack_proxy_engine_projected_tokens{backend="a"} 1000.0',
        'pdstack_proxy_engine_projected_tokens{backend="b"} 500.0',
        'pdstack_proxy_engine_base_scale{backend="a"} 1.25',
        'pdstack_proxy_engine_base_scale{backend="b"} NaN',
        'pdstack_proxy_engine_requests_running{backend="a"} 7.0',
    ])  # fmt: skip
    assert promscrape.parse_gauges(text) == {
        "gate_projected_tokens": 1500.0, "gate_base_scale": 1.25}
    assert promscrape.parse_gauges('pdstack_proxy_engine_base_scale{backend="b"} NaN') == {}


async def test_gauge_sampler_peak_and_mean_over_the_window() -> None:
    texts = [BEFORE, AFTER, BEFORE, AFTER]
    served: list[int] = []

    async def metrics(request: web.Request) -> web.Response:
        served.append(1)
        return web.Response(text=texts[min(len(served) - 1, len(texts) - 1)])

    async def broken(request: web.Request) -> web.Response:
        return web.Response(status=500)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/broken", broken)
    async with serve(app) as base:
        good, bad = f"{base}/metrics", f"{base}/broken"
        sampler = promscrape.GaugeSampler([good, bad], interval=0.25)
        t0 = time.perf_counter()
        await sampler.run(stop_at=t0 + 0.9)
        elapsed = time.perf_counter() - t0
    assert 0.75 <= elapsed < 1.5
    assert len(sampler.rows) == 4  # ticks at 0, 0.25, 0.5, 0.75
    s = sampler.summary()
    g = s["endpoints"][good]
    assert g["samples"] == 4
    assert g["kv_cache_usage"] == {"peak": 0.97, "mean": pytest.approx((0.25 + 0.97) / 2)}
    assert g["num_requests_running"] == {"peak": 42.0, "mean": pytest.approx((5 + 42) / 2)}
    assert g["num_requests_waiting"]["peak"] == 10.0
    assert s["endpoints"][bad]["samples"] == 0
    assert "500" in s["endpoints"][bad]["last_error"]
    assert s["total"]["kv_cache_usage"]["peak"] == 0.97
    assert s["total"]["samples"] == 4


def test_summary_table_has_the_engine_counter_columns() -> None:
    doc = {"results": [{"request_rate": 8.0, "preemptions": 108.0, "peak_kv_cache_usage": 0.985,
                        "external_prefix_cache_hit_ratio": 0.64}]}
    header, _, row = report.summary_table(doc).splitlines()[:3]
    assert header.split()[-5:] == ["ext", "hit", "preempt", "KV", "peak"]
    assert row.split() == ["8.00", "64%", "108", "98%"]


def test_sampler_without_urls_returns_at_once() -> None:
    sampler = promscrape.GaugeSampler([])
    asyncio.run(sampler.run(stop_at=time.perf_counter() + 10))
    assert sampler.summary()["total"]["samples"] == 0


def _strict_loads(text: str) -> object:
    def refuse(name: str) -> object:
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


async def test_nan_and_inf_metrics_are_written_as_null(tmp_path: Path) -> None:
    """A proxy's gauges scraped as NaN / +Inf / -Inf (the base scale with no request in a
    scrape) go through the bench's scrape path and are written as null, in strict JSON
    (the writer used to refuse them at the end of the sweep)."""
    text = "\n".join([
        "# TYPE pdstack_proxy_engine_base_scale gauge",
        'pdstack_proxy_engine_base_scale{backend="a"} NaN',
        'pdstack_proxy_engine_base_scale{backend="b"} +Inf',
        "# TYPE pdstack_proxy_engine_projected_tokens gauge",
        'pdstack_proxy_engine_projected_tokens{backend="a"} -Inf',
        'pdstack_proxy_engine_projected_tokens{backend="b"} 12.0',
        "",
    ])  # fmt: skip

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with serve(app) as base:
        url = f"{base}/metrics"
        before = await promscrape.snapshot([url])
        sampler = promscrape.GaugeSampler([url], interval=0.05)
        await sampler.run(stop_at=time.perf_counter() + 0.1)
        entry: dict[str, object] = {"request_rate": 1.0, "request_throughput": 1.0,
                                    "median_ttft_ms": float("nan"), "p99_ttft_ms": 5.0}
        await runner._add_prometheus(entry, [url], {"before": before}, sampler)
    doc = {"slo": {"ttft_p50_ms": 2000.0, "ttft_p99_ms": 3500.0}, "results": [entry]}
    out, _, _ = report.write_outputs(doc, tmp_path / "run.json")
    got = _strict_loads(out.read_text())
    assert isinstance(got, dict)
    pd = got["results"][0]["prometheus"]["endpoints"][url]["pdstack"]
    assert pd == {
        "pdstack_proxy_engine_base_scale{backend=a}": None,
        "pdstack_proxy_engine_base_scale{backend=b}": None,
        "pdstack_proxy_engine_projected_tokens{backend=a}": None,
        "pdstack_proxy_engine_projected_tokens{backend=b}": 12.0,
    }
    assert got["results"][0]["median_ttft_ms"] is None
    assert got["results"][0]["p99_ttft_ms"] == 5.0
    assert report.finite({"a": (1.0, float("-inf"))}) == {"a": [1.0, None]}
