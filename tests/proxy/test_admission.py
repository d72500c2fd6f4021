"""KV-aware admission (pdstack.proxy.admission) against FakeEngine test doubles.

The fake engines (pdstack/testing/fake_engine.py, a TEST DOUBLE, no model) export the gauges
admission reads when built with ``kv_capacity_tokens``; a test fills an engine's KV with
``kv_held_tokens`` (KV "held by other requests") and keeps the engine busy with one request
that hangs after its first token (``Faults(hang_after_chunks=1)``), so the engine is not
idle in the proxy's eyes (an idle engine is always open). No timing is asserted beyond
"before / after" orderings of events the test itself causes, and "no scrape happened in
between" (the scrape interval set to an hour after the first).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from pdstack.proxy.admission import (
    AdmissionConfig,
    EngineLoad,
    KvAdmission,
)
from pdstack.proxy.backends import BackendState
from pdstack.proxy.engine_metrics import parse_engine_metrics
from pdstack.proxy.kv_gate import peak_growth
from pdstack.proxy.routing import block_hashes, stable_hash
from pdstack.testing import proxy_harness as ph
from pdstack.testing.fake_engine import FakeEngine, Faults

CAPACITY = 1024  # tokens of KV per fake engine (blocks of one token: it counts tokens)
DATA = Path(__file__).parent / "data"


def admission(**kw: Any) -> AdmissionConfig:
    base: dict[str, Any] = {
        "enabled": True,
        "kv_high": 0.8,
        "scrape_interval_s": 0.05,
        "scrape_idle_interval_s": 0.05,  # these tests fill KV behind the proxy's back
        "stale_after_s": 30.0,  # a loaded 2-core machine may stall the loop for a while
        "queue_timeout_s": 60.0,
    }
    return AdmissionConfig(**{**base, **kw})


def words(n: int, tag: str) -> str:
    """``n`` words of 3 characters + a space: the proxy estimates 4 chars per token and the
    fake engine counts words, so both see ``n`` tokens."""
    return " ".join(f"{tag}{i % 100:02d}" for i in range(n))


@contextlib.asynccontextmanager
async def hanging(
    rp: ph.RunningProxy, engine: FakeEngine, tag: str, **headers: str
) -> AsyncIterator[asyncio.Task[Any]]:
    """One streaming request that gets its first token from ``engine`` and then hangs
    (its KV stays allocated there) until the block ends."""
    seen = len(engine.seen())
    engine.faults = Faults(hang_after_chunks=1, times=1)
    task = asyncio.create_task(
        ph.stream_completion(rp.session, rp.url, words(10, tag), headers=headers, max_tokens=4)
    )
    try:
        await ph.until(lambda: len(engine.seen()) > seen and engine.running > 0, "hanging request")
        yield task
    finally:
        await ph.cancel([task])


def load_of(rp: ph.RunningProxy, name: str) -> Any:
    return rp.proxy.admission.loads.get(name)


async def full(rp: ph.RunningProxy, engine: FakeEngine, name: str) -> None:
    """Fill ``engine``'s KV past 90 % and wait until the proxy has scraped it (after the
    hanging request's first byte: that request is in the scrape's base)."""
    engine.kv_held_tokens = CAPACITY - 64
    await ph.until(
        lambda: (load := load_of(rp, name)) is not None and load.kv_usage >= 0.9 and load.base,
        f"the proxy to see {name} full",
    )


async def post(
    rp: ph.RunningProxy, prompt: str, headers: dict[str, str] | None = None, **extra: Any
) -> tuple[int, CIMultiDict[str], Any]:
    body = {"model": "fake", "prompt": prompt, "max_tokens": 4, **extra}
    async with rp.session.post(
        f"{rp.url}/v1/completions", json=body, headers=headers or {}
    ) as resp:
        return resp.status, CIMultiDict(resp.headers), await resp.json(content_type=None)


def colocated(*names: str, e: dict[str, FakeEngine]) -> dict:
    return ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in names])


# ------------------------------------------------------------------ (a) off


async def test_admission_off_changes_nothing() -> None:
    async with (
        ph.engines("e0", kv_capacity_tokens=CAPACITY, output_tokens=4) as e,
        ph.running_proxy(colocated("e0", e=e)) as rp,
    ):
        assert rp.proxy.config.admission.enabled is False
        async with hanging(rp, e["e0"], "a"):
            e["e0"].kv_held_tokens = CAPACITY  # 100 % full: admission would hold
            status, _, data = await post(rp, words(50, "b"))
            assert status == 200, data
            assert len(data["choices"][0]["text"].split()) == 4
        metrics = await rp.metrics()
    assert rp.proxy.admission.loads == {}  # never scraped
    assert "pdstack_proxy_admission_queued" not in metrics  # no gate state exported
    assert len(e["e0"].seen()) == 2


# ------------------------------------------------------------------ (b) waits, then goes


async def test_request_waits_while_kv_is_full_and_goes_when_it_drops() -> None:
    async with ph.engines("e0", kv_capacity_tokens=CAPACITY, output_tokens=4) as e:
        eng = e["e0"]
        async with ph.running_proxy(colocated("e0", e=e), admission=admission()) as rp:
            async with hanging(rp, eng, "a") as first:
                await full(rp, eng, "e0")
                waiter = asyncio.create_task(
                    ph.stream_completion(rp.session, rp.url, words(50, "b"), max_tokens=4)
                )
                await ph.until(lambda: rp.proxy.admission.queued == 1, "the request to queue")
                await asyncio.sleep(0.3)  # several scrapes: still full, still held
                assert len(eng.seen()) == 1 and not waiter.done()
                assert ph.metric_value(await rp.metrics(), "pdstack_proxy_admission_queued") == 1

                dropped_at = time.time()
                eng.kv_held_tokens = 0
                res = await asyncio.wait_for(waiter, 20)
                assert not first.done(), "the hanging request still holds its KV"
            metrics = await rp.metrics()
    assert res.status == 200, res.text
    assert res.events[-1] == "[DONE]" and len(ph.completion_text(res.events).split()) == 4
    second = eng.seen()[1]
    assert second.body is not None and second.body["prompt"] == words(50, "b")
    assert second.received_at >= dropped_at, "sent before the engine's KV usage dropped"
    assert rp.proxy.admission.queued == 0
    assert ph.metric_value(metrics, "pdstack_proxy_admission_waited_total") == 1


async def test_a_watermark_above_the_kv_lets_the_engine_preempt() -> None:
    """``--admission-kv-high`` above 1 (issue 56, routing run 2: vLLM's preemptions cost
    nothing while the preempted prompts stayed cached): the same full engine that holds the
    request above (mark 0.8) takes it at once at 1.2."""
    async with ph.engines("e0", kv_capacity_tokens=CAPACITY, output_tokens=4) as e:
        eng = e["e0"]
        async with ph.running_proxy(colocated("e0", e=e), admission=admission(kv_high=1.2)) as rp:
            async with hanging(rp, eng, "a"):
                await full(rp, eng, "e0")
                status, _, data = await post(rp, words(50, "b"))
            metrics = await rp.metrics()
    assert status == 200, data
    assert ph.metric_value(metrics, "pdstack_proxy_admission_waited_total") == 0
    assert ph.metric_value(metrics, "pdstack_proxy_admission_admitted_total", reason="fits") >= 1


# ------------------------------------------------------------------ (b2) issue 36: only what hurts

HOUR = 3600.0  # scrape interval after the first scrape: no scrape happens in a test


async def test_a_request_that_fits_goes_at_once_whatever_the_engine_queues() -> None:
    """The engine is busy, its waiting gauge reads 12 (the old gate held at > 2) and its KV
    is a third full: a request that fits goes straight through, never queued."""
    async with ph.engines("e0", kv_capacity_tokens=CAPACITY, output_tokens=4) as e:
        eng = e["e0"]
        eng.num_waiting = 12
        eng.kv_held_tokens = CAPACITY // 3
        async with ph.running_proxy(colocated("e0", e=e), admission=admission()) as rp:
            async with hanging(rp, eng, "a"):
                await ph.until(lambda: load_of(rp, "e0").waiting == 12, "the gauge read")
                status, _, data = await post(rp, words(50, "b"))
            metrics = await rp.metrics()
    assert status == 200, data
    gate = rp.proxy.admission
    assert gate.held == {} and gate.admitted_after_wait == 0
    assert gate.admitted == {"idle": 1, "fits": 1}
    assert ph.metric_value(metrics, "pdstack_proxy_admission_admitted_total", reason="fits") == 1
    assert ph.metric_value(metrics, "pdstack_proxy_engine_requests_waiting", backend="e0") == 12


async def test_a_request_that_would_overfill_kv_waits_for_an_end_not_a_scrape() -> None:
    """Running: 500 prompt tokens + 4 expected; a 400-token request would pass the 0.8
    watermark of 1,024 tokens: it waits (reason ``kv_full``), and goes the moment the
    running one ends, with no scrape in between."""
    async with ph.engines("e0", kv_capacity_tokens=CAPACITY, output_tokens=4) as e:
        eng = e["e0"]
        config = admission(scrape_interval_s=HOUR, scrape_idle_interval_s=HOUR)
        async with ph.running_proxy(colocated("e0", e=e), admission=config) as rp:
            gate = rp.proxy.admission
            seen = len(eng.seen())
            eng.faults = Faults(hang_after_chunks=1, times=1)
            big = asyncio.create_task(
                ph.stream_completion(rp.session, rp.url, words(500, "a"), max_tokens=4)
            )
            await ph.until(lambda: len(eng.seen()) > seen and eng.running > 0, "the big one")
            scraped_at = load_of(rp, "e0").scraped_at
            waiter = asyncio.create_task(post(rp, words(400, "b")))
            await ph.until(lambda: gate.queued == 1, "the request to queue")
            assert gate.held == {"kv_full": 1}
            assert len(eng.seen()) == seen + 1 and not waiter.done()
            ended_at = time.time()
            big.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                await big
            status, _, data = await asyncio.wait_for(waiter, 20)
            assert load_of(rp, "e0").scraped_at == scraped_at, "a scrape happened"
    assert status == 200, data
    assert eng.seen()[-1].received_at >= ended_at
    assert gate.admitted_after_wait == 1


async def test_output_already_streamed_leaves_the_projection() -> None:
    """A running request's KV grows by its output token by token; what it has streamed by a
    scrape is in that scrape's usage, so only the rest of its ``max_tokens`` is still to
    come. Running: 200 prompt tokens, 300 expected, 200 of them streamed (then it stalls,
    its KV held). A 400-token request goes at once: 200 + 100 + 404 <= 819 (the 0.8 mark of
    1,024); counted as if nothing had streamed (200 + 300 + 404) it would wait."""
    async with ph.engines("e0", kv_capacity_tokens=CAPACITY, output_tokens=300) as e:
        eng = e["e0"]
        async with ph.running_proxy(colocated("e0", e=e), admission=admission()) as rp:
            gate = rp.proxy.admission
            eng.faults = Faults(hang_after_chunks=200, times=1)
            running = asyncio.create_task(
                ph.stream_completion(rp.session, rp.url, words(200, "a"), max_tokens=300)
            )
            try:
                await ph.until(
                    lambda: (load := load_of(rp, "e0")) is not None and load.base
                    and load.base_output <= 100, "a scrape after 200 streamed tokens")
                load = load_of(rp, "e0")
                assert load.base_output == 100 and load.projected(True) == pytest.approx(300)
                status, _, data = await asyncio.wait_for(post(rp, words(400, "b")), 20)
                assert status == 200, data
                assert gate.held == {} and gate.admitted_after_wait == 0
            finally:
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await running


@contextlib.asynccontextmanager
async def busy_unscraped() -> AsyncIterator[tuple[ph.RunningProxy, FakeEngine]]:
    """A gated proxy in front of one fake engine that it scrapes once (at its start), with
    one request hanging there (an idle engine is always open): the proxy's own count
    decides every admission."""
    async with ph.engines("e0", kv_capacity_tokens=CAPACITY, output_tokens=2) as e:
        config = admission(scrape_interval_s=HOUR, scrape_idle_interval_s=HOUR)
        async with (
            ph.running_proxy(colocated("e0", e=e), admission=config) as rp,
            hanging(rp, e["e0"], "a"),
        ):
            yield rp, e["e0"]


async def test_a_burst_never_waits_for_a_scrape() -> None:
    """30 requests at once on a busy engine, no scrape after the first: every one that
    fits goes at once (the proxy counts each at admission), the rest go as earlier ones
    end; none waits for a scrape (there is none)."""
    async with busy_unscraped() as (rp, _):
        gate = rp.proxy.admission
        scraped_at = load_of(rp, "e0").scraped_at
        # <= 15 prompt + 2 expected each: 30 x 17 + 14 < 0.8 x 1,024
        results = await asyncio.wait_for(
            asyncio.gather(*(post(rp, words(10, f"b{i}"), max_tokens=2)
                             for i in range(30))),
            60,
        )  # fmt: skip
        assert gate.held == {} and gate.queued == 0
        # past the watermark: 40 x 17 more; the ones over it wait for ends only
        results += await asyncio.wait_for(
            asyncio.gather(*(post(rp, words(10, f"c{i}"), max_tokens=2)
                             for i in range(40))),
            60,
        )  # fmt: skip
        assert load_of(rp, "e0").scraped_at == scraped_at, "a scrape happened"
    assert [r[0] for r in results] == [200] * 70
    assert gate.admitted.get("fits", 0) >= 30


async def test_a_shared_prompt_counts_once_on_an_engine() -> None:
    """16 requests sharing a system prompt all go at once where not one of the same length
    with its own prompt does after them: on one engine the shared prefix's KV counts once
    (vLLM shares its blocks), in the gate's count and in what a new request would add, so
    the gate does not hold what the engine has room for. No scrape after the first: the
    proxy's own count decides."""
    async with busy_unscraped() as (rp, eng):
        gate = rp.proxy.admission
        eng.faults = Faults(hang=True)  # every request stays on the engine
        system = words(150, "s")  # 599 characters: two 256-character blocks
        # ~162 tokens + 4 each; shared: 2 blocks (~128 tokens) once + ~35 + 4 + 1 (the
        # fake's one-token block) each: the hanging one's 14 + 128 + 16 x ~40 = ~784 <=
        # 0.8 x 1,024 (the 16th adds ~40, not ~167)
        shared = [asyncio.create_task(post(rp, f"{system} {words(10, f'u{i}')}"))
                  for i in range(16)]  # fmt: skip
        await ph.until(lambda: len(eng.seen()) == 17, "16 shared-prompt requests sent")
        assert gate.queued == 0 and gate.held == {}
        own = [asyncio.create_task(post(rp, words(160, f"d{i}"))) for i in range(6)]
        await ph.until(lambda: gate.queued == 6, "the unshared ones to wait")
        await asyncio.sleep(0.2)
        assert len(eng.seen()) == 17 and gate.held.get("kv_full", 0) == 1
        await ph.cancel(shared + own)
        eng.faults = Faults()


