"""Self-healing against FakeEngine test doubles: a wedged engine (accepts requests, /health
passes, never answers) is found, ejected and kept out until it generates again; a slow one
is not; with no usable prefiller the decoders serve whole requests (decode fallback)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from pdstack.testing import proxy_harness as ph
from pdstack.testing.fake_engine import Faults


async def test_wedged_decoder_found_ejected_and_readmitted_only_when_it_generates(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """d0 takes every request and answers none while /health says 200: the requests on it
    are re-routed to d1 within the wedge budget (not after the 30 s leg budget), d0 stays
    out while /health alone passes, and comes back once a generation answers again."""
    caplog.set_level(logging.WARNING, logger="pdstack.proxy")
    async with ph.engines("p0", "d0", "d1", output_tokens=3) as e:
        cfg = {
            "leg_budget_base_s": 30.0,
            "wedge_after_s": 0.5,
            "wedge_probe_timeout_s": 0.5,
            "eject_after": 100,
        }
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0", "d1"]), **cfg) as rp:
            e["d0"].faults = Faults(hang=True)  # health_status stays 200
            t0 = time.monotonic()
            results = await asyncio.gather(
                *(ph.stream_completion(rp.session, rp.url, f"q{i}", max_tokens=3) for i in range(8))
            )
            took = time.monotonic() - t0
            d0 = rp.registry.backends["d0"]
            assert all(r.status == 200 and r.events[-1] == "[DONE]" for r in results), [
                r.text for r in results
            ]
            assert e["d0"].seen("/v1/completions"), "no request went to d0: nothing tested"
            assert took < 15.0, f"requests on the wedged decoder waited {took:.1f}s"
            assert d0.wedged and not d0.healthy and d0.state == "ejected"
            text = await rp.metrics()
            assert ph.metric_value(text, "pdstack_proxy_wedged_total", backend="d0") == 1
            assert ph.metric_value(text, "pdstack_proxy_backend_wedged", backend="d0") == 1
            assert ph.metric_value(text, "pdstack_proxy_wedged_total", backend="d1") == 0
            assert any("wedged backend d0" in r.getMessage() for r in caplog.records)
            # /health passes all along, and still no re-admission: ten rounds later it is out
            await asyncio.sleep(10 * 0.2 + 0.5)
            assert not d0.healthy and d0.wedged
            # it generates again: re-admitted, the gauge drops
            e["d0"].faults = Faults()
            await ph.until(lambda: d0.healthy, "d0 re-admitted", timeout=10)
            assert not d0.wedged
            text = await rp.metrics()
            assert ph.metric_value(text, "pdstack_proxy_backend_wedged", backend="d0") == 0
            assert any(
                "d0" in r.getMessage() and "progress again" in r.getMessage()
                for r in caplog.records
            )


async def test_decoder_stalled_mid_stream_is_found_wedged_and_its_stream_ended(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """d0 streams one token and then stops (an engine core stopped mid-generation) while its
    /health says 200: no leg waits for a first byte (the one on d0 already got it) and a
    router balancing by load sends it nothing new, so only the stalled stream shows it.
    The proxy flags d0 wedged within the wedge budget and ends that stream with an error
    event, instead of after the 60 s stream idle timeout."""
    caplog.set_level(logging.WARNING, logger="pdstack.proxy")
    async with ph.engines("p0", "d0", output_tokens=5) as e:
        cfg = {"wedge_after_s": 0.5, "wedge_probe_timeout_s": 0.5, "eject_after": 100,
               "stream_idle_timeout_s": 60.0}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), **cfg) as rp:
            e["d0"].faults = Faults(hang_after_chunks=1)  # the probe hangs too
            t0 = time.monotonic()
            res = await asyncio.wait_for(
                ph.stream_completion(rp.session, rp.url, "stalls", max_tokens=5), 20)
            took = time.monotonic() - t0
            d0 = rp.registry.backends["d0"]
            text = await rp.metrics()
            assert res.status == 200 and res.events, res.text
            errors = [ev for ev in res.events if '"error"' in ev]
            assert len(errors) == 1 and "d0 failed mid-stream" in errors[0], res.events
            assert took < 6.0, f"the stalled stream ended after {took:.1f}s"
            assert d0.wedged and not d0.healthy
            assert not d0.streaming, "an ended stream is still counted on d0"
            assert ph.metric_value(text, "pdstack_proxy_wedged_total", backend="d0") == 1
            assert any("wedged backend d0" in r.getMessage() for r in caplog.records)


async def test_ejected_decoder_with_silent_streams_has_them_ended(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """d0's host is lost mid-stream (its stream stops after one token, /health fails): the
    health check ejects it and its silent stream ends with an error event within a few
    probes, not after the 60 s stream idle timeout. The wedge detector cannot be what ends
    it here: its 1-token probe would wait 30 s."""
    caplog.set_level(logging.WARNING, logger="pdstack.proxy")
    async with ph.engines("p0", "d0", output_tokens=5) as e:
        cfg = {"wedge_after_s": 1.0, "wedge_probe_timeout_s": 30.0, "health_interval_s": 0.2,
               "eject_after": 1, "stream_idle_timeout_s": 60.0}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), **cfg) as rp:
            e["d0"].faults = Faults(hang_after_chunks=1, health_status=503)
            t0 = time.monotonic()
            res = await asyncio.wait_for(
                ph.stream_completion(rp.session, rp.url, "host lost", max_tokens=5), 20)
            took = time.monotonic() - t0
            d0 = rp.registry.backends["d0"]
            assert res.status == 200 and res.events, res.text
            errors = [ev for ev in res.events if '"error"' in ev]
            assert len(errors) == 1 and "d0 failed mid-stream" in errors[0], res.events
            assert took < 5.0, f"the stream of the lost decoder ended after {took:.1f}s"
            assert not d0.healthy and not d0.streaming
            assert any("ending 1 stream(s) of ejected backend d0" in r.getMessage()
                       for r in caplog.records)


async def test_ejected_decoder_keeps_streams_that_still_flow() -> None:
    """/health fails while d0's stream still sends a token every 0.3 s: d0 takes no new
    requests, and the stream it is sending is not cut (a failing probe is no evidence that
    a flowing stream is dead)."""
    async with ph.engines("p0", "d0", output_tokens=12, itl_ms=300) as e:
        cfg = {"wedge_after_s": 1.0, "health_interval_s": 0.2, "eject_after": 1,
               "stream_idle_timeout_s": 60.0}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), **cfg) as rp:
            d0 = rp.registry.backends["d0"]
            await ph.until(lambda: d0.healthy, "d0 admitted", timeout=10)
            task = asyncio.create_task(
                ph.stream_completion(rp.session, rp.url, "flows", max_tokens=12))
            await ph.until(lambda: bool(d0.streaming), "d0 streams", timeout=10)
            e["d0"].faults = Faults(health_status=503)
            await ph.until(lambda: not d0.healthy, "d0 ejected", timeout=10)
            res = await asyncio.wait_for(task, 20)
            assert res.status == 200 and res.events[-1] == "[DONE]", res.events
            assert not [ev for ev in res.events if '"error"' in ev], res.events


async def test_slow_engine_is_suspected_but_not_wedged() -> None:
    """One request far slower than the wedge budget, alone on its decoder: the 1-token probe
    answers, so nothing is ejected and the request is served."""
    async with ph.engines("p0", "d0", output_tokens=2) as e:
        cfg = {"wedge_after_s": 0.3, "wedge_probe_timeout_s": 3.0, "leg_budget_base_s": 30.0}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), **cfg) as rp:
            e["d0"].faults = Faults(delay_ms=2000, times=1)  # this request only
            res = await ph.stream_completion(rp.session, rp.url, "slow", max_tokens=2)
            text = await rp.metrics()
            assert res.status == 200 and res.events[-1] == "[DONE]", res.text
            assert rp.registry.backends["d0"].healthy
            # the probe ran (the suspicion was real) and answered
            probes = [r for r in e["d0"].seen("/v1/completions") if r.body.get("prompt") == "ping"]
            assert probes, "the slow leg never made d0 a suspect"
            assert ph.metric_value(text, "pdstack_proxy_wedged_total", backend="d0") == 0
            assert ph.metric_value(text, "pdstack_proxy_ejections_total", backend="d0") == 0


async def test_no_prefiller_decoders_serve_whole_requests_then_pd_again() -> None:
    """The only prefiller dies: every request is served by a decoder (the whole prompt, no
    kv_transfer_params), /health stays 200; it comes back: two legs again."""
    async with (
        ph.engines("p0", "d0", "d1", output_tokens=3) as e,
        ph.running_proxy(ph.pd_table(e, ["p0"], ["d0", "d1"])) as rp,
    ):
        await e["p0"].kill()
        p0 = rp.registry.backends["p0"]
        await ph.until(lambda: not p0.healthy, "p0 ejected")
        results = [
            await ph.stream_completion(rp.session, rp.url, f"whole {i}", max_tokens=3)
            for i in range(6)
        ]
        assert all(r.status == 200 and r.events[-1] == "[DONE]" for r in results)
        assert all(len(ph.completion_text(r.events).split()) == 3 for r in results)
        decoded = [*e["d0"].seen("/v1/completions"), *e["d1"].seen("/v1/completions")]
        assert len(decoded) == 6
        assert all("kv_transfer_params" not in r.body and r.body.get("stream") for r in decoded)
        assert {r.body["prompt"] for r in decoded} == {f"whole {i}" for i in range(6)}
        async with rp.session.get(rp.url + "/health") as resp:
            assert resp.status == 200 and (await resp.json())["status"] == "degraded"
        text = await rp.metrics()
        assert ph.metric_value(text, "pdstack_proxy_decode_fallback_total") == 6
        assert (
            ph.metric_value(text, "pdstack_proxy_ttft_seconds_count", route="decode_fallback") == 6
        )
        # the prefiller is back: P/D again
        await e["p0"].start()
        await ph.until(lambda: p0.healthy, "p0 re-admitted")
        res = await ph.stream_completion(rp.session, rp.url, "two legs", max_tokens=3)
        assert res.status == 200
        assert [r.body["max_tokens"] for r in e["p0"].seen("/v1/completions")] == [1]
        text = await rp.metrics()
        assert ph.metric_value(text, "pdstack_proxy_decode_fallback_total") == 6


async def test_prefill_failing_on_every_try_falls_back_to_a_decoder() -> None:
    """The prefiller answers 503 and its /health confirms it: it is ejected during the
    request, which a decoder then serves whole instead of a 502."""
    faults = {"p0": Faults(status=503, health_status=503)}
    res, text, e = await ph.pd_stream(faults, "hello", output_tokens=2, eject_after=100)
    assert res.status == 200 and res.events[-1] == "[DONE]", res.text
    assert len(e["p0"].seen("/v1/completions")) == 1
    assert [r.body["prompt"] for r in e["d0"].seen("/v1/completions")] == ["hello"]
    assert ph.metric_value(text, "pdstack_proxy_decode_fallback_total") == 1
    assert ph.metric_value(text, "pdstack_proxy_requests_total", outcome="ok") == 1


async def test_prefiller_crash_mid_prefill_costs_no_request() -> None:
    """The only prefiller crashes while a prefill leg waits on it, and before the proxy has
    ejected it (its health checks are far apart here): the request in flight (connection
    cut) and those sent right after (connection refused) are served whole by a decoder,
    never a 502 "prefill failed on every try" while decoders are up (issue 38, item 3)."""
    async with (
        ph.engines("p0", "d0", "d1", output_tokens=2) as e,
        ph.running_proxy(
            ph.pd_table(e, ["p0"], ["d0", "d1"]), health_interval_s=30.0, eject_after=100
        ) as rp,
    ):
        e["p0"].faults = Faults(delay_ms=3000)
        in_flight = asyncio.create_task(
            ph.stream_completion(rp.session, rp.url, "in flight", max_tokens=2))
        await ph.until(lambda: bool(e["p0"].seen("/v1/completions")), "the prefill leg sent")
        await e["p0"].kill()
        after = [ph.stream_completion(rp.session, rp.url, f"after {i}", max_tokens=2)
                 for i in range(3)]
        results = [await asyncio.wait_for(in_flight, 10), *await asyncio.gather(*after)]
        text = await rp.metrics()
    assert all(r.status == 200 and r.events[-1] == "[DONE]" for r in results), [
        (r.status, r.text) for r in results]
    decoded = [*e["d0"].seen("/v1/completions"), *e["d1"].seen("/v1/completions")]
    assert sorted(r.body["prompt"] for r in decoded) == ["after 0", "after 1", "after 2",
                                                         "in flight"]
    assert all("kv_transfer_params" not in r.body for r in decoded)
    assert ph.metric_value(text, "pdstack_proxy_decode_fallback_total") == 4
    assert ph.metric_value(text, "pdstack_proxy_requests_total", outcome="ok") == 4


async def test_unreachable_decoder_ejected_at_a_failed_probe_and_its_legs_rerouted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """d0's link is lost while requests wait on it (no byte ever comes back, its /health
    never answers): once a leg has waited past the wedge budget, the first /health probe
    that cannot reach d0 ejects it and its requests go to d1, not after ``eject_after``
    failed probes or the wedge probe's timeout (issue 38, item 5: the two-node lab's cut KV
    pull waited 12 s for three probes)."""
    caplog.set_level(logging.WARNING, logger="pdstack.proxy")
    async with ph.engines("p0", "d0", "d1", output_tokens=3) as e:
        cfg = {"leg_budget_base_s": 10.0, "wedge_after_s": 0.5, "wedge_probe_timeout_s": 10.0,
               "eject_after": 100}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0", "d1"]), **cfg) as rp:
            e["d0"].faults = Faults(hang=True, health_hang=True)
            t0 = time.monotonic()
            results = await asyncio.gather(
                *(ph.stream_completion(rp.session, rp.url, f"q{i}", max_tokens=3) for i in range(6))
            )
            took = time.monotonic() - t0
            assert all(r.status == 200 and r.events[-1] == "[DONE]" for r in results), [
                r.text for r in results
            ]
            assert e["d0"].seen("/v1/completions"), "no request went to d0: nothing tested"
            assert took < 4.0, f"requests on the unreachable decoder waited {took:.1f}s"
            d0 = rp.registry.backends["d0"]
            assert not d0.healthy and not d0.wedged  # not the wedge probe's doing
            assert any("ejected backend d0" in r.getMessage() and "unreachable: /health timed"
                       in r.getMessage() for r in caplog.records)
            text = await rp.metrics()
            assert ph.metric_value(text, "pdstack_proxy_ejections_total", backend="d0",
                                   reason="unreachable") == 1, text


async def test_the_probe_that_reaches_eject_after_ejects_as_unreachable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """d0's /health timed out once before anything waited on it (a starved host before its
    link went: the two-node lab's flake of stop 47), then a leg waits on d0 past the wedge
    budget: the next probe that cannot reach d0 is both the ``eject_after``-th failure and
    the unreachable rule's; it ejects d0 as unreachable (the diagnosis an operator reads),
    and d0's legs go to d1."""
    caplog.set_level(logging.WARNING, logger="pdstack.proxy")
    async with ph.engines("p0", "d0", "d1", output_tokens=3) as e:
        cfg = {"health_interval_s": 60.0, "health_timeout_s": 0.3, "leg_budget_base_s": 10.0,
               "wedge_after_s": 0.3, "wedge_probe_timeout_s": 10.0, "eject_after": 2}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0", "d1"]), **cfg) as rp:
            d0 = rp.registry.backends["d0"]
            await ph.until(lambda: d0.healthy and rp.registry.backends["d1"].healthy,
                           "both decoders admitted")
            e["d0"].faults = Faults(hang=True, health_hang=True)
            assert not await rp.proxy.probe(d0)  # the first failure: nothing waits on d0
            assert d0.healthy and d0.probe_failures == 1
            sent = [asyncio.create_task(
                ph.stream_completion(rp.session, rp.url, f"q{i}", max_tokens=3))
                for i in range(6)]
            await ph.until(lambda: d0.pending.oldest() is not None, "a leg waiting on d0")
            await asyncio.sleep(0.5)  # past the wedge budget
            assert not await rp.proxy.probe(d0)
            results = await asyncio.wait_for(asyncio.gather(*sent), 10)
            assert all(r.status == 200 and r.events[-1] == "[DONE]" for r in results), [
                r.text for r in results]
            assert not d0.healthy and not d0.wedged
            ejected = [r.getMessage() for r in caplog.records
                       if "ejected backend d0" in r.getMessage()]
            assert len(ejected) == 1 and "unreachable: /health timed out" in ejected[0], ejected


