"""Slow is not dead (issue 54): a busy engine whose progress counters move is never ejected,
its legs are not cut while it makes progress, and a /health that times out on it is load;
an engine that cannot make progress (counters flat, no answer) or cannot be reached is still
ejected within its budget, and each ejection says why
(``pdstack_proxy_ejections_total{backend,reason}``). FakeEngine test doubles: ``max_running=1``
queues requests in the engine (FIFO), so a request routed behind another client's work waits
for its first byte while the engine's ``vllm:generation_tokens_total`` moves."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
import pytest

from pdstack.testing import proxy_harness as ph
from pdstack.testing.fake_engine import FakeEngine, Faults


async def _direct(session: aiohttp.ClientSession, engine: FakeEngine, tokens: int) -> None:
    """Another client of the engine (not through the proxy): one streamed completion."""
    body = {"model": "fake", "prompt": "direct load", "max_tokens": tokens, "stream": True}
    async with session.post(f"{engine.url}/v1/completions", data=json.dumps(body),
                            headers={"Content-Type": "application/json"}) as resp:
        await resp.read()


async def _keep_busy(rp: ph.RunningProxy, engine: FakeEngine, n: int, tokens: int) -> list[
        asyncio.Task[None]]:
    """``n`` direct streams queued on ``engine`` (one runs at a time), the first running."""
    tasks = [asyncio.create_task(_direct(rp.session, engine, tokens)) for _ in range(n)]
    await ph.until(lambda: engine.running == 1, "the engine busy with direct work")
    return tasks


async def test_busy_decoder_whose_counters_move_is_not_wedged() -> None:
    """d0 works for another client for ~3 s (a token every 50 ms) while the proxy's streams
    wait behind it for their first byte, far past ``wedge_after_s``; the 1-token probe
    queues behind the same work and misses its deadline. Old code: wedged, ejected, its
    streams lost. Now: its counters move, so it is slow, not wedged; every stream completes."""
    async with ph.engines("p0", "d0", output_tokens=30, itl_ms=50, max_running=1) as e:
        cfg = {"wedge_after_s": 0.5, "wedge_probe_timeout_s": 0.5, "leg_budget_base_s": 30.0,
               "eject_after": 100}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), **cfg) as rp:
            d0 = rp.registry.backends["d0"]
            await ph.until(lambda: d0.healthy, "d0 admitted")
            busy = await _keep_busy(rp, e["d0"], 2, 30)
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(
                *(ph.stream_completion(rp.session, rp.url, f"q{i}", max_tokens=3)
                  for i in range(3))), 30)
            took = time.monotonic() - t0
            await asyncio.gather(*busy)
            text = await rp.metrics()
            assert all(r.status == 200 and r.events[-1] == "[DONE]" for r in results), [
                (r.status, r.text) for r in results]
            assert took > 1.5, f"the streams waited only {took:.1f}s: d0 was never suspected"
            assert d0.healthy and not d0.wedged and not d0.ejections
            assert ph.metric_value(text, "pdstack_proxy_ejections_total") == 0
            assert ph.metric_value(text, "pdstack_proxy_wedged_total") == 0


async def test_leg_budget_on_a_busy_engine_is_not_cut_while_it_progresses() -> None:
    """The only decoder works through a queue (its ``vllm:num_requests_waiting`` says 4) and
    the proxy's stream waits ~3 s for its first byte, past its 1 s leg budget: the leg is
    not cut while d0's counters move (old code: a 504 after 1 s)."""
    async with ph.engines("p0", "d0", output_tokens=30, itl_ms=50, max_running=1,
                          kv_capacity_tokens=100_000) as e:
        cfg = {"wedge_after_s": 0.5, "wedge_probe_timeout_s": 5.0, "leg_budget_base_s": 1.0,
               "leg_budget_per_1k_tokens_s": 0.0, "eject_after": 100}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), **cfg) as rp:
            d0 = rp.registry.backends["d0"]
            await ph.until(lambda: d0.healthy, "d0 admitted")
            e["d0"].num_waiting = 4
            busy = await _keep_busy(rp, e["d0"], 2, 30)
            res = await asyncio.wait_for(
                ph.stream_completion(rp.session, rp.url, "queued", max_tokens=3), 30)
            await asyncio.gather(*busy)
            assert res.status == 200 and res.events[-1] == "[DONE]", (res.status, res.text)
            assert d0.healthy and not d0.ejections