def test_a_new_request_adds_only_what_the_engine_does_not_hold() -> None:
    """Unit: on an engine near its mark, a request whose system prompt the engine's
    requests hold goes (it adds its own block and output: 35 tokens), one of the same
    length with its own prompt waits (260)."""
    gate, engine = _gate(output_tokens=10, block_chars=100)
    engine.in_flight = 1
    _scraped(gate, 0.0)
    system = "s" * 900
    for rid in "abc":  # 260 + 35 + 35
        gate.expect(rid, 10, *_text(system + rid * 100))  # 1,000 characters, 250 tokens
        gate.reserve(engine, rid, 250)
    gate.reserve(engine, "x", 470)  # no prompt text: 470 + 10
    assert gate.loads["d0"].projected(True) == pytest.approx(810)  # the mark: 850
    gate.expect("d", 10, *_text(system + "d" * 100))
    assert gate.check(engine, 250, 10, None, "d") == (True, "fits")
    gate.expect("e", 10, *_text("e" * 1000))
    assert gate.check(engine, 250, 10, None, "e") == (False, "kv_full")
    assert not gate.is_open(engine, 250), "a request the gate knows nothing of: all of it"

def test_each_request_counts_one_engine_block_beyond_its_tokens() -> None:
    """Unit: vLLM allocates whole blocks and shares a prefix only in whole blocks, so a
    request holds about one block more than its tokens (half for its last block, half for
    its shared prefix's). With the engine's block size read (128, as vLLM's CPU engine),
    each request the proxy sends counts its prompt + output + 128, in the proxy's count,
    in what a new one adds and in what an end frees; an engine whose block size was never
    read counts none. The mark is 0.85 of 1,000 tokens: a 700 + 100 request beside one of
    10 fits on tokens alone (820) and not with its blocks (1,076)."""
    gate, engine = _gate(output_tokens=100)
    engine.in_flight = 1
    load = gate.loads.setdefault("d0", EngineLoad())
    load.rebase(0.0, 1000, time.monotonic())  # no block size read (not a vLLM 0.26 scrape)
    gate.expect("a", 10)
    gate.reserve(engine, "a", 10)
    assert load.total == pytest.approx(20) and load.tail == 0
    assert gate.check(engine, 700, 100) == (True, "fits")
    load.rebase(0.0, 1000, time.monotonic(), block_size=128)
    assert load.tail == 128 and load.total == pytest.approx(148)
    assert load.upper(True) == pytest.approx(148) and load.adds(700, (), 0.0) == 828
    assert gate.check(engine, 700, 100) == (False, "kv_full")
    gate.expect("b", 10)
    gate.reserve(engine, "b", 100)  # 100 + 10 + 128
    assert load.total == pytest.approx(386) and load.fresh == pytest.approx(386)
    gate.release(engine, "b")
    assert load.total == pytest.approx(148) and load.fresh == pytest.approx(148)
    # a scrape that holds "a" (landed): its end frees what the engine read, blocks too
    load.land("a")
    load.rebase(0.138, 1000, time.monotonic() + 0.001)
    assert load.block_size == 128, "a scrape that does not read it keeps the last"
    assert load.base_scale == pytest.approx(1.0)  # 138 read: its prompt, no output, a block
    assert load.projected(True) == pytest.approx(148)  # + its output to come
    assert _gauge(gate, "base_scale") == pytest.approx(1.0)
    gate.release(engine, "a")
    assert load.freed == pytest.approx(138) and load.upper(True) == pytest.approx(0)
    load.rebase(0.0, 1000, time.monotonic() + 0.002)
    assert math.isnan(_gauge(gate, "base_scale")), "no request in the scrape: no scale"


