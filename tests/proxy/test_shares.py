"""Tenants' shares of the engines (pdstack.proxy.shares, issue 37) against the FakeEngine
test double (pdstack/testing/fake_engine.py, no model), and the units behind them.

Fair out of the box: with no ``pdstack_tenants`` and two keys in ``PDSTACK_API_KEYS``, one
key floods and the other's TTFT P99 stays within 1.5x of its own alone, never a 503.
Timing budgets are ratios of whole service times (800 ms per request), far above a loaded
2-core machine's scheduling noise.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import pytest

from pdstack.proxy import shares
from pdstack.proxy.admission import AdmissionConfig, KvAdmission
from pdstack.proxy.fair_queue import FairQueue, Waiter
from pdstack.proxy.routing import block_hashes
from pdstack.proxy.shares import TenantLedger
from pdstack.proxy.tenants import TenantPolicy, TenantState, digest
from pdstack.testing import proxy_harness as ph
from pdstack.testing.fake_engine import Faults

TTFT_MS = 800.0
CAPACITY = 16  # requests the fake engine serves at once (and the proxy's running cap)
CAPACITY_RPS = CAPACITY / (TTFT_MS / 1000)  # 20 req/s of one-token answers
QUIET, LOUD = "sk-quiet-key", "sk-loud-key"


def table(engine: Any) -> dict[str, Any]:
    return ph.table("colocated", [ph.backend("n1/engine-0", "colocated", engine)])


# ------------------------------------------------------------------ units
def test_shares_bind_only_while_another_tenant_is_active() -> None:
    ledger = TenantLedger(lambda tenant, delta: None)
    ledger.seen("a", 1.0)
    for i in range(8):
        ledger.start(f"a{i}", "a", 0.0, 1000)
    assert not ledger.over_share("a", 1000, running_cap=8, prefill_cap=4000), "alone: all"
    ledger.seen("b", 3.0)  # b active, weight 3: a's share is 1/4
    assert ledger.shares() == {"a": 0.25, "b": 0.75}
    assert ledger.over_share("a", 1000, running_cap=8, prefill_cap=0)  # 9 > 2 running
    assert not ledger.over_share("b", 1000, running_cap=8, prefill_cap=4000)
    # prefill: a has 8,000 tokens with no first byte, its share of 4,000 is 1,000
    assert ledger.over_share("a", 10, running_cap=0, prefill_cap=4000)
    for i in range(8):
        assert ledger.landed(f"a{i}")
    assert ledger.prefill["a"] == 0 and not ledger.landed("a0")  # counted once
    assert not ledger.over_share("a", 10, running_cap=0, prefill_cap=4000)
    # one long prompt may always go when the tenant has nothing in prefill
    assert not ledger.over_share("a", 50_000, running_cap=0, prefill_cap=4000)
    for i in range(8):
        assert ledger.end(f"a{i}")
    assert ledger.count == {} and ledger.prefill == {} and ledger.engine_seconds["a"] > 0


def test_shares_forget_tenants_gone_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = TenantLedger(lambda tenant, delta: None)
    ledger.seen("a", 1.0)
    ledger.seen("b", 1.0)
    ledger.start("a1", "a", 0.0, 10)
    monkeypatch.setattr(shares, "ACTIVE_WINDOW_S", 0.0)
    time.sleep(0.01)
    assert ledger.shares() == {"a": 1.0}, "b went quiet; a still runs a request"


def test_a_prompt_without_first_byte_counts_as_prefilled_after_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A non-streaming answer's first byte is its last: its prompt leaves the prefill
    count after PREFILL_MAX_S, so a batch tenant's unary requests still use their share."""
    ledger = TenantLedger(lambda tenant, delta: None)
    ledger.seen("a", 1.0)
    ledger.seen("b", 1.0)
    ledger.start("a1", "a", 0.0, 3000, holds_lower=False)
    assert ledger.over_share("a", 2000, running_cap=0, prefill_cap=8000)  # 5000 > 4000
    monkeypatch.setattr(shares, "PREFILL_MAX_S", 0.0)
    time.sleep(0.01)
    assert not ledger.over_share("a", 2000, running_cap=0, prefill_cap=8000)
    assert ledger.prefill["a"] == 0 and ledger.count["a"] == 1
    assert ledger.end("a1") and ledger.count == {}


