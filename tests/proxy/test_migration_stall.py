"""A frozen engine's streams move within about a second; a slow engine's stay (issue 55 with
issue 54's "slow is not dead": :mod:`pdstack.proxy.migration_stall`). FakeEngine test
doubles: ``hang_after_chunks`` stalls a stream; ``health_hang`` makes ``/health`` and
``/metrics`` unanswered (a frozen process); ``health_delay_ms`` a slow ``/health`` (a busy
API server); a large ``itl_ms`` a busy engine's long steps."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from pdstack.proxy import migration_stall
from pdstack.testing import proxy_harness as ph
from pdstack.testing.fake_engine import Faults

TOKENS = 8
PROMPTS = [f"frozen engine stream {i}" for i in range(4)]
STALL = {"stall_probe_after_s": 0.3, "stall_probe_timeout_s": 0.5}


async def _unbroken(prompts: list[str]) -> list[str]:
    async with (
        ph.engines("ref", output_tokens=TOKENS) as e,
        ph.running_proxy(ph.table("colocated", [ph.backend("ref", "colocated", e["ref"])])) as rp,
    ):
        results = await asyncio.gather(*(
            ph.stream_completion(rp.session, rp.url, p, max_tokens=TOKENS) for p in prompts))
    return [ph.completion_text(r.events) for r in results]


async def _streams_on_c0(rp: ph.RunningProxy, prompts: list[str], **extra: Any) -> list[
        asyncio.Task[ph.StreamResult]]:
    """``prompts`` streamed, all routed to c0 (c1 drained until each leg is on c0)."""
    assert await rp.backend_action("c1", "drain") == 200
    c0 = rp.registry.backends["c0"]
    tasks = [asyncio.create_task(ph.stream_completion(rp.session, rp.url, p, max_tokens=TOKENS,
                                                      stream_options={"include_usage": True},
                                                      **extra)) for p in prompts]
    await ph.until(lambda: len(c0.streaming) == len(prompts), "every stream on c0")
    assert await rp.backend_action("c1", "undrain") == 200
    return tasks


async def test_frozen_engine_streams_move_within_the_probe_budget() -> None:
    """c0 stalls every stream after 4 tokens and then answers nothing, not even /health (a
    SIGSTOPped engine): each stream moves to c1 within stall_probe_after + timeout (+ the
    next engine's first token), reason ``frozen``, equal to an unbroken run; not after the
    wedge confirmation (5 s + its budget) nor the stream idle timeout (60 s)."""
    reference = await _unbroken(PROMPTS)
    async with ph.engines("c0", "c1", output_tokens=TOKENS, itl_ms=20) as e:
        t = ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in ("c0", "c1")])
        async with ph.running_proxy(t, eject_after=100, **STALL) as rp:
            await ph.until(lambda: all(b.healthy for b in rp.registry.backends.values()),
                           "both engines in")
            e["c0"].faults = Faults(hang_after_chunks=4)
            tasks = await _streams_on_c0(rp, PROMPTS)
            e["c0"].faults.health_hang = True  # frozen: nothing answers any more
            t0 = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            took = time.monotonic() - t0
            text = await rp.metrics()
    for res, expected in zip(results, reference, strict=True):
        assert res.status == 200 and res.events[-1] == "[DONE]" and not res.error_events, res.text
        assert ph.completion_text(res.events) == expected
    n = len(PROMPTS)
    assert ph.metric_value(text, "pdstack_proxy_migrations_total", reason="frozen",
                           outcome="continued") == n
    gaps = ph.metric_value(text, "pdstack_proxy_migration_gap_seconds_sum") / n
    budget = STALL["stall_probe_after_s"] + STALL["stall_probe_timeout_s"] + 0.7
    assert gaps <= budget, f"mean gap {gaps:.2f}s > {budget:.2f}s"
    assert took <= budget + 1.0, f"the streams took {took:.1f}s after the freeze"


async def test_slow_engine_that_answers_its_probe_keeps_its_streams() -> None:
    """c0 is busy: a token every 1.2 s (four times stall_probe_after) and a /health that
    answers 0.2 s late (a busy API server): its streams are probed again and again, never
    moved or cut, and c0 is never ejected nor counted against; every stream completes
    on c0."""
    calls: list[str] = []
    real = migration_stall.health_answers

    async def counted(session: Any, url: str, timeout_s: float) -> str:
        error = await real(session, url, timeout_s)
        calls.append(error)
        return error

    async with ph.engines("c0", "c1", output_tokens=3, itl_ms=1200) as e:
        e["c0"].faults = Faults(health_delay_ms=200)
        t = ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in ("c0", "c1")])
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(migration_stall, "health_answers", counted)
            async with ph.running_proxy(t, eject_after=1, health_timeout_s=1.0, **STALL) as rp:
                await ph.until(lambda: all(b.healthy for b in rp.registry.backends.values()),
                               "both engines in")
                tasks = await _streams_on_c0(rp, PROMPTS[:2])
                results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
                c0 = rp.registry.backends["c0"]
                text = await rp.metrics()
    for res in results:
        assert res.status == 200 and res.events[-1] == "[DONE]" and not res.error_events, res.text
        assert len(ph.completion_text(res.events).split()) == 3
    assert calls and not any(calls), calls  # probed while it stalled; it always answered
    assert ph.metric_value(text, "pdstack_proxy_migrations_total") == 0
    assert ph.metric_value(text, "pdstack_proxy_ejections_total") == 0
    assert c0.healthy and c0.consecutive_failures == 0
    assert len([r for r in e["c1"].seen() if r.path.startswith("/v1/")]) == 0


async def test_probe_slower_than_its_budget_moves_the_stream_but_never_ejects() -> None:
    """c0's stream stalls and its /health answers 0.8 s late (past the 0.5 s stall budget,
    within the health budget): the stream moves (a hedge), but the stall is no evidence
    against c0: not counted, not ejected (its full-budget /health answers)."""
    reference = await _unbroken(PROMPTS[:1])
    async with ph.engines("c0", "c1", output_tokens=TOKENS, itl_ms=20) as e:
        t = ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in ("c0", "c1")])
        async with ph.running_proxy(t, eject_after=1, health_timeout_s=2.0, **STALL) as rp:
            await ph.until(lambda: all(b.healthy for b in rp.registry.backends.values()),
                           "both engines in")
            e["c0"].faults = Faults(hang_after_chunks=4, health_delay_ms=800)
            (task,) = await _streams_on_c0(rp, PROMPTS[:1])
            res = await asyncio.wait_for(task, 10)
            await asyncio.sleep(2.5)  # the suspicion's full /health probe answers meanwhile
            c0 = rp.registry.backends["c0"]
            text = await rp.metrics()
    assert res.status == 200 and not res.error_events, res.text
    assert ph.completion_text(res.events) == reference[0]
    assert ph.metric_value(text, "pdstack_proxy_migrations_total", reason="frozen",
                           outcome="continued") == 1
    assert ph.metric_value(text, "pdstack_proxy_ejections_total") == 0
    assert c0.healthy and c0.consecutive_failures == 0


async def test_frozen_engine_with_nowhere_to_go_keeps_the_stream() -> None:
    """The only engine freezes mid-stream: nothing to migrate to, so the stall probe cuts
    nothing; the stream ends at the stream idle timeout (the error event), as before."""
    async with ph.engines("c0", output_tokens=TOKENS, itl_ms=20) as e:
        t = ph.table("colocated", [ph.backend("c0", "colocated", e["c0"])])
        async with ph.running_proxy(t, eject_after=100, stream_idle_timeout_s=1.5,
                                    **STALL) as rp:
            await ph.until(lambda: rp.registry.backends["c0"].healthy, "c0 in")
            e["c0"].faults = Faults(hang_after_chunks=4)
            task = asyncio.create_task(ph.stream_completion(rp.session, rp.url, "alone",
                                                            max_tokens=TOKENS))
            await ph.until(lambda: bool(rp.registry.backends["c0"].streaming), "streaming")
            e["c0"].faults.health_hang = True
            res = await asyncio.wait_for(task, 10)
            text = await rp.metrics()
    assert res.status == 200 and len(res.error_events) == 1
    assert "no data for 1.5s" in res.error_events[0]["message"]
    assert ph.metric_value(text, "pdstack_proxy_migrations_total", reason="frozen") == 0