def _gauge(gate: KvAdmission, key: str) -> float:
    """d0's ``pdstack_proxy_engine_<key>`` as the proxy's /metrics would show it."""
    from pdstack.proxy.metrics import _engine_gauges

    family = next(f for f in _engine_gauges(gate) if f.name == f"pdstack_proxy_engine_{key}")
    return next(s.value for s in family.samples if s.labels["backend"] == "d0")


def test_shared_blocks_count_once_and_free_with_their_last_holder() -> None:
    """Unit: three requests with one 900-character system prompt (9 of their 10 blocks):
    the shared blocks count once in the proxy's own count and not at all in a fresh
    request's KV when a scrape already holds them (a landed request's); a block frees
    with the last request that holds it, and counts again when a request takes it back
    (vLLM's cached blocks are free until reused)."""
    gate, engine = _gate(output_tokens=10, block_chars=100)
    engine.in_flight = 1
    load = _scraped(gate, 0.0)
    system = "s" * 900

    def send(rid: str) -> None:
        gate.expect(rid, 10, *_text(system + rid * 100))  # 1,000 characters, 250 tokens: 25 a block
        gate.reserve(engine, rid, 250)

    for rid in "abc":
        send(rid)
    assert load.total == pytest.approx(260 + 35 + 35), "9 shared blocks once, 1 own each"
    gate.landed(engine, "a")
    load.rebase(0.25, 0, time.monotonic() + 1e-3, load.streamed_now())  # a's 250 in KV
    # a's 250 + its 10 to come + b's and c's own block and output (shared: in the scrape)
    assert load.projected(True) == pytest.approx(250 + 10 + 2 * 35)
    gate.release(engine, "a")  # b and c still hold the shared blocks: a frees its own
    assert load.projected(True) == pytest.approx(225 + 2 * 35)
    gate.release(engine, "b")
    gate.release(engine, "c")  # the last holders: the shared blocks free
    assert load.projected(True) == pytest.approx(0) and load.total == pytest.approx(0)
    send("d")  # takes the shared blocks back: they count again, in use
    assert load.projected(True) == pytest.approx(225 + 35)
    gate.forget("d")
    assert load.projected(True) == pytest.approx(0) and load.blocks.keys() <= load.base_blocks