def test_a_streaming_prompt_counts_until_its_first_byte_however_long_it_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A streaming answer's prefill ends at its first byte. Counted only PREFILL_MAX_S,
    a flood's prompts that waited longer in the engine's queue left the count and the
    share let more in: the engine's waiting queue held 16-52 requests and chat waited
    behind them (isolation run 6). It leaves at its first byte, or after
    PREFILL_STREAM_MAX_S (a first byte lost)."""
    ledger = TenantLedger(lambda tenant, delta: None)
    ledger.seen("a", 1.0)
    ledger.seen("b", 1.0)
    ledger.start("a1", "a", 0.0, 3000)  # streaming (holds_lower)
    monkeypatch.setattr(shares, "PREFILL_MAX_S", 0.0)
    time.sleep(0.01)
    assert ledger.over_share("a", 2000, running_cap=0, prefill_cap=8000), "still in prefill"
    assert ledger.prefill["a"] == 3000
    assert ledger.landed("a1")
    assert not ledger.over_share("a", 2000, running_cap=0, prefill_cap=8000)
    ledger.start("a2", "a", 0.0, 3000)
    monkeypatch.setattr(shares, "PREFILL_STREAM_MAX_S", 0.0)
    time.sleep(0.01)
    assert not ledger.over_share("a", 2000, running_cap=0, prefill_cap=8000), "lost: it left"
    assert ledger.prefill["a"] == 0 and ledger.count["a"] == 2


def _waiter(state: TenantState) -> Waiter:
    loop = asyncio.new_event_loop()
    try:
        return Waiter(lambda: [], 10, loop.create_future(), tenant=state)
    finally:
        loop.close()


def test_a_full_queue_sheds_the_heaviest_tenant() -> None:
    loud = TenantState(TenantPolicy("loud"), "loud", 60.0)
    quiet = TenantState(TenantPolicy("quiet"), "quiet", 60.0)
    q = FairQueue(fair=True)
    flood = [_waiter(loud) for _ in range(5)]
    for w in flood:
        q.push(w)
    assert q.victim_for("quiet", 0, 1.0) is flood[-1], "the flood's newest makes room"
    assert q.victim_for("loud", 0, 1.0) is None, "the flood itself is refused"
    q.push(_waiter(quiet))
    heavy = TenantPolicy("quiet", weight=10.0)  # 2 waiters / 10 < 5 / 1
    assert q.victim_for("quiet", heavy.rank, heavy.weight) is flood[-1]


# ------------------------------------------------------------------ fair out of the box
async def _drive(rp: ph.RunningProxy, key: str, rate: float, seconds: float,
                 ttfts: list[float], statuses: list[int], retry: list[str]) -> None:
    """Open loop of one-token streamed requests with ``key``; TTFT of the 200s."""

    async def one(n: int) -> None:
        started = time.perf_counter()
        body = {"model": "fake", "prompt": f"{key[3:7]} {n}", "max_tokens": 1, "stream": True}
        async with rp.session.post(f"{rp.url}/v1/completions", json=body,
                                   headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status == 200:
                await r.content.readany()
                ttfts.append(time.perf_counter() - started)
            elif "Retry-After" in r.headers:
                retry.append(r.headers["Retry-After"])
            await r.read()
            statuses.append(r.status)

    await ph.open_loop(rate, seconds, one)


async def test_two_plain_keys_one_floods_the_other_keeps_its_ttft() -> None:
    """No pdstack_tenants: each key of PDSTACK_API_KEYS is its own tenant. The loud key
    floods at 10x capacity; the quiet key's P99 stays within 1.5x of alone, never a 503;
    the loud key gets 429 + Retry-After once the queue is full (its newest is shed)."""
    async with ph.engines("e0", ttft_ms=TTFT_MS, output_tokens=1, max_running=CAPACITY) as e:
        cfg = {
            "api_keys": frozenset({QUIET, LOUD}),
            "admission": AdmissionConfig(enabled=True, max_running=CAPACITY, queue_max=64),
        }
        async with ph.running_proxy(table(e["e0"]), **cfg) as rp:
            alone: list[float] = []
            q_status: list[int] = []
            await _drive(rp, QUIET, 4.0, 2.5, alone, q_status, [])
            l_status: list[int] = []
            l_retry: list[str] = []
            flood = asyncio.create_task(
                _drive(rp, LOUD, 10 * CAPACITY_RPS, 4.0, [], l_status, l_retry)
            )
            await asyncio.sleep(1.0 + TTFT_MS / 1000)  # the flood holds its share + a queue
            crowded: list[float] = []
            await _drive(rp, QUIET, 4.0, 2.5, crowded, q_status, [])
            await flood
            metrics = await rp.metrics()
    p_alone, p_crowded = ph.p99(alone), ph.p99(crowded)
    print(f"plain keys: quiet P99 alone {p_alone * 1000:.0f} ms, loud flooding "
          f"{p_crowded * 1000:.0f} ms ({p_crowded / p_alone:.2f}x); loud 429s "
          f"{l_status.count(429)}/{len(l_status)}")
    assert set(q_status) == {200}, "a quiet request was refused"
    assert p_crowded <= 1.5 * p_alone
    assert l_status.count(429) > len(l_status) / 2 and 503 not in l_status
    assert len(l_retry) == l_status.count(429)
    loud = "key-" + digest(LOUD)[:10]
    assert ph.metric_value(metrics, "pdstack_proxy_tenant_engine_seconds_total", tenant=loud) > 0


# ------------------------------------------------------------------ shares of the engine
async def test_a_flood_runs_at_its_share_while_another_is_active_and_alone_takes_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Running cap 8, two tenants of weight 1: while the quiet one has a request running
    the flood runs at most 4; once the quiet one has gone quiet, the flood takes all 8."""
    monkeypatch.setattr(shares, "ACTIVE_WINDOW_S", 0.5)
    async with ph.engines("e0", output_tokens=4) as e:
        eng = e["e0"]
        cfg = {"api_keys": frozenset({QUIET, LOUD}),
               "admission": AdmissionConfig(enabled=True, max_running=8)}
        async with ph.running_proxy(table(eng), **cfg) as rp:
            eng.faults = Faults(hang_after_chunks=1, times=20)
            quiet = asyncio.create_task(_one(rp, QUIET))
            await ph.until(lambda: eng.running == 1, "the quiet request running")
            flood = [asyncio.create_task(_one(rp, LOUD)) for _ in range(12)]
            try:
                await ph.until(lambda: eng.running == 5 and rp.proxy.admission.queued == 8,
                               "4 of the flood running, 8 held")
                await asyncio.sleep(0.3)
                assert eng.running == 5, "the flood ran past its share"
                held = rp.proxy.admission.held  # the first at its share, the rest behind it
                assert held.get("tenant_share") and sum(held.values()) == 8, held
                quiet.cancel()  # the quiet tenant goes quiet: the flood is alone
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await quiet
                await ph.until(lambda: eng.running == 8, "the flood takes the engine",
                               timeout=10)
            finally:
                await ph.cancel(flood)


