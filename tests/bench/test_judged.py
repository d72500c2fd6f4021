"""Each request judged: SLO-attained throughput, attainment, refusals by HTTP status with
their time to refusal, other failures; against a local server that refuses some requests
quickly (429), some slowly (503), answers some in time, some late, and cuts some short."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from pdstack.bench import report
from pdstack.bench.client import BenchClient, RequestResult
from pdstack.bench.stats import summarize
from pdstack.bench.workload import ChatRequest
from pdstack.testing.proxy_harness import serve

SLO_MS = 200.0
SLOW_S = 0.4  # the 503s' time to refusal and the late answers' TTFT: past the SLO
# request index -> what the server does with it
PLAN = ["429"] * 3 + ["503"] * 2 + ["fast"] * 3 + ["late"] * 1 + ["cut"] * 1


def _event(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"


async def _completions(request: web.Request) -> web.StreamResponse:
    index = int(request.headers["X-Request-Id"].rsplit("-", 1)[1])
    what = PLAN[index]
    if what == "429":
        return web.Response(status=429, text="over quota")
    if what == "503":
        await asyncio.sleep(SLOW_S)
        return web.Response(status=503, text="no engine would admit it in time")
    resp = web.StreamResponse()
    await resp.prepare(request)
    if what == "late":
        await asyncio.sleep(SLOW_S)
    await resp.write(_event("a"))
    await resp.write(_event("b"))
    if what != "cut":
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
    async with serve(app) as url:
        yield url


async def _send_all(url: str) -> tuple[list[RequestResult], float, float]:
    reqs = [ChatRequest(i, None, "sys", "question", 2, 2) for i in range(len(PLAN))]
    results: list[RequestResult] = []
    start = time.perf_counter()
    async with BenchClient(url, "m", endpoint="completions") as client:
        await asyncio.gather(*(client.send(r, results) for r in reqs))
    return results, start, time.perf_counter() + 0.01


async def test_refusals_attainment_and_goodput(server: str) -> None:
    results, start, end = await _send_all(server)
    m = summarize(results, window_start=start, window_end=end, asked_rate=None, slo_ttft_ms=SLO_MS)
    assert m["num_prompts"] == 10
    assert m["refusals"] == {"429": 3, "503": 2}
    assert m["other_failures"] == {"truncated": 1}
    assert m["completed"] == 4  # 3 fast + 1 late; the cut one is a failure
    # 3 of the 10 sent met the SLO (the late one completed, past it)
    assert m["slo_attainment_pct"] == pytest.approx(30.0)
    assert m["slo_goodput_rps"] == pytest.approx(3 / m["duration"])
    assert m["slo_goodput_rps"] < m["request_throughput"] == pytest.approx(4 / m["duration"])
    # time to refusal: 3 quick 429s, 2 slow 503s -> the median is a quick one
    assert m["median_refusal_ms"] < SLOW_S * 1000 / 2
    assert SLOW_S * 1000 <= m["p99_refusal_ms"] < SLOW_S * 1000 + 1000
    # the existing keys keep their meaning
    assert m["errors"] == {"http_429": 3, "http_503": 2, "truncated": 1}
    assert m["failed"] == 6


async def test_a_stricter_slo_is_met_by_fewer(server: str) -> None:
    results, start, end = await _send_all(server)
    m = summarize(
        results,
        window_start=start,
        window_end=end,
        asked_rate=None,
        slo_ttft_ms=SLOW_S * 1000 + 2000,
    )  # the late answer is now in time
    assert m["slo_attainment_pct"] == pytest.approx(40.0)
    none = summarize(results, window_start=start, window_end=end, asked_rate=None, slo_ttft_ms=0.0)
    assert none["slo_attainment_pct"] == 0.0 and none["slo_goodput_rps"] == 0.0


def test_nothing_sent_has_no_attainment_and_no_refusal_times() -> None:
    m = summarize([], window_start=0.0, window_end=1.0, asked_rate=1.0, slo_ttft_ms=SLO_MS)
    assert m["slo_attainment_pct"] is None
    assert m["slo_goodput_rps"] == 0.0
    assert (m["refusals"], m["median_refusal_ms"], m["p99_refusal_ms"]) == ({}, None, None)
    assert "slo_goodput_rps" not in summarize([], window_start=0.0, window_end=1.0, asked_rate=1.0)


async def test_table_shows_goodput_attainment_and_refusals(server: str) -> None:
    results, start, end = await _send_all(server)
    entry = summarize(
        results, window_start=start, window_end=end, asked_rate=8.0, slo_ttft_ms=SLO_MS
    )
    doc = {
        "slo": {"ttft_p50_ms": 2000.0, "ttft_p99_ms": 3500.0, "ttft_ms": SLO_MS},
        "results": [entry],
    }
    table = report.summary_table(doc)
    header, _, row = table.splitlines()[:3]
    cells = dict(zip(header.split(), row.split(), strict=False))
    assert cells["SLO%"] == "30%"
    assert float(cells["good/s"]) == pytest.approx(entry["slo_goodput_rps"], abs=0.01)
    assert "8/s refusals: 429 x3, 503 x2" in table
    assert "other failures: truncated 1" in table