# ------------------------------------------------------------------ (c) 503s


async def test_queue_full_and_deadline_answer_503() -> None:
    async with ph.engines("e0", kv_capacity_tokens=CAPACITY, output_tokens=4) as e:
        eng = e["e0"]
        config = admission(queue_max=1, queue_timeout_s=1.0)
        async with ph.running_proxy(colocated("e0", e=e), admission=config) as rp:
            async with hanging(rp, eng, "a"):
                await full(rp, eng, "e0")
                queued = asyncio.create_task(post(rp, words(50, "b")))
                await ph.until(lambda: rp.proxy.admission.queued == 1, "the first to queue")
                # the queue holds one: the next is refused at once
                status, headers, data = await post(
                    rp, words(50, "c"), headers={"X-Request-Id": "over-the-top"}
                )
                assert status == 503
                assert headers["Retry-After"] == "1"
                assert headers["X-Request-Id"] == "over-the-top"
                assert set(data) == {"error"}
                assert data["error"]["type"] == "server_error"
                assert data["error"]["code"] == 503
                assert "retry later" in data["error"]["message"]
                # the queued one hits its deadline (the engine stays full)
                status, headers, data = await asyncio.wait_for(queued, 30)
                assert status == 503, data
                assert headers["Retry-After"] == "1"
                assert data["error"]["code"] == 503
                assert "within 1 s" in data["error"]["message"]
            metrics = await rp.metrics()
    assert len(eng.seen()) == 1, "a refused request reached the engine"
    name = "pdstack_proxy_admission_rejected_total"
    assert ph.metric_value(metrics, name, reason="queue_full") == 1
    assert ph.metric_value(metrics, name, reason="timeout") == 1
    assert ph.metric_value(metrics, "pdstack_proxy_requests_total", outcome="rejected") == 2


# ------------------------------------------------------------------ (d) headroom routing


async def test_colocated_requests_go_to_the_engine_with_headroom() -> None:
    async with (
        ph.engines("e0", "e1", kv_capacity_tokens=CAPACITY, output_tokens=2) as e,
        ph.running_proxy(colocated("e0", "e1", e=e), admission=admission()) as rp,
    ):
        reg = rp.registry
        await ph.until(lambda: all(b.usable for b in reg.backends.values()), "healthy")
        # one hanging request on each engine (steered by draining the other)
        reg.backends["e1"].drained = True
        async with hanging(rp, e["e0"], "a"):
            reg.backends["e1"].drained, reg.backends["e0"].drained = False, True
            async with hanging(rp, e["e1"], "x"):
                reg.backends["e0"].drained = False
                await full(rp, e["e0"], "e0")
                await ph.until(lambda: load_of(rp, "e1").base, "e1 scraped")
                prompts = [words(20, chr(ord("c") + i)) for i in range(8)]
                ring = rp.proxy._ring_for("colocated")
                prefer_e0 = [p for p in prompts if next(ring.walk(stable_hash(p[:1024]))) == "e0"]
                assert prefer_e0, "no prompt prefers e0 by affinity: the test proves nothing"
                results = await asyncio.gather(*(post(rp, p) for p in prompts))
    assert [r[0] for r in results] == [200] * len(prompts)
    assert len(e["e0"].seen()) == 1, "a request went to the full engine"
    assert len(e["e1"].seen()) == 1 + len(prompts)


# ------------------------------------------------------------------ (e) P/D: gate first


async def test_pd_gate_is_on_decoders_before_the_prefill_leg() -> None:
    async with ph.engines("p0", "d0", kv_capacity_tokens=CAPACITY, output_tokens=4) as e:
        t = ph.table(
            "nixl", [ph.backend("p0", "prefill", e["p0"]), ph.backend("d0", "decode", e["d0"])]
        )
        async with ph.running_proxy(t, admission=admission()) as rp, hanging(rp, e["d0"], "a"):
            assert len(e["p0"].seen()) == 1  # the hanging request's prefill leg
            # a full prefiller does not matter: prefillers hand their KV off
            e["p0"].kv_held_tokens = CAPACITY
            await full(rp, e["d0"], "d0")
            waiter = asyncio.create_task(
                ph.stream_completion(rp.session, rp.url, words(50, "b"), max_tokens=4)
            )
            await ph.until(lambda: rp.proxy.admission.queued == 1, "the request to queue")
            await asyncio.sleep(0.3)
            assert len(e["p0"].seen()) == 1, "prefill leg sent while the decoder was full"
            assert len(e["d0"].seen()) == 1
            dropped_at = time.time()
            e["d0"].kv_held_tokens = 0
            res = await asyncio.wait_for(waiter, 20)
    assert res.status == 200, res.text
    assert len(ph.completion_text(res.events).split()) == 4
    pre, dec = e["p0"].seen()[1], e["d0"].seen()[1]
    assert pre.received_at >= dropped_at
    assert pre.body is not None and pre.body["kv_transfer_params"] == {"do_remote_decode": True}
    assert dec.body is not None and dec.body["kv_transfer_params"]["remote_engine_id"] == "p0"
    assert "p0" not in rp.proxy.admission.loads  # prefillers are not scraped


# ------------------------------------------------------------------ (f) units

# vLLM 0.26.0's exposition, family by family as vllm/v1/metrics/loggers.py of the 0.26.0
# wheel (the GPU build) writes it: one label set per engine index; cache_config_info is
# CacheConfig.metrics_info(), every field of 0.26.0's CacheConfig as a string label, with
# the values of the h200x1 V2-Lite engines (block 64, 10 GiB KV); trimmed to the families
# next to the ones admission reads.
VLLM_026_SAMPLE = (DATA / "vllm_0.26_metrics.prom").read_text()


def test_parse_engine_metrics_vllm_026() -> None:
    values = parse_engine_metrics(VLLM_026_SAMPLE)
    assert values == {
        "running": 23.0,
        "waiting": 4.0,  # not the by-reason family
        "kv_usage": 0.8731,
        "capacity_tokens": 6032 * 64.0,
        "block_size": 64.0,
        "preemptions": 3.0,  # read for the metrics (why the gate holds), not for decisions
    }


def test_parse_engine_metrics_data_parallel_and_garbage() -> None:
    """An API server fronting two data-parallel engines: counts add up, KV usage is the
    fullest engine's (a sum would read 0.7 + 0.6 as 1.3, i.e. "1.3 %")."""
    text = "\n".join(
        [
            'vllm:num_requests_running{engine="0",model_name="m"} 30.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 12.0',
            'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0',
            'vllm:num_requests_waiting{engine="1",model_name="m"} 6.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.7',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6',
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0',
            'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="100"} 1.0',
            'vllm:kv_cache_usage_perc{engine="2"} NaNish',
            "garbage line",
        ]
    )
    values = parse_engine_metrics(text)
    assert values["running"] == 42.0 and values["waiting"] == 10.0
    assert values["kv_usage"] == pytest.approx(0.7)
    assert values["capacity_tokens"] == 1600.0
    assert parse_engine_metrics("") == {}


