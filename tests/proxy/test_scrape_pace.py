"""How often KV-aware admission reads the engines' /metrics (pdstack.proxy.scrape_pace).

A scrape costs a vLLM engine loop time (benchmarks/metrics_scrape_cost.py), so the gate reads
an engine at the idle interval while it is far below its watermark and nobody waits, and at
the fast interval near the mark or while requests are held. The fake engines (TEST DOUBLES,
pdstack/testing/fake_engine.py) count their /metrics reads. The idle interval is an hour, so
"idle" means no read at all within the window; the fast one is 50 ms, and the fast regime is
asserted as "several reads in a second" (a loaded 2-core machine only slows the ticks).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import pytest

from pdstack.proxy.admission import AdmissionConfig
from pdstack.proxy.kv_gate import EngineLoad
from pdstack.proxy.scrape_pace import NEAR, ScrapePace, near_mark
from pdstack.testing import proxy_harness as ph
from pdstack.testing.fake_engine import FakeEngine, Faults

CAPACITY = 1024
KV_HIGH = 0.8
HOUR = 3600.0
WINDOW_S = 1.0


def gate_config(**kw: Any) -> AdmissionConfig:
    base: dict[str, Any] = {
        "enabled": True,
        "kv_high": KV_HIGH,
        "scrape_interval_s": 0.05,
        "scrape_idle_interval_s": HOUR,
        "stale_after_s": 30.0,
        "output_tokens": 4,
        "scrape_timeout_s": 10.0,  # a loaded 2-core machine: the first read must not fail
    }
    return AdmissionConfig(**{**base, **kw})


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i % 100:02d}" for i in range(n))


async def first_read(rp: ph.RunningProxy) -> None:
    """The start's read is in: the engine's capacity is known (unknown reads fast)."""
    loads = rp.proxy.admission.loads
    await ph.until(lambda: "e0" in loads and loads["e0"].capacity_tokens > 0, "the first read")


async def reads_in_window(engine: FakeEngine) -> int:
    before = engine.metrics_reads
    await asyncio.sleep(WINDOW_S)
    return engine.metrics_reads - before


def test_near_mark_from_either_view() -> None:
    load = EngineLoad(capacity_tokens=CAPACITY)
    mark = KV_HIGH * CAPACITY
    assert not near_mark(load, KV_HIGH)
    load.add("a", int(NEAR * mark) - 10, 0)  # the proxy's own sum just under
    assert not near_mark(load, KV_HIGH)
    load.add("b", 20, 0)
    assert near_mark(load, KV_HIGH), "the proxy's own sum at NEAR of the mark"
    load.drop("a"), load.drop("b")
    load.rebase(0.9, CAPACITY, started=1.0)  # a scrape saw the KV full (foreign traffic)
    assert near_mark(load, KV_HIGH), "the last scrape's view"
    assert near_mark(EngineLoad(), KV_HIGH), "capacity unknown: read fast"


def test_pace_due_by_regime() -> None:
    pace = ScrapePace(fast_s=0.25, idle_s=2.0)
    idle, busy = EngineLoad(capacity_tokens=CAPACITY), EngineLoad(capacity_tokens=CAPACITY)
    busy.add("r", CAPACITY, 0)
    assert pace.tick_s == 0.25
    assert pace.due("e", idle, KV_HIGH, held=False, now=10.0), "never read: due"
    pace.tried["e"] = 10.0
    assert not pace.due("e", idle, KV_HIGH, held=False, now=11.0)
    assert pace.due("e", idle, KV_HIGH, held=False, now=12.0)
    assert pace.due("e", idle, KV_HIGH, held=True, now=10.3), "requests held: fast"
    assert pace.due("e", busy, KV_HIGH, held=False, now=10.3), "near the mark: fast"
    assert not pace.due("e", busy, KV_HIGH, held=False, now=10.1)


async def test_idle_engine_is_not_scraped_at_the_fast_interval() -> None:
    """Far below the mark, nobody held: after the start's read, none within the window
    (the old gate: one every scrape_interval_s, ~20 here), even with small requests
    running."""
    async with ph.engines("e0", kv_capacity_tokens=CAPACITY, output_tokens=4) as e:
        table = ph.table("colocated", [ph.backend("e0", "colocated", e["e0"])])
        async with ph.running_proxy(table, admission=gate_config()) as rp:
            await first_read(rp)
            assert await reads_in_window(e["e0"]) == 0
            status = await ph.stream_completion(rp.session, rp.url, words(20, "a"), max_tokens=4)
            assert status.status == 200
            assert await reads_in_window(e["e0"]) == 0


async def test_near_the_mark_the_engine_is_scraped_fast() -> None:
    """A request of over half the watermark in flight: read every scrape_interval_s; it
    ends: back to the idle interval."""
    async with ph.engines("e0", kv_capacity_tokens=CAPACITY, output_tokens=4) as e:
        eng = e["e0"]
        table = ph.table("colocated", [ph.backend("e0", "colocated", eng)])
        async with ph.running_proxy(table, admission=gate_config()) as rp:
            await first_read(rp)
            eng.faults = Faults(hang_after_chunks=1, times=1)
            big = asyncio.create_task(
                ph.stream_completion(rp.session, rp.url, words(500, "b"), max_tokens=4)
            )
            await ph.until(lambda: eng.running > 0, "the big request running")
            assert await reads_in_window(eng) >= 4
            big.cancel()
            await asyncio.gather(big, return_exceptions=True)
            await ph.until(
                lambda: not rp.proxy.admission.loads["e0"].requests and eng.running == 0,
                "it ended, in the proxy and in the engine",
            )
            # a read between the two ends saw the engine still full (no request of the
            # proxy's to free it): the next fast read sees it empty, then none
            await asyncio.sleep(0.3)
            assert await reads_in_window(eng) == 0


async def test_held_requests_make_the_scrape_fast() -> None:
    """A request held at the running cap: every engine is read at the fast interval."""
    config = gate_config(max_running=1, fairness=False)
    async with ph.engines("e0", kv_capacity_tokens=CAPACITY, output_tokens=4) as e:
        eng = e["e0"]
        table = ph.table("colocated", [ph.backend("e0", "colocated", eng)])
        async with ph.running_proxy(table, admission=config) as rp:
            await first_read(rp)
            eng.faults = Faults(hang_after_chunks=1, times=1)
            first = asyncio.create_task(
                ph.stream_completion(rp.session, rp.url, words(10, "a"), max_tokens=4)
            )
            await ph.until(lambda: eng.running > 0, "the first request running")
            second = asyncio.create_task(
                ph.stream_completion(rp.session, rp.url, words(10, "c"), max_tokens=4)
            )
            await ph.until(lambda: rp.proxy.admission.queued == 1, "the second held")
            assert await reads_in_window(eng) >= 4
            first.cancel()
            results = await asyncio.gather(first, second, return_exceptions=True)
            assert results[1].status == 200, results


def test_scrape_idle_interval_flag_and_its_bounds() -> None:
    from pdstack.proxy import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(), "proxy", "the proxy")
    args = parser.parse_args(["proxy", "--admission", "kv"])
    assert cli.admission_from_args(args).scrape_idle_interval_s == 2.0
    args = parser.parse_args(["proxy", "--admission-scrape-idle-interval", "5"])
    assert cli.admission_from_args(args).scrape_idle_interval_s == 5.0
    args = parser.parse_args(["proxy", "--admission-scrape-idle-interval", "0"])
    with pytest.raises(SystemExit, match="--admission-scrape-idle-interval must be within"):
        cli.admission_from_args(args)