async def test_a_flood_that_waits_long_for_its_first_byte_keeps_to_its_prefill_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prefill budget 2,000 tokens, two active tenants: the flood may have one ~1.8 k-token
    prompt in prefill. Its first byte takes 3 s (an engine busy with long prefills); long
    past PREFILL_MAX_S (the non-streaming limit) its next prompts still wait in the proxy,
    not in the engine's queue where chat would wait behind them (isolation run 6)."""
    monkeypatch.setattr(shares, "PREFILL_MAX_S", 0.1)
    async with ph.engines("e0", ttft_ms=3000, output_tokens=1) as e:
        eng = e["e0"]
        cfg = {"api_keys": frozenset({QUIET, LOUD}),
               "admission": AdmissionConfig(enabled=True, prefill_tokens=2000)}
        async with ph.running_proxy(table(eng), **cfg) as rp:
            tasks = [asyncio.create_task(_one(rp, QUIET))]  # the quiet tenant is active
            await ph.until(lambda: len(eng.seen()) == 1, "the quiet request sent")
            tasks += [
                asyncio.create_task(
                    _one(rp, LOUD, prompt=" ".join(f"f{n}w{i:03d}" for i in range(1000))))
                for n in range(6)
            ]
            try:
                await ph.until(lambda: len(eng.seen()) == 2, "the flood's first prompt sent")
                await asyncio.sleep(0.8)  # 8x PREFILL_MAX_S, before its first byte
                assert len(eng.seen()) == 2, "the flood's prompts went on to the engine"
                assert rp.proxy.admission.held.get("tenant_share"), rp.proxy.admission.held
            finally:
                await ph.cancel(tasks)


async def _one(
    rp: ph.RunningProxy, key: str, prompt: str = "hello there", **headers: str
) -> tuple[int, Any]:
    body = {"model": "fake", "prompt": prompt, "max_tokens": 4, "stream": True}
    async with rp.session.post(f"{rp.url}/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {key}", **headers}) as r:
        return r.status, r.headers.copy() if r.status != 200 else await r.read()


async def test_a_batch_tenant_that_waits_too_long_gets_429_never_5xx() -> None:
    """Running cap 1, two requests of other tenants hang on the engine: a batch tenant's
    request waits its queue timeout out and is answered 429 with Retry-After."""
    async with ph.engines("e0", output_tokens=4) as e:
        eng = e["e0"]
        cfg = {"tenants": {"nightly": TenantPolicy("nightly", priority="batch")},
               "tenant_keys": {digest("sk-nightly"): "nightly"},
               "api_keys": frozenset({QUIET, LOUD}),
               "admission": AdmissionConfig(enabled=True, max_running=1, queue_timeout_s=0.5)}
        async with ph.running_proxy(table(eng), **cfg) as rp:
            eng.faults = Faults(hang_after_chunks=1, times=2)
            hung = [asyncio.create_task(_one(rp, k)) for k in (QUIET, LOUD)]
            try:
                await ph.until(lambda: eng.running == 2, "two requests running")
                status, headers = await _one(rp, "sk-nightly")
            finally:
                await ph.cancel(hung)
    assert status == 429 and int(headers["Retry-After"]) >= 1


async def _timed(rp: ph.RunningProxy, key: str) -> tuple[int, Any, float]:
    """One request: its status, headers (or body) and seconds to the answer's headers."""
    t0 = time.monotonic()
    status, rest = await _one(rp, key)
    return status, rest, time.monotonic() - t0


async def _warm_up(rp: ph.RunningProxy, key: str, n: int = 6) -> None:
    """``n`` requests one after another: the gate learns the engine's first-byte rate."""
    for _ in range(n):
        assert (await _one(rp, key))[0] == 200