def _gate(**kw: Any) -> tuple[KvAdmission, BackendState]:
    engine = BackendState(
        name="d0", role="decode", node="n1", url="http://127.0.0.1:9", healthy=True
    )
    block_chars = kw.pop("block_chars", 256)
    config = admission(**{"kv_high": 0.85, "stale_after_s": 2.0, "output_tokens": 50, **kw})
    return KvAdmission(config, lambda: [engine], block_chars=block_chars), engine


def _text(text: str, block_chars: int = 100) -> tuple[list[int], int]:
    """``expect``'s prompt arguments for ``text``: its chain-hashed blocks and length."""
    return block_hashes(text, block_chars), len(text)


def _scraped(gate: KvAdmission, usage: float, capacity: int = 1000) -> EngineLoad:
    """A scrape of d0 that began now and read ``usage``."""
    load = gate.loads.setdefault("d0", EngineLoad())
    load.rebase(usage, capacity, time.monotonic())
    return load


def test_kv_gate_rules() -> None:
    """Prompt + expected output on top of the projection, against the watermark; the
    projection is the proxy's own count, corrected by the scrape."""
    gate, engine = _gate()
    assert gate.check(engine, 10, 50) == (True, "idle")  # never scraped
    load = _scraped(gate, 0.9)
    assert gate.check(engine, 10, 50) == (True, "idle"), "an idle engine is always open"
    engine.in_flight = 1
    assert gate.check(engine, 10, 50) == (False, "kv_full")  # 900 + 60 > 850
    load = _scraped(gate, 0.5)
    assert gate.check(engine, 300, 50) == (True, "fits")  # 500 + 350 <= 850
    gate.expect("r1", 0)  # no max_tokens: output_tokens (50)
    gate.reserve(engine, "r1", 250)  # sent since the scrape: 300 more
    assert load.projected(True) == 800
    assert gate.check(engine, 10, 30) == (True, "fits")  # 800 + 40 <= 850
    assert gate.check(engine, 10, 50) == (False, "kv_full")  # 800 + 60 > 850
    gate.release(engine, "r1")
    assert gate.check(engine, 300, 50) == (True, "fits")
    # the engine's waiting and running gauges never hold a request
    load.waiting, load.running = 40, 500
    assert gate.check(engine, 10, 10)[0]
    # prefillers are never gated (reserve is a no-op for them)
    pre = BackendState(name="p0", role="prefill", node="n1", url="http://x", healthy=True)
    gate.reserve(pre, "r2", 10_000)
    assert "p0" not in gate.loads
    # disabled: always open
    off = KvAdmission(AdmissionConfig(enabled=False), lambda: [engine])
    off.loads["d0"] = _scraped(gate, 1.0)
    assert off.check(engine, 10, 10)[0]


def test_scrape_corrects_the_count_with_prefix_reuse() -> None:
    """Requests whose first byte came before a scrape began are in its KV usage (with
    whatever prefix they share); one of them ending frees its share of that usage, not its
    whole prompt; a request sent since counts in full until the next scrape."""
    gate, engine = _gate(output_tokens=0)
    engine.in_flight = 1
    load = _scraped(gate, 0.0)
    for rid in ("a", "b"):
        gate.reserve(engine, rid, 400)  # one 300-token prefix shared: 500 tokens in KV
        gate.landed(engine, rid)
    assert load.projected(True) == 800, "before a scrape: the proxy's own count"
    load.rebase(0.5, 0, time.monotonic() + 1e-3)  # after both first bytes
    assert load.projected(True) == 500, "the engine's usage replaces the count"
    gate.reserve(engine, "c", 100)
    assert load.projected(True) == 600
    gate.release(engine, "a")
    assert load.projected(True) == 350, "a frees half of the 500 (its share)"
    assert load.projected(False) == 500, "a stale scrape: the proxy's count alone"


def test_running_cap_counts_the_proxys_active_requests() -> None:
    """``max_running``: the proxy's own count of requests active on the engine closes it,
    with or without a fresh scrape; a request that ends (or moves on a retry) frees its
    slot."""
    engine = BackendState(name="d0", role="decode", node="n1", url="http://x", healthy=True)
    other = BackendState(name="d1", role="decode", node="n1", url="http://y", healthy=True)
    gate = KvAdmission(
        admission(max_running=2, stale_after_s=2.0, output_tokens=0), lambda: [engine, other]
    )
    gate.reserve(engine, "r1", 10)
    assert gate.is_open(engine, 10), "one of two slots taken"
    gate.reserve(engine, "r2", 10)
    assert gate.check(engine, 10, 0) == (False, "running_cap")
    # a scrape after both landed (their tokens are in kv_usage now) keeps them active
    gate.landed(engine, "r1")
    gate.landed(engine, "r2")
    _scraped(gate, 0.1).rebase(0.1, 1000, time.monotonic() + 1e-3)
    assert not gate.is_open(engine, 10), "landed requests still run there"
    assert gate.is_open(other, 10)
    gate.reserve(other, "r2", 10)  # r2 retried on d1: its slot on d0 is free again
    assert gate.is_open(engine, 10)
    assert set(gate.loads["d1"].requests) == {"r2"}
    gate.release(engine, "r1")
    gate.forget("r2")
    assert gate.loads["d0"].requests == {} and gate.loads["d1"].requests == {}


async def test_running_cap_holds_the_next_request_until_one_ends() -> None:
    """Through the proxy: with ``max_running`` 1 a second request waits in the proxy
    (not in the engine) while the first runs, and goes once the first has ended."""
    async with ph.engines("e0", kv_capacity_tokens=CAPACITY, output_tokens=4) as e:
        eng = e["e0"]
        async with ph.running_proxy(colocated("e0", e=e), admission=admission(max_running=1)) as rp:
            async with hanging(rp, eng, "a"):
                waiter = asyncio.create_task(post(rp, words(20, "b")))
                await ph.until(lambda: rp.proxy.admission.queued == 1, "the request to queue")
                await asyncio.sleep(0.3)
                assert len(eng.seen()) == 1 and not waiter.done(), "the cap let it through"
                ended_at = time.time()
            status, _, data = await asyncio.wait_for(waiter, 20)
    assert status == 200, data
    assert len(data["choices"][0]["text"].split()) == 4
    assert eng.seen()[1].received_at >= ended_at, "sent while the first still ran"


def test_streamed_tokens_count_from_the_scrape_that_saw_them() -> None:
    """Unit: a base request's output still to come is its expected output less what it had
    streamed when the scrape began; tokens streamed after that scrape are not in its usage,
    so they change nothing until the next one; its end frees what was left."""
    gate, engine = _gate(output_tokens=100)
    engine.in_flight = 1
    load = _scraped(gate, 0.0)
    gate.expect("a", 100)
    gate.reserve(engine, "a", 300)
    gate.landed(engine, "a")
    gate.streamed(engine, "a", 40)
    assert load.projected(False) == 400, "the proxy's own count: prompt + expected output"
    load.rebase(0.25, 0, time.monotonic() + 1e-3, load.streamed_now())  # 250 tokens in KV
    assert load.projected(True) == 250 + 60
    gate.streamed(engine, "a", 50)
    assert load.projected(True) == 250 + 60, "streamed after the scrape: not in its usage yet"
    load.rebase(0.30, 0, time.monotonic() + 1e-3, load.streamed_now())
    assert load.projected(True) == 300 + 10
    gate.streamed(engine, "a", 500)  # never below nothing to come
    load.rebase(0.31, 0, time.monotonic() + 1e-3, load.streamed_now())
    assert load.base_output == 0
    gate.release(engine, "a")
    assert load.base_output == 0 and load.projected(True) == 0