async def test_sole_decoder_with_unreachable_health_keeps_its_legs() -> None:
    """d0's /health cannot be reached but it still answers, late (a first token after 1.5 s,
    past the wedge budget): with no other decoder, its leg is not cut for a re-route that
    could go nowhere; the request is answered."""
    async with ph.engines("p0", "d0", output_tokens=3) as e:
        cfg = {"leg_budget_base_s": 10.0, "wedge_after_s": 0.5, "wedge_probe_timeout_s": 10.0,
               "eject_after": 100}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), **cfg) as rp:
            await ph.until(lambda: rp.registry.backends["d0"].healthy, "d0 admitted")
            e["d0"].faults = Faults(delay_ms=1500, health_hang=True)
            res = await ph.stream_completion(rp.session, rp.url, "slow", max_tokens=3)
            assert res.status == 200 and res.events[-1] == "[DONE]", res.text
            assert not res.error_events
            text = await rp.metrics()
        assert ph.metric_value(text, "pdstack_proxy_retries_total", leg="decode") == 0


async def test_unreachable_health_alone_ejects_nothing() -> None:
    """d0's /health never answers, and no request waits on d0: the probes that cannot reach
    it eject it only by the health budget (``eject_after``), not at once."""
    async with ph.engines("p0", "d0", "d1", output_tokens=2) as e:
        cfg = {"wedge_after_s": 0.3, "eject_after": 100}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0", "d1"]), **cfg) as rp:
            d0 = rp.registry.backends["d0"]
            await ph.until(lambda: d0.healthy, "d0 admitted")
            e["d0"].faults = Faults(health_hang=True)
            await ph.until(lambda: d0.probe_failures >= 3, "three failed probes", timeout=10)
            assert d0.healthy and not d0.ejections