async def test_a_batch_flood_past_its_budget_gets_429_at_once_and_chat_still_goes() -> None:
    """Running cap 1, 0.3 s a request (~3 first bytes a second): after a warm-up a batch
    tenant sends 20 at once with a 2 s budget (its queue deadline). From about its 6th
    waiter on, a request would wait past 2 s: 429 (``queue_wait``) at arrival, with
    Retry-After, never a 5xx. An interactive request arriving during the flood is ahead of
    every batch waiter: predicted well inside its budget, served."""
    async with ph.engines("e0", output_tokens=1, ttft_ms=300) as e:
        eng = e["e0"]
        cfg = {"tenants": {"nightly": TenantPolicy("nightly", priority="batch")},
               "tenant_keys": {digest("sk-nightly"): "nightly"},
               "api_keys": frozenset({QUIET}),
               "admission": AdmissionConfig(enabled=True, max_running=1, queue_timeout_s=2.0)}
        async with ph.running_proxy(table(eng), **cfg) as rp:
            gate = rp.proxy.admission
            await _warm_up(rp, "sk-nightly")
            assert 2.0 < gate.budget.rate() < 4.5, gate.budget.rate()
            flood = [asyncio.create_task(_timed(rp, "sk-nightly")) for _ in range(20)]
            await ph.until(lambda: gate.queued >= 3, "three waiting")
            quiet = asyncio.create_task(_timed(rp, QUIET))
            results = await asyncio.wait_for(asyncio.gather(quiet, *flood), 30)
            metrics = await rp.metrics()
    assert results[0][0] == 200, "the interactive tenant's: served"
    statuses = [status for status, _, _ in results[1:]]
    assert set(statuses) <= {200, 429} and 5 <= statuses.count(429) <= 17, statuses
    refused = [(h, s) for status, h, s in results if status == 429]
    assert all(int(h["Retry-After"]) >= 1 for h, _ in refused)
    assert max(s for _, s in refused) < 0.25, "refused at arrival, not after a wait"
    rejected = ph.metric_value(metrics, "pdstack_proxy_admission_rejected_total",
                               reason="queue_wait")
    assert rejected == statuses.count(429), "refused for the budget, not by the deadline"


# one key alone, running cap 1, a 3 s TTFT SLO (2.25 s on the prediction)
ALONE_SLO3 = {"api_keys": frozenset({QUIET}),
              "admission": AdmissionConfig(enabled=True, max_running=1, queue_timeout_s=30.0,
                                           ttft_slo_s=3.0)}


async def test_alone_past_capacity_most_are_refused_at_once_and_the_rest_meet_the_slo() -> None:
    """The same engine, one key alone, a 3 s TTFT SLO (2.25 s on the prediction):
    20 requests at once after a warm-up. The server is what is overloaded: 503 at arrival
    (Retry-After) for those predicted past the budget; the ones admitted get their first
    byte within the SLO, and the gate's predictions of them are calibrated (actual /
    predicted between 0.5 and 2 on average)."""
    async with ph.engines("e0", output_tokens=1, ttft_ms=300) as e:
        eng = e["e0"]
        async with ph.running_proxy(table(eng), **ALONE_SLO3) as rp:
            await _warm_up(rp, QUIET)
            before = await rp.metrics()
            flood = [asyncio.create_task(_timed(rp, QUIET)) for _ in range(20)]
            results = await asyncio.wait_for(asyncio.gather(*flood), 30)
            metrics = await rp.metrics()
    assert ph.metric_value(before, "pdstack_proxy_admission_rejected_total",
                           reason="queue_wait") == 0, "below capacity: nothing refused"
    statuses = [status for status, _, _ in results]
    assert 429 not in statuses and 9 <= statuses.count(503) <= 16, statuses
    assert all(int(h["Retry-After"]) >= 1 for status, h, _ in results if status == 503)
    assert max(s for status, _, s in results if status == 503) < 0.25
    assert max(s for status, _, s in results if status == 200) < 3.0, "served within the SLO"
    predicted = ph.metric_value(metrics, "pdstack_proxy_admission_ttft_predicted_seconds_total")
    actual = ph.metric_value(metrics, "pdstack_proxy_admission_ttft_actual_seconds_total")
    assert predicted > 0 and 0.5 < actual / predicted < 2.0, (actual, predicted)


async def _half_open(rp: ph.RunningProxy, key: str) -> tuple[bytes, float]:
    """A request whose headers promise a 4 KiB body of which 24 bytes come (then nothing):
    the proxy's answer within 5 s (b"" if none) and the seconds it took."""
    host, port = rp.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    t0 = time.monotonic()
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
                 f"{key}\r\nContent-Type: application/json\r\nContent-Length: 4096\r\n\r\n"
                 '{"model": "fake", "pro'.encode())
    await writer.drain()
    try:
        answer = await asyncio.wait_for(reader.read(65536), 5.0)
    except TimeoutError:
        answer = b""
    writer.close()
    return answer, time.monotonic() - t0


async def test_past_capacity_a_request_is_refused_on_its_headers() -> None:
    """Saturated (the same engine and SLO as above, a flood of 20 queued), a request whose
    body has not come (a client sending slowly, or a half-open connection) is refused at
    once on its headers: 503 + Retry-After + OpenAI error JSON. Its body is not awaited
    first: refusing costs a flood nothing but headers (what comes of the body is read away
    after the answer, and the connection stays open for the client's next request). Below
    capacity the same half-open request is held for its body (nothing to refuse)."""
    async with ph.engines("e0", output_tokens=1, ttft_ms=300) as e:
        eng = e["e0"]
        async with ph.running_proxy(table(eng), **ALONE_SLO3) as rp:
            gate = rp.proxy.admission
            await _warm_up(rp, QUIET)
            idle_answer, _ = await _half_open(rp, QUIET)
            flood = [asyncio.create_task(_timed(rp, QUIET)) for _ in range(20)]
            await ph.until(lambda: gate.budget.predict(gate.queued) > gate.wait_budget_s,
                           "the gate predicting past the budget")
            answer, took = await _half_open(rp, QUIET)
            await asyncio.wait_for(asyncio.gather(*flood), 30)
    assert idle_answer == b"", "below capacity the proxy waits for the body"
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), answer[:200]
    assert b"Retry-After: " in head, head
    assert b'"type": "server_error"' in body or b'"type":"server_error"' in body, body
    assert took < 0.25, f"refused {took:.2f} s after its headers"