def test_stale_scrape_falls_back_to_the_proxys_count() -> None:
    gate, engine = _gate()
    engine.in_flight = 3
    load = _scraped(gate, 0.99)
    assert not gate.is_open(engine, 10)
    load.scraped_at -= 2.5  # older than stale_after_s: not trusted
    assert gate.is_open(engine, 10), "the proxy has nothing there: open"
    gate.reserve(engine, "big", 900)
    assert not gate.is_open(engine, 10), "the proxy's own count still holds"
    load.capacity_tokens = 0  # capacity unknown: cannot judge
    assert gate.check(engine, 10, 50) == (True, "no_capacity")


async def test_failed_scrape_never_blocks() -> None:
    """A backend whose /metrics cannot be read (connection refused, no vLLM gauges, the
    engine gone) keeps no fresh numbers and stays open, however many requests it has."""
    async with ph.engines("e0") as e:
        fake = e["e0"]  # built without kv_capacity_tokens: no KV gauges yet
        dead = BackendState(
            name="dead",
            role="decode",
            node="n1",
            url="http://127.0.0.1:9",
            healthy=True,
            in_flight=5,
        )
        eng = BackendState(
            name="eng", role="colocated", node="n1", url=fake.url, healthy=True, in_flight=5
        )
        gate = KvAdmission(admission(scrape_timeout_s=2.0), lambda: [dead, eng])
        async with aiohttp.ClientSession() as session:
            gate._session = session
            await gate.scrape_once()
            assert gate.loads["dead"].scraped_at == 0.0
            assert gate.loads["eng"].scraped_at == 0.0
            assert gate.is_open(dead, 10) and gate.is_open(eng, 10)
            # the engine exports the gauges and is full: closed
            fake.kv_capacity_tokens = CAPACITY
            fake.kv_held_tokens = CAPACITY
            await gate.scrape_once()
            assert gate.loads["eng"].kv_usage == 1.0
            assert gate.loads["eng"].capacity_tokens == CAPACITY
            assert not gate.is_open(eng, 10)
            # then its /metrics goes away: the last numbers go stale and it opens again
            await fake.kill()
            gate.loads["eng"].scraped_at -= gate.config.stale_after_s + 1
            await gate.scrape_once()
            assert gate.is_open(eng, 10)


async def test_pd_burst_holds_decoder_headroom_during_prefill() -> None:
    """P/D picks the decoder after the prefill leg; admitted requests hold their tokens
    from admission on, so a burst does not all pass on the same headroom while their
    prefill legs run, and a request cancelled during its prefill gives its hold back."""
    async with ph.engines("p0", "d0", kv_capacity_tokens=CAPACITY, output_tokens=2) as e:
        t = ph.table(
            "nixl", [ph.backend("p0", "prefill", e["p0"]), ph.backend("d0", "decode", e["d0"])]
        )
        async with ph.running_proxy(t, admission=admission()) as rp:
            await ph.until(lambda: all(b.usable for b in rp.registry.backends.values()), "healthy")
            e["p0"].faults = Faults(hang=True)  # prefill legs stay in progress
            # 300 tokens each: two fit under 0.8 x 1024, the third does not
            tags = [chr(ord("a") + i) for i in range(5)]
            burst = {tag: asyncio.create_task(post(rp, words(300, tag))) for tag in tags}
            try:
                await _burst_checks(rp, e, burst, tags)
            finally:
                await ph.cancel(burst.values())
            await ph.until(lambda: not load_of(rp, "d0").requests, "every hold released")
    assert len(e["p0"].seen()) == 5 and len(e["d0"].seen()) == 3


async def _burst_checks(
    rp: ph.RunningProxy,
    e: dict[str, FakeEngine],
    burst: dict[str, asyncio.Task[Any]],
    tags: list[str],
) -> None:
    await ph.until(
        lambda: len(e["p0"].seen()) == 2 and rp.proxy.admission.queued == 3,
        "two prefills in progress and three held in the proxy",
        timeout=10,
    )
    await asyncio.sleep(0.3)
    assert len(e["p0"].seen()) == 2, "the burst overran the decoder's headroom"
    # prompt (estimated from characters) + expected output (max_tokens 4) + 1 for its last
    # block (the fake's blocks: a token), each
    assert load_of(rp, "d0").total == 2 * (len(words(300, "a")) // 4 + 4 + 1)
    # the two in prefill are cancelled by their clients: their holds come back
    # and the three held go (the prefiller answers again)
    e["p0"].faults = Faults()
    first = [r.body["prompt"][0] for r in e["p0"].seen() if r.body]
    for tag in first:
        burst[tag].cancel()
    rest = [burst[tag] for tag in tags if tag not in first]
    results = await asyncio.wait_for(asyncio.gather(*rest), 30)
    assert [r[0] for r in results] == [200, 200, 200], results


def test_admission_flags_new_and_removed() -> None:
    """``--admission-output-tokens`` is a flag; ``--admission-max-waiting`` (the waiting
    gauge the gate no longer reads) is one clear error, not silently ignored."""
    from pdstack.proxy import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(), "proxy", "the proxy")
    args = parser.parse_args(["proxy", "--admission", "kv", "--admission-output-tokens", "64"])
    config = cli.admission_from_args(args)
    assert config.enabled and config.output_tokens == 64 and config.kv_high == 0.97
    assert config.interactive_first, "on by default"
    args = parser.parse_args(["proxy", "--admission-interactive-first", "off"])
    assert not cli.admission_from_args(args).interactive_first
    assert config.kv_learn_max == 0.0, "a fixed watermark by default"
    assert config.preempt_caution_s == 30.0
    for argv, field, value in (
        (["--admission-kv-high", "1.2"], "kv_high", 1.2),
        (["--admission-kv-learn-max", "1.3"], "kv_learn_max", 1.3),
        (["--admission-preempt-caution", "0"], "preempt_caution_s", 0.0),
    ):
        assert getattr(cli.admission_from_args(parser.parse_args(["proxy", *argv])), field) == value
    for argv, error in (
        (["--admission-max-waiting", "2"], "--admission-max-waiting was removed"),
        (["--admission-kv-high", "2.5"], r"--admission-kv-high must be within \[0.05, 2\], got"),
        (["--admission-kv-learn-max", "2.5"], r"--admission-kv-learn-max must be within \[0, 2\]"),
        (["--admission-output-tokens", "-1"], "--admission-output-tokens must be >= 0"),
        (["--admission-preempt-caution", "-1"], r"--admission-preempt-caution must be within"),
    ):
        with pytest.raises(SystemExit, match=error):
            cli.admission_from_args(parser.parse_args(["proxy", *argv]))