async def test_health_timeout_on_a_busy_engine_whose_counters_move_ejects_nothing() -> None:
    """d0's /health answers after 2 s (past the 0.5 s health timeout: a busy API server)
    while d0 generates for another client and the proxy's legs wait on it; its /metrics
    answers and its counters move. Old code: ejected (failed probes, or "unreachable" with
    a leg waiting). Now: load, not death; d0 stays in and every request is answered."""
    async with ph.engines("p0", "d0", "d1", output_tokens=30, itl_ms=50, max_running=1) as e:
        cfg = {"wedge_after_s": 0.5, "wedge_probe_timeout_s": 5.0, "leg_budget_base_s": 30.0,
               "eject_after": 2}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0", "d1"]), **cfg) as rp:
            d0 = rp.registry.backends["d0"]
            await ph.until(lambda: d0.healthy and rp.registry.backends["d1"].healthy,
                           "both decoders admitted")
            busy = await _keep_busy(rp, e["d0"], 2, 30)
            e["d0"].faults = Faults(health_delay_ms=2000)
            results = await asyncio.wait_for(asyncio.gather(
                *(ph.stream_completion(rp.session, rp.url, f"q{i}", max_tokens=3)
                  for i in range(6))), 30)
            await asyncio.gather(*busy)
            assert all(r.status == 200 and r.events[-1] == "[DONE]" for r in results), [
                (r.status, r.text) for r in results]
            proxied = [r for r in e["d0"].seen("/v1/completions")
                       if str(r.body.get("prompt", "")).startswith("q")]
            assert proxied, "no request went to d0: nothing tested"
            assert d0.healthy and not d0.ejections, d0.last_error


async def test_frozen_decoder_still_ejected_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """d0 takes requests and answers none, its counters flat (/health and /metrics answer):
    it is still ejected within its budget, as ``wedged_no_progress``, with a log line that
    gives the evidence; its requests go to d1."""
    caplog.set_level(logging.WARNING, logger="pdstack.proxy")
    async with ph.engines("p0", "d0", "d1", output_tokens=3) as e:
        cfg = {"leg_budget_base_s": 30.0, "wedge_after_s": 0.5, "wedge_probe_timeout_s": 0.5,
               "eject_after": 100}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0", "d1"]), **cfg) as rp:
            e["d0"].faults = Faults(hang=True)
            t0 = time.monotonic()
            results = await asyncio.gather(*(
                ph.stream_completion(rp.session, rp.url, f"q{i}", max_tokens=3) for i in range(8)))
            took = time.monotonic() - t0
            text = await rp.metrics()
            assert all(r.status == 200 and r.events[-1] == "[DONE]" for r in results)
            assert e["d0"].seen("/v1/completions"), "no request went to d0: nothing tested"
            assert took < 15.0, f"requests on the frozen decoder waited {took:.1f}s"
            d0 = rp.registry.backends["d0"]
            assert d0.wedged and not d0.healthy
            assert ph.metric_value(text, "pdstack_proxy_ejections_total", backend="d0",
                                   reason="wedged_no_progress") == 1, text
            lines = [r.getMessage() for r in caplog.records
                     if "ejected backend d0" in r.getMessage()]
            assert len(lines) == 1 and "wedged_no_progress" in lines[0], lines
            assert "counters" in lines[0], lines


async def test_refused_prefiller_ejected_as_refused() -> None:
    """A prefiller that is gone (connection refused) is ejected as ``refused``."""
    async with ph.engines("p0", "p1", "d0", output_tokens=2) as e:
        cfg = {"eject_after": 100, "health_interval_s": 60.0, "readmit_interval_s": 0}
        async with ph.running_proxy(ph.pd_table(e, ["p0", "p1"], ["d0"]), **cfg) as rp:
            await e["p0"].kill()
            for i in range(6):
                res = await ph.stream_completion(rp.session, rp.url, f"r{i}", max_tokens=2)
                assert res.status == 200, res.text
            p0 = rp.registry.backends["p0"]
            await ph.until(lambda: not p0.healthy, "p0 ejected")
            text = await rp.metrics()
            assert ph.metric_value(text, "pdstack_proxy_ejections_total", backend="p0",
                                   reason="refused") == 1, text