async def test_a_cold_gate_refuses_nothing() -> None:
    """No first byte seen yet: the rate is unknown, so a burst waits (the deadline
    judges) instead of being refused on a guess."""
    async with ph.engines("e0", output_tokens=1, ttft_ms=100) as e:
        eng = e["e0"]
        cfg = {"api_keys": frozenset({QUIET}),
               "admission": AdmissionConfig(enabled=True, max_running=1, ttft_slo_s=0.2)}
        async with ph.running_proxy(table(eng), **cfg) as rp:
            results = await asyncio.wait_for(
                asyncio.gather(*(_one(rp, QUIET) for _ in range(3))), 30
            )
    assert [status for status, _ in results] == [200, 200, 200]


# ------------------------------------------------------------------ prefill: cached prefixes
SYSTEM = " ".join(f"sys{i}" for i in range(1600))  # ~10 k characters: ~2.5 k tokens


async def test_a_prompt_counts_only_what_the_engines_have_not_seen() -> None:
    """The prefill share counts a request's uncached tokens: its prompt less the leading
    blocks an earlier admitted request sent the engines (a chat tenant's system prompt)."""
    gate = KvAdmission(AdmissionConfig(enabled=True), lambda: [], block_chars=256)
    first, second = SYSTEM + " user one", SYSTEM + " another user question"
    tokens = len(second) // 4
    for rid, text in (("r1", first), ("r2", second)):
        gate.expect(rid, 64, block_hashes(text, 256), len(text))
    assert gate.to_prefill("r2", tokens) == tokens, "nothing sent yet: all of it"
    await gate.wait_open(lambda: [], len(first) // 4, None, "r1")  # admitted (no engine)
    cached = len(SYSTEM) // 256 * 256  # the system prompt's full blocks
    assert gate.to_prefill("r2", tokens) == round(tokens * (len(second) - cached) / len(second))
    assert gate.to_prefill("r2", tokens) < 0.05 * tokens
    assert gate.to_prefill("unknown", tokens) == tokens, "a prompt it was not told of"


async def test_a_tenants_cached_prompts_pass_its_prefill_share_and_fresh_ones_do_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prefill budget 2,000 tokens, two active tenants: each may have 1,000 tokens in
    prefill (no first byte yet). The quiet tenant's ~2.5 k-token prompts share a system
    prompt that its first request sent: two of them prefill at once (counted whole, the
    second would wait for the first's first byte). A fresh prompt of the same length is
    held for the share (``tenant_share``) while they are in prefill."""
    monkeypatch.setattr(shares, "PREFILL_MAX_S", 30.0)
    async with ph.engines("e0", output_tokens=4) as e:
        eng = e["e0"]
        cfg = {"api_keys": frozenset({QUIET, LOUD}),
               "admission": AdmissionConfig(enabled=True, prefill_tokens=2000),
               "wedge_after_s": 0.0}  # requests hang on purpose
        async with ph.running_proxy(table(eng), **cfg) as rp:
            gate = rp.proxy.admission
            tasks: list[asyncio.Task[Any]] = []

            def send(key: str, prompt: str) -> None:
                tasks.append(asyncio.create_task(_one(rp, key, prompt=prompt)))

            try:
                eng.faults = Faults(hang_after_chunks=1, times=2)  # first byte, then hang
                send(LOUD, "loud " * 50)
                send(QUIET, SYSTEM + " first question")
                await ph.until(lambda: eng.running == 2 and not gate.ledger.prefill.get(
                    "key-" + digest(QUIET)[:10]), "two requests past their first byte")
                eng.faults = Faults(hang=True, times=3)  # no first byte: in prefill
                send(QUIET, SYSTEM + " second question")
                send(QUIET, SYSTEM + " third question")
                sent = eng.counters  # a request hanging before its first byte is not running
                await ph.until(lambda: sent["requests"] == 4 or bool(gate.queued), "two more")
                assert sent["requests"] == 4 and not gate.queued, (gate.held, gate.ledger.prefill)
                send(QUIET, " ".join(f"fresh{i}" for i in range(1600)))
                await ph.until(lambda: gate.queued == 1, "the fresh prompt held")
                await asyncio.sleep(0.2)
                assert sent["requests"] == 4 and gate.held == {"tenant_share": 1}, gate.held
            finally:
                await ph.cancel(tasks)


# ------------------------------------------------------------------ the engine's priorities
@pytest.mark.parametrize("engine_priority", [True, False])
async def test_engines_with_priority_scheduling_get_the_tenants_class(
    engine_priority: bool,
) -> None:
    """``engine_priority`` (the plan's: every engine runs vLLM's --scheduling-policy
    priority): each request reaches the engine with its tenant's class rank as
    ``priority`` (interactive 0, batch 1), whatever the client sent; without it the
    client's body goes as sent."""
    async with ph.engines("e0", output_tokens=2) as e:
        eng = e["e0"]
        cfg = {"tenants": {"nightly": TenantPolicy("nightly", priority="batch")},
               "tenant_keys": {digest("sk-nightly"): "nightly", digest(QUIET): "default"},
               "engine_priority": engine_priority}
        async with ph.running_proxy(table(eng), **cfg) as rp:
            for key, claimed in (("sk-nightly", -5), (QUIET, None), (QUIET, 3)):
                body = {"model": "fake", "prompt": "hi", "max_tokens": 2}
                if claimed is not None:
                    body["priority"] = claimed
                async with rp.session.post(f"{rp.url}/v1/completions", json=body,
                                           headers={"Authorization": f"Bearer {key}"}) as r:
                    assert r.status == 200, await r.text()
    seen = [r.body.get("priority", "unset") for r in eng.seen("/v1/completions") if r.body]
    assert seen == ([1, 0, 0] if engine_priority else [-5, "unset", 3])


# ------------------------------------------------------------------ interactive first
def test_a_batch_request_yields_to_an_interactive_prefill_and_only_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lower class waits while a higher class's request awaits its first byte, at most
    FIRST_HOLD_S from that request's admission; the same class never waits for itself."""
    ledger = TenantLedger(lambda tenant, delta: None)
    ledger.seen("chat", 1.0, 0)
    ledger.seen("other-chat", 1.0, 0)
    ledger.seen("batch", 1.0, 1)
    ledger.seen("batch2", 1.0, 1)
    assert not ledger.yields("batch"), "nothing in prefill"
    ledger.start("b1", "batch2", 0.0, 5000)
    assert not ledger.yields("batch") and not ledger.yields("chat"), "same or lower class"
    ledger.start("c1", "chat", 0.0, 100)
    assert ledger.yields("batch") and ledger.yields("batch2")
    assert not ledger.yields("chat") and not ledger.yields("other-chat")
    assert not ledger.yields("unseen"), "a tenant it has not seen is not held"
    ledger.end("c1")
    ledger.start("u1", "other-chat", 0.0, 100, holds_lower=False)
    assert not ledger.yields("batch"), "a non-streaming answer's prefill end is not seen"
    ledger.start("c1", "chat", 0.0, 100)
    ledger.start("c2", "chat", 0.0, 100)
    assert ledger.landed("c2")
    assert ledger.yields("batch"), "c1 still waits for its first byte"
    assert ledger.landed("c1")
    assert not ledger.yields("batch"), "both landed"
    ledger.start("c3", "chat", 0.0, 100)
    assert ledger.yields("batch")
    monkeypatch.setattr(shares, "FIRST_HOLD_S", 0.0)
    time.sleep(0.01)
    assert not ledger.yields("batch"), "held no longer than FIRST_HOLD_S"


async def test_only_a_streaming_interactive_request_holds_batch_at_the_gate() -> None:
    """The gate passes the request's ``stream`` to the ledger: a non-streaming chat
    request (its first byte is its last) holds no batch request; a streaming one does."""
    gate = KvAdmission(AdmissionConfig(enabled=True), lambda: [], block_chars=256)
    chat = TenantState(TenantPolicy("chat"), "chat", 60.0)
    batch = TenantState(TenantPolicy("batch", priority="batch"), "batch", 60.0)
    gate.ledger.seen("batch", 1.0, batch.policy.rank)
    gate.expect("unary", 4, stream=False)
    await gate.wait_open(lambda: [], 10, chat, "unary")
    assert not gate.ledger.yields("batch")
    gate.expect("streamed", 4)
    await gate.wait_open(lambda: [], 10, chat, "streamed")
    assert gate.ledger.yields("batch")
    gate.forget("streamed")
    assert not gate.ledger.yields("batch") and not gate._unary - {"unary"}


@pytest.mark.parametrize("first", [True, False])
async def test_a_batch_request_is_not_sent_while_an_interactive_one_awaits_its_first_byte(
    monkeypatch: pytest.MonkeyPatch, first: bool
) -> None:
    """An interactive tenant's request hangs before its first byte: a batch tenant's
    request is held (``interactive_first``) and goes when the interactive one ends; with
    ``interactive_first`` off it goes at once."""
    monkeypatch.setattr(shares, "FIRST_HOLD_S", 30.0)
    async with ph.engines("e0", output_tokens=4) as e:
        eng = e["e0"]
        cfg = {"tenants": {"nightly": TenantPolicy("nightly", priority="batch")},
               "tenant_keys": {digest("sk-nightly"): "nightly"},
               "api_keys": frozenset({QUIET}),
               "admission": AdmissionConfig(enabled=True, interactive_first=first),
               "wedge_after_s": 0.0}  # the interactive request hangs on purpose
        async with ph.running_proxy(table(eng), **cfg) as rp:
            gate, sent = rp.proxy.admission, eng.counters
            eng.faults = Faults(hang=True, times=1)  # no first byte: in prefill
            chat = asyncio.create_task(_one(rp, QUIET))
            try:
                await ph.until(lambda: sent["requests"] == 1, "the interactive request sent")
                batch = asyncio.create_task(_one(rp, "sk-nightly"))
                if first:
                    await ph.until(lambda: gate.queued == 1, "the batch request held")
                    await asyncio.sleep(0.3)
                    assert sent["requests"] == 1 and gate.held == {"interactive_first": 1}
                    chat.cancel()  # the interactive request ends: the batch one goes
                    with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                        await chat
                status, _ = await asyncio.wait_for(batch, 10)
                assert status == 200 and sent["requests"] == 2
                assert gate.held == ({"interactive_first": 1} if first else {}), gate.held
            finally:
                chat.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await chat


# ------------------------------------------------------------------ the wait budget: units
def test_the_first_byte_rate_counts_busy_seconds_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four first bytes 0.5 s apart while busy, then 5 idle seconds: the measured rate is
    2 per busy second, not diluted by the idle time; below MIN_LANDED it is unknown (0); a
    backlog that leaves faster than that (requests in prefill / time in prefill) wins."""
    from pdstack.proxy import wait_budget

    clock = [100.0]
    monkeypatch.setattr(wait_budget.time, "monotonic", lambda: clock[0])
    b = wait_budget.WaitBudget()
    for i in range(wait_budget.MIN_LANDED):
        assert b.rate() == 0.0, "unknown below MIN_LANDED"
        b.admitted(f"r{i}")
        clock[0] += 0.5
        b.landed(f"r{i}")
    clock[0] += 5.0  # idle
    assert b.rate() == pytest.approx((wait_budget.MIN_LANDED - 1) / 1.5)
    assert b.sojourn == pytest.approx(0.5)
    b.admitted("x")
    assert b.predict(3) == pytest.approx(4 / 2.0), "1 in prefill + 3 ahead at 2 a second"
    b.admitted("y")
    # two in prefill, 0.5 s each lately: they leave at 4 a second now (Little), above the
    # measured 2 (the earlier traffic's pace): 5 first bytes at 4 a second
    assert b.in_prefill == 2 and b.predict(3) == pytest.approx(5 / 4.0)
    b.arrived("z", 1.0)
    clock[0] += 1.5
    b.landed("z")  # not admitted through this gate: calibrated, not counted in the rate
    assert b.calibrated == 1 and b.actual_sum == pytest.approx(1.5) and b.ratio_counts[4] == 1
    b.ended("x")
    assert b.in_prefill == 1
    clock[0] += wait_budget.RATE_WINDOW_S + 1
    assert b.rate() == 0.0, "stale first bytes drop out of the window"


def test_ahead_of_counts_who_leaves_first() -> None:
    """Fair queue: every interactive waiter is ahead of a batch newcomer; among one class, a
    tenant with weight 1 and 2 own waiters sees up to 3 of each other tenant's."""
    q = FairQueue(fair=True)
    loop = asyncio.new_event_loop()
    try:
        def state(name: str, priority: str = "interactive", weight: float = 1.0) -> TenantState:
            return TenantState(TenantPolicy(name, priority=priority, weight=weight), name, 60.0)

        chat, flood, nightly = state("chat"), state("flood"), state("nightly", "batch")
        for tenant, n in ((chat, 2), (flood, 10), (nightly, 4)):
            for _ in range(n):
                q.push(Waiter(lambda: [], 1, loop.create_future(), tenant=tenant))
        assert q.ahead_of("chat", 0, 1.0) == 2 + 3  # its own 2, 3 of flood's, no batch
        assert q.ahead_of("new", 0, 1.0) == 1 + 1  # its first turn: 1 of each
        assert q.ahead_of("nightly", 1, 1.0) == 2 + 10 + 4  # every interactive one first
        assert FairQueue(fair=False).ahead_of("x", 0, 1.0) == 0
    finally:
        loop.close()


def _one_at_a_time(monkeypatch: pytest.MonkeyPatch, idle_s: float
                   ) -> tuple[Any, list[float]]:
    """A WaitBudget on a fake clock that saw MIN_LANDED requests served one at a time, 0.5 s
    each, ``idle_s`` between them; and the clock."""
    from pdstack.proxy import wait_budget

    clock = [100.0]
    monkeypatch.setattr(wait_budget.time, "monotonic", lambda: clock[0])
    b = wait_budget.WaitBudget()
    for i in range(wait_budget.MIN_LANDED):
        b.admitted(f"r{i}")
        clock[0] += 0.5
        b.landed(f"r{i}")
        clock[0] += idle_s
    return b, clock


def test_a_burst_is_predicted_from_the_concurrency_served_not_past_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One request at a time lately, 0.5 s each: 10 arriving at once are not each given the
    old 0.5 s (the engines were never seen serving 10); the current view trusts up to
    BURST_GROWTH x 1 in prefill, so the 10 leave at 2 / 0.5 s = 4 a second: 2.5 s."""
    from pdstack.proxy import wait_budget

    b, _ = _one_at_a_time(monkeypatch, idle_s=2.0)
    for i in range(10):
        b.admitted(f"burst{i}")
    assert wait_budget.BURST_GROWTH == 2.0
    assert b.predict(0) == pytest.approx(10 / (2 / 0.5))
    b.burst_growth = 1.0  # a CPU profile's engines (--admission-burst-growth 1)
    assert b.predict(0) == pytest.approx(10 / (1 / 0.5))


def test_the_prediction_corrects_itself_by_what_came_true(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Requests predicted 1 s that take 2 s: the correction moves toward 2 and the next
    predictions with it (bounded: one 100x outlier moves it at most to SCALE_BOUNDS)."""
    from pdstack.proxy import wait_budget

    clock = [100.0]
    monkeypatch.setattr(wait_budget.time, "monotonic", lambda: clock[0])
    b = wait_budget.WaitBudget()
    for i in range(200):
        b.arrived(f"q{i}", 1.0 * b.scale)  # an uncorrected 1 s, as predict() would scale it
        clock[0] += 2.0
        b.landed(f"q{i}")
    assert b.scale == pytest.approx(2.0, rel=0.01)
    assert b.predicted_sum > 0 and b.actual_sum == pytest.approx(400.0)
    b.arrived("outlier", 1.0 * b.scale)
    clock[0] += 100.0
    b.landed("outlier")
    hi = wait_budget.SCALE_BOUNDS[1]
    assert b.scale <= 2.0 + wait_budget.SCALE_EWMA * (hi - 2.0) + 1e-9


def test_a_bursts_late_onset_does_not_teach_the_correction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One request at a time lately; then 20 at once, each predicted 0.5 s and 4x late: only
    the first was predicted at a concurrency the engines had been seen serving, so the
    correction moves once (not to ~3x, which refused probes for seconds after a flood had
    drained on the CPU stack). Once 20 at a time were served, a miss at that concurrency
    teaches it again."""
    from pdstack.proxy import wait_budget

    b, clock = _one_at_a_time(monkeypatch, idle_s=0.0)
    b.rate()
    assert b.known_concurrency(0) and not b.known_concurrency(1)
    for i in range(20):
        b.arrived(f"burst{i}", 0.5, i)
        b.admitted(f"burst{i}")
    clock[0] += 2.0
    for i in range(20):
        b.landed(f"burst{i}")
    one_step = 1 + wait_budget.SCALE_EWMA * (wait_budget.SCALE_BOUNDS[1] - 1)
    assert b.scale == pytest.approx(one_step)
    assert b.calibrated == 20  # every one is in the calibration metrics all the same
    b.rate()
    assert b.known_concurrency(19) and not b.known_concurrency(20)
    b.arrived("known", 0.5 * b.scale, 5)
    b.admitted("known")
    clock[0] += 2.0
    b.landed("known")
    assert b.scale == pytest.approx(one_step + wait_budget.SCALE_EWMA * (4.0 - one_step))


def test_a_burst_is_not_predicted_faster_than_the_engines_were_seen_saturated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Engines seen saturated (8 in prefill, 2 s each: 4 first bytes a second) and then idle
    with one quick request at a time (0.05 s): a burst of 10 is predicted at the saturated
    4 a second, not at the lone requests' 20 a second (first bytes per busy second, and the
    current view from their time in prefill); past CAPACITY_MEMORY_S the capacity is
    forgotten and their pace stands again."""
    from pdstack.proxy import wait_budget

    b, clock = _one_at_a_time(monkeypatch, idle_s=0.0)  # 0.5 s each: the unloaded time
    assert b.capacity[0] == 0.0
    for i in range(40):  # saturated: 8 in prefill, one first byte every 0.25 s
        b.admitted(f"s{i}")
        if i >= 8:
            clock[0] += 0.25
            b.landed(f"s{i - 8}")
    assert b.sojourn >= wait_budget.SATURATED_X * b.unloaded[0]
    assert b.capacity[0] == pytest.approx(4.0, rel=0.1)
    for i in range(32, 40):
        b.ended(f"s{i}")
    for i in range(wait_budget.MIN_LANDED * 3):  # quick lone requests: the sojourn falls
        b.admitted(f"q{i}")
        clock[0] += 0.05
        b.landed(f"q{i}")
        clock[0] += 1.0
    for i in range(10):
        b.admitted(f"burst{i}")
    assert b.rate() == pytest.approx(b.capacity[0]), "not the lone requests' 20 a second"
    assert b.predict(0) == pytest.approx(10 / b.capacity[0])
    for i in range(10):
        b.ended(f"burst{i}")
    clock[0] += wait_budget.CAPACITY_MEMORY_S + 1
    for i in range(wait_budget.MIN_LANDED):  # fresh first bytes, the capacity forgotten
        b.admitted(f"f{i}")
        clock[0] += 0.05
        b.landed(f"f{i}")
    assert b.rate() == pytest.approx(1 / 0.05), "the lone requests' pace again"


def test_a_mere_queue_of_quick_requests_is_not_saturation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many in prefill at once but each as quick as when unloaded (a batching engine below
    its knee): no capacity is learned, the burst keeps the current view."""

    b, clock = _one_at_a_time(monkeypatch, idle_s=0.0)
    for i in range(40):
        b.admitted(f"s{i}")
        if i >= 8:
            clock[0] += 0.5 / 8  # 8 in prefill, each 0.5 s: the unloaded time
            b.landed(f"s{i - 8}")
    assert b.capacity == (0.0, 0.0)