def test_a_sent_request_the_engine_scheduled_is_counted_once() -> None:
    """A request sent before a scrape began, with no first byte yet, is in the scrape's KV
    usage unless the engine's waiting queue holds it (the newest ``waiting`` of them) or it
    was sent too recently to be scheduled; a hold that was never sent is not. Counted
    again as fresh, 20 req/s of 2.5 k-token prompts were ~5 % of one H200's KV twice."""
    now = time.monotonic()

    def load_with(waiting: float | None) -> EngineLoad:
        load = EngineLoad(capacity_tokens=1000)
        for rid in ("old", "mid", "held", "new"):
            load.add(rid, 200, 10)
        load.send("old")
        load.send("mid")
        load.send("new")
        load.requests["old"].sent_at = now - 2.0
        load.requests["mid"].sent_at = now - 1.0  # "new": just now
        load.rebase(0.5, 0, now, {}, waiting)  # the engine holds 500 tokens
        return load

    # not read: every request without a first byte is fresh (500 + 4 x 210)
    assert load_with(None).projected(True) == 500 + 4 * 210
    # nothing waits: old and mid are in the 500 (their output still to come is not)
    load = load_with(0.0)
    assert set(load.base) == {"old", "mid"}
    assert load.projected(True) == 500 + 2 * 10 + 2 * 210
    # one waits: the newest sent of them (mid) holds no KV yet
    assert set(load_with(1.0).base) == {"old"}
    assert load_with(5.0).base == {}
    # a scheduled request that ends gives back what the scrape counted of it
    load.drop("old")
    assert load.projected(True) < 500 + 10 + 2 * 210


async def test_a_request_in_prefill_is_not_counted_twice_by_the_gate() -> None:
    """The fake engine counts a request's prompt in its KV usage once it serves it, first
    byte or not (as vLLM does once it schedules it). A 300-token request hangs before its
    first byte; a scrape after it counts it in the usage, so a second 300-token request
    fits under 0.8 x 1,024 and goes at once (counted again on top: 300 + 304 + 304 > 819,
    held). When the engine reports a waiting request, the newest sent one is not in the
    usage, and the same request would be held."""
    async with ph.engines("e0", kv_capacity_tokens=CAPACITY, output_tokens=4) as e:
        eng = e["e0"]
        async with ph.running_proxy(colocated("e0", e=e), admission=admission(),
                                    wedge_after_s=0.0) as rp:
            eng.ttft_ms = 30_000  # served, no first byte: in prefill
            first = asyncio.create_task(post(rp, words(300, "a")))
            try:
                await ph.until(lambda: eng.running == 1, "the first request in prefill")
                eng.ttft_ms = 0
                gate = rp.proxy.admission
                mark = time.monotonic() + 0.15  # a scrape begun 0.1 s after it was sent
                await ph.until(lambda: (load := load_of(rp, "e0")) is not None
                               and load.scraped_at > mark, "a scrape after it was sent")
                second = asyncio.create_task(post(rp, words(300, "b")))
                await ph.until(lambda: len(eng.seen()) == 2 or gate.queued == 1, "decided")
                assert gate.held == {}, gate.held  # counted twice: {'kv_full': 1}
                status, _, data = await asyncio.wait_for(second, 10)
                assert status == 200, data
                eng.num_waiting = 1  # the engine says one request waits: the newest sent
                await ph.until(lambda: not load_of(rp, "e0").base, "a scrape that sees it")
                assert not rp.proxy.admission.is_open(rp.registry.backends["e0"], 300)
            finally:
                first.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await first


def test_peak_growth_counts_the_frees_of_requests_that_end_first() -> None:
    """The output trajectory: every request grows a token a step until its output is out,
    then frees its KV; the peak is what the gate adds on top of what they hold now."""
    assert peak_growth([], []) == 0
    assert peak_growth([10, 10], [0.0, 0.0]) == 20, "no ends before the peak: the sum"
    assert peak_growth([10, 10], [500.0, 500.0]) == 20, "ties end together, after growing"
    # one ends 2 tokens from now and frees 500: the other's 100 tokens never reach that
    assert peak_growth([2, 100], [500.0, 600.0]) == 4
    assert peak_growth([2, 100], [50.0, 600.0]) == 2 + 100 - 50
    # a new request (frees nothing: it may wait in the engine) joins at its own length
    assert peak_growth([2, 100], [500.0, 600.0], extra=50) == 6
    assert peak_growth([2, 100], [0.0, 0.0], extra=50) == 2 + 50 + 100


def _two_running(
    ids: tuple[str, str], streamed: int, usage: float, **kw: Any
) -> tuple[KvAdmission, BackendState, EngineLoad]:
    """d0 (output_tokens 100) runs two 300-token requests that landed, the first of them
    ``streamed`` tokens into its answer, read by a scrape (``usage``) that began after."""
    gate, engine = _gate(output_tokens=100, **kw)
    engine.in_flight = 1
    load = _scraped(gate, 0.0)
    for rid in ids:
        gate.reserve(engine, rid, 300)
        gate.landed(engine, rid)
    gate.streamed(engine, ids[0], streamed)
    load.rebase(usage, 0, time.monotonic() + 1e-3, load.streamed_now())
    return gate, engine, load


def test_a_request_goes_when_the_requests_ending_first_free_room_for_it() -> None:
    """A request that ends a few tokens from now frees its prompt before the others' output
    fills KV: the gate lets a request go that counting every output at once would hold
    (run 4: the gate held at a measured peak of 0.92 with ~77 requests of 3.5 k-token
    prompts and 100-160-token answers); with the ends far away it still holds, and a
    request with no first byte yet frees nothing in the projection."""
    gate, engine, load = _two_running(("a", "b"), 95, 0.695)  # a: 5 tokens from its end
    # a ends at t=5 and frees 400 (its 300 + 100): b's 100 and the new one's 100 tokens
    # never reach that, so the peak is at t=5: 3 requests x 5 tokens
    assert load.projected(True, 100) == pytest.approx(695 + 3 * 5)
    assert gate.check(engine, 50, 100, request_id="c") == (True, "fits")  # 760 <= 850
    # counting every output at once: 695 + 105 + 150 = 950 > 850 (the gate before)
    assert load.base_output + 695 + 150 > 850
    # the ends far away: both just started (0 streamed): 600 + 300 + 50 > 850
    load.rebase(0.6, 0, time.monotonic() + 2e-3, dict.fromkeys(("a", "b"), 0))
    assert gate.check(engine, 50, 100, request_id="c") == (False, "kv_full")
    # a request sent, no first byte yet: its end frees nothing in the projection (it may
    # wait in the engine's queue and end later than modelled); once it runs, it does
    gate.expect("q", 5)
    gate.reserve(engine, "q", 100)
    before = load.projected(True, 100)
    gate.landed(engine, "q")
    assert load.projected(True, 100) < before


def test_a_request_past_its_expected_output_frees_nothing_on_the_path() -> None:
    """A request that streamed all its expected output (no max_tokens: the gate's cap) and
    has not ended may run on for long: its end is not known, so the path does not count its
    KV as freed (it would let the gate fill KV that the request still holds)."""
    # long streamed its whole expected output and has not ended
    gate, engine, load = _two_running(("long", "b"), 100, 0.7)
    # long frees nothing: b's 100 + the new one's 100 on top of the 700 held
    assert load.projected(True, 100) == pytest.approx(700 + 200)
    assert gate.check(engine, 50, 100, request_id="c") == (False, "kv_full")  # 950 > 850
    gate.release(engine, "long")  # it ended: what it held is free
    assert gate.check(engine, 50, 100, request_id="c") == (True, "fits")


def test_after_a_preemption_the_gate_counts_every_output_at_once() -> None:
    """The output path credits the requests ending first; an engine that preempted anyway
    shows it was optimistic there (one H100 near its knee: 168-453 preemptions on the
    path, 0 counting every output at once). For ``preempt_caution_s`` after the counter
    rises, a request that fits only on the path waits (``kv_preempting``); then the path
    decides again. The counter's first read is a base, and a lower count (a restart) is
    no preemption."""
    gate, engine, load = _two_running(("a", "b"), 95, 0.695)  # a: 5 tokens from its end
    gate.config.preempt_caution_s = 30.0
    assert gate.check(engine, 50, 100, request_id="c") == (True, "fits")  # on the path
    now = time.monotonic()
    load.saw_preemptions(7, now)  # the first read: a base, not a preemption
    assert gate.check(engine, 50, 100, request_id="c") == (True, "fits")
    load.saw_preemptions(9, now)
    assert gate.check(engine, 50, 100, request_id="c") == (False, "kv_preempting")
    assert gate.check(engine, 10, 10, request_id="d") == (True, "fits"), "fits either way"
    gate.config.preempt_caution_s = 0.0  # off: the path always
    assert gate.check(engine, 50, 100, request_id="c") == (True, "fits")
    gate.config.preempt_caution_s = 30.0
    load.preempted_at = now - 31.0  # the window passed
    assert gate.check(engine, 50, 100, request_id="c") == (True, "fits")
    load.saw_preemptions(2, now)  # the engine restarted: its counter starts again
    assert gate.check(engine, 50, 100, request_id="c") == (True, "fits")
    load.saw_preemptions(3, now)
    assert gate.check(engine, 50, 100, request_id="c") == (False, "kv_preempting")


async def test_the_gate_reads_preemptions_from_the_engine_and_shows_its_caution() -> None:
    """The scrape reads vLLM's ``vllm:num_preemptions_total``; a rise puts the engine in
    caution, which ``pdstack_proxy_engine_preempt_caution`` shows (1) until it passes."""
    async with ph.engines("e0", kv_capacity_tokens=CAPACITY, output_tokens=4) as e:
        eng = e["e0"]
        eng.num_preemptions = 4  # from before the proxy started: not a preemption now
        config = admission(preempt_caution_s=HOUR)
        async with (
            ph.running_proxy(colocated("e0", e=e), admission=config) as rp,
            hanging(rp, eng, "a"),
        ):
            await ph.until(
                lambda: (load := load_of(rp, "e0")) is not None and load.preemptions == 4,
                "the counter read",
            )
            metrics = await rp.metrics()
            assert ph.metric_value(
                metrics, "pdstack_proxy_engine_preempt_caution", backend="e0"
            ) == 0
            eng.num_preemptions = 6
            await ph.until(lambda: load_of(rp, "e0").preemptions == 6, "the rise read")
            metrics = await rp.metrics()
    assert ph.metric_value(metrics, "pdstack_proxy_engine_preempt_caution", backend="e0") == 1
    assert ph.metric_value(metrics, "pdstack_proxy_engine_preemptions", backend="e0") == 6


def _first_bytes(gate: KvAdmission, engine: BackendState, n: int, seconds: float) -> None:
    """``n`` short requests on d0, each with its first byte ``seconds`` after its send."""
    load = gate.loads["d0"]
    for i in range(n):
        rid = f"fb{seconds}-{i}"
        gate.reserve(engine, rid, 1)
        load.requests[rid].sent_at = time.monotonic() - seconds
        gate.landed(engine, rid)
        gate.release(engine, rid)


def test_a_learned_mark_lets_through_what_the_floor_holds_and_falls_back() -> None:
    """``kv_learn_max``: while the engine's own first bytes are fast and the mark holds
    requests, the mark rises (up to the ceiling) and lets through what the floor held; slow
    first bytes bring it back, and the floor holds again. The gauges show the mark and the
    engine's time to first byte."""
    gate, engine, _ = _two_running(("a", "b"), 0, 0.6, kv_learn_max=1.2)  # just started
    assert gate.check(engine, 50, 100, request_id="c") == (False, "kv_full")  # 950 > 850
    mark = gate.marks["d0"]
    assert mark.value == 0.85 and mark.ceiling == 1.2
    _first_bytes(gate, engine, 60, 0.05)  # fast (under 0.25 x the 2 s SLO): +0.12
    assert gate.check(engine, 50, 100, request_id="c") == (True, "fits")  # 950 <= 970
    assert math.isclose(_gauge(gate, "kv_mark"), 0.97)
    assert math.isclose(_gauge(gate, "first_byte_seconds"), 0.05, abs_tol=0.005)
    _first_bytes(gate, engine, 40, 2.0)  # slow (over 0.5 x the SLO): down to the floor
    assert mark.at_floor and mark.first_byte_s > 1.0
    assert gate.check(engine, 50, 100, request_id="c") == (False, "kv_full")
    mark.bound_at -= 3.0  # its last hold was 3 s ago: the mark does not bind
    _first_bytes(gate, engine, 200, 0.05)
    assert mark.at_floor, "an unbound mark does not rise"


def test_above_its_floor_a_learned_mark_skips_the_preemption_caution() -> None:
    """The caution (``kv_preempting``) holds at the floor only: a mark that fast first
    bytes raised has shown the engine's preemptions cheap; back at the floor it holds."""
    gate, engine, load = _two_running(("a", "b"), 95, 0.695, kv_learn_max=1.2)
    gate.config.preempt_caution_s = 30.0
    now = time.monotonic()
    load.saw_preemptions(1, now)
    load.saw_preemptions(5, now)
    # on the path 760 <= 850; every output at once 950 > 850 (see the caution's test)
    assert gate.check(engine, 50, 100, request_id="c") == (False, "kv_preempting")
    _first_bytes(gate, engine, 10, 0.05)  # the caution's hold bound the mark: +0.02
    assert math.isclose(gate.marks["d0"].value, 0.87)
    assert gate.check(engine, 50, 100, request_id="c") == (True, "fits")  # 950 > 870 still
    _first_bytes(gate, engine, 10, 2.0)
    assert gate.check(engine, 50, 100, request_id="c") == (False, "kv_preempting")
