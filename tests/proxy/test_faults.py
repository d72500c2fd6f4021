"""Fault injection against FakeEngine test doubles: retries, mid-stream death, ejection,
drain, admission control, auth, generations, client disconnect, the kill-a-decoder
acceptance scenario."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdstack.proxy.config import ProxyConfig, load_secrets
from pdstack.testing import proxy_harness as ph
from pdstack.testing.fake_engine import Faults


async def test_prefill_500_retried_on_other_prefiller() -> None:
    """A 5xx that the engine's /health confirms: ejected at once, retried elsewhere."""
    async with ph.engines("p0", "p1", "d0") as e:
        cfg = {"eject_after": 100}  # only the confirmation ejects it, not probe counting
        async with ph.running_proxy(ph.pd_table(e, ["p0", "p1"], ["d0"]), **cfg) as rp:
            e["p0"].faults = Faults(status=500, health_status=503)
            results = [await ph.stream_completion(rp.session, rp.url, f"p{i}") for i in range(12)]
            text = await rp.metrics()
    assert all(r.status == 200 and r.events[-1] == "[DONE]" for r in results)
    failed_first = len(e["p0"].seen())
    assert failed_first > 0
    assert len(e["p1"].seen()) == 12 and len(e["d0"].seen()) == 12
    assert ph.metric_value(text, "pdstack_proxy_retries_total", leg="prefill") == failed_first
    assert ph.metric_value(text, "pdstack_proxy_ejections_total", backend="p0") == 1


async def test_all_prefillers_failing_gives_502_with_reason() -> None:
    faults = {"p0": Faults(status=503, health_status=503)}
    # without the decode fallback (tests/proxy/test_heal.py has it on)
    res, _, e = await ph.pd_stream(faults, "hello", eject_after=100, decode_fallback=False)
    assert res.status == 502
    assert "prefill p0 answered 503" in res.text
    assert not e["d0"].seen()


async def test_decode_failure_before_first_byte_retried_elsewhere() -> None:
    async with (
        ph.engines("p0", "d0", "d1", output_tokens=5) as e,
        ph.running_proxy(ph.pd_table(e, ["p0"], ["d0", "d1"])) as rp,
    ):
        for fault in (Faults(close_after_chunks=0), Faults(hang=True)):
            e["d0"].faults = fault
            e["d1"].faults = fault
            e["d0"].requests.clear()
            e["d1"].requests.clear()
            rp.proxy.config.decode_first_byte_timeout_s = 0.5
            # only the first decoder tried fails: the fault applies once overall
            fault.times = 1
            e["d1"].faults = e["d0"].faults = fault
            res = await ph.stream_completion(rp.session, rp.url, "hello", max_tokens=5)
            assert res.status == 200, (fault, res.text)
            assert res.events[-1] == "[DONE]" and not res.error_events
            assert len(ph.completion_text(res.events).split()) == 5
            assert len(e["d0"].seen()) == len(e["d1"].seen()) == 1, fault
        text = await rp.metrics()
    assert ph.metric_value(text, "pdstack_proxy_retries_total", leg="decode") == 2


async def test_no_retry_after_first_byte_error_event_instead() -> None:
    async with ph.engines("p0", "d0", "d1", output_tokens=8) as e:
        e["d0"].faults = Faults(close_after_chunks=2)
        e["d1"].faults = Faults(close_after_chunks=2)
        # without stream migration (which continues it on d1: tests/proxy/test_migration.py)
        t = ph.pd_table(e, ["p0"], ["d0", "d1"])
        async with ph.running_proxy(t, max_migrations=0) as rp:
            started = time.monotonic()
            res = await ph.stream_completion(rp.session, rp.url, "hello")
            assert time.monotonic() - started < 5
            text = await rp.metrics()
    assert res.status == 200
    assert len(ph.completion_text(res.events[:-2]).split()) == 2  # two tokens got through
    (err,) = res.error_events
    assert "failed mid-stream" in err["message"]
    assert res.events[-1] == "[DONE]"
    assert len(e["d0"].seen()) + len(e["d1"].seen()) == 1  # never retried
    assert ph.metric_value(text, "pdstack_proxy_requests_total", outcome="stream_error") == 1


async def test_mid_stream_stall_ends_with_error_event_not_hang() -> None:
    async with ph.engines("p0", "d0", output_tokens=8) as e:
        e["d0"].faults = Faults(hang_after_chunks=3)
        async with ph.running_proxy(
            ph.pd_table(e, ["p0"], ["d0"]), stream_idle_timeout_s=0.5
        ) as rp:
            started = time.monotonic()
            res = await asyncio.wait_for(ph.stream_completion(rp.session, rp.url, "hi"), 10)
            elapsed = time.monotonic() - started
            await asyncio.sleep(0.1)
            assert e["d0"].running == 0, "the stalled upstream request must be aborted"
    assert 0.4 < elapsed < 3
    assert len(ph.completion_text(res.events[:-2]).split()) == 3
    assert "no data for 0.5s" in res.error_events[0]["message"]


async def test_eject_after_consecutive_failures_and_readmit() -> None:
    async with ph.engines("p0", "d0", "d1") as e:
        cfg = {"eject_after": 3, "readmit_after": 2, "health_interval_s": 0.1}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0", "d1"]), **cfg) as rp:
            d0 = rp.registry.backends["d0"]
            assert d0.healthy
            e["d0"].faults = Faults(health_status=503)
            for _ in range(50):
                await asyncio.sleep(0.05)
                if not d0.healthy:
                    break
            assert not d0.healthy and d0.state == "ejected"
            results = [await ph.stream_completion(rp.session, rp.url, f"q{i}") for i in range(6)]
            assert all(r.status == 200 for r in results)
            assert not e["d0"].seen() and len(e["d1"].seen()) == 6
            e["d0"].faults = Faults()
            for _ in range(50):
                await asyncio.sleep(0.05)
                if d0.healthy:
                    break
            assert d0.healthy
            text = await rp.metrics()
    assert ph.metric_value(text, "pdstack_proxy_ejections_total", backend="d0") == 1


async def test_passive_ejection_from_request_failures() -> None:
    async with ph.engines("p0", "d0", "d1") as e:
        cfg = {"eject_after": 2, "health_interval_s": 60, "readmit_interval_s": 0}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0", "d1"]), **cfg) as rp:
            e["d0"].faults = Faults(close_after_chunks=0)  # dies before its first byte
            # decoders are picked by power of two choices (random when idle): send until d0
            # has failed twice (bounded), then d0 must be out and never picked again
            sent = 0
            while len(e["d0"].seen()) < 2 and sent < 64:
                res = await ph.stream_completion(rp.session, rp.url, f"q{sent}")
                assert res.status == 200  # retried on d1
                sent += 1
            assert len(e["d0"].seen()) == 2, f"d0 picked {len(e['d0'].seen())} times in {sent}"
            assert not rp.registry.backends["d0"].healthy
            for i in range(8):
                res = await ph.stream_completion(rp.session, rp.url, f"after{i}")
                assert res.status == 200
    assert len(e["d0"].seen()) == 2  # two failures, then never picked again


async def test_drain_and_undrain_with_in_flight_finishing() -> None:
    async with (
        ph.engines("p0", "d0", "d1", output_tokens=10, itl_ms=50) as e,
        ph.running_proxy(ph.pd_table(e, ["p0"], ["d0", "d1"])) as rp,
    ):
        h = rp.admin_headers()
        # one long request in flight on d0 (d1 drained for the moment)
        async with rp.session.post(f"{rp.url}/admin/backends/d1/drain", headers=h) as r:
            assert (await r.json())["state"] == "drained"
        long_req = asyncio.create_task(ph.stream_completion(rp.session, rp.url, "long"))
        await asyncio.sleep(0.15)
        assert await rp.backend_action("d1", "undrain") == 200
        assert await rp.backend_action("d0", "drain") == 200
        async with rp.session.get(f"{rp.url}/admin/backends", headers=h) as r:
            listing = {b["name"]: b for b in (await r.json())["backends"]}
        assert listing["d0"]["state"] == "drained" and listing["d0"]["in_flight"] == 1
        quick = [
            await ph.stream_completion(rp.session, rp.url, f"q{i}", max_tokens=1) for i in range(4)
        ]
        res = await long_req
    assert res.status == 200 and res.events[-1] == "[DONE]" and not res.error_events
    assert all(q.status == 200 for q in quick)
    assert len(e["d0"].seen()) == 1 and len(e["d1"].seen()) == 4


async def test_concurrency_limit_429_with_retry_after() -> None:
    async with (
        ph.engines("p0", "d0", output_tokens=5, itl_ms=100) as e,
        ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), max_concurrency=3) as rp,
    ):
        slow = [
            asyncio.create_task(ph.stream_completion(rp.session, rp.url, f"s{i}")) for i in range(3)
        ]
        await asyncio.sleep(0.1)
        res = await ph.stream_completion(rp.session, rp.url, "over")
        done = await asyncio.gather(*slow)
        after = await ph.stream_completion(rp.session, rp.url, "after")
        text = await rp.metrics()
    assert res.status == 429
    assert res.headers["Retry-After"] == "1"
    assert "concurrency limit" in res.text
    assert all(d.status == 200 for d in done) and after.status == 200
    assert ph.metric_value(text, "pdstack_proxy_requests_total", outcome="rejected") == 1


async def test_api_keys_and_admin_token() -> None:
    async with ph.engines("p0", "d0") as e:
        async with ph.running_proxy(
            ph.pd_table(e, ["p0"], ["d0"]), api_keys=frozenset({"k1", "k2"})
        ) as rp:
            no_key = await ph.stream_completion(rp.session, rp.url, "x")
            bad = await ph.stream_completion(
                rp.session, rp.url, "x", headers={"Authorization": "Bearer nope"}
            )
            good = await ph.stream_completion(
                rp.session, rp.url, "x", headers={"Authorization": "Bearer k2"}
            )
            async with rp.session.get(f"{rp.url}/admin/backends") as r:
                admin_none = r.status
            async with rp.session.get(
                f"{rp.url}/admin/backends", headers={"Authorization": "Bearer k1"}
            ) as r:
                admin_client_key = r.status
            async with rp.session.get(
                f"{rp.url}/admin/backends", headers={"X-Admin-Token": ph.ADMIN_TOKEN}
            ) as r:
                admin_ok = r.status
        async with (
            ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), admin_token=None) as rp,
            rp.session.get(
                f"{rp.url}/admin/backends", headers={"Authorization": f"Bearer {ph.ADMIN_TOKEN}"}
            ) as r,
        ):
            disabled = r.status, await r.json()
    assert no_key.status == bad.status == 401
    assert '"type": "authentication_error"' in no_key.text
    assert good.status == 200
    assert (admin_none, admin_client_key, admin_ok) == (401, 401, 200)
    assert disabled[0] == 403 and "PDSTACK_ADMIN_TOKEN" in disabled[1]["error"]["message"]


def test_secrets_from_env_file_not_argv(tmp_path) -> None:
    env_file = tmp_path / "secrets.env"
    env_file.write_text(
        "# secrets\nPDSTACK_ADMIN_TOKEN='s3cr3t-admin'\nexport PDSTACK_API_KEYS=a, b\n"
    )
    cfg = load_secrets(ProxyConfig(), env_file, environ={})
    assert cfg.admin_token == "s3cr3t-admin" and cfg.api_keys == {"a", "b"}
    cfg = load_secrets(ProxyConfig(), env_file, environ={"PDSTACK_ADMIN_TOKEN": "env-wins"})
    assert cfg.admin_token == "env-wins"
    assert "s3cr3t" not in repr(cfg)


async def test_generations_pair_only_same_generation() -> None:
    async with ph.engines("p_old", "d_old", "p_new", "d_new") as e:
        t = ph.table(
            "nixl",
            [
                ph.backend("p_old", "prefill", e["p_old"], gen="rev1@img1"),
                ph.backend("d_old", "decode", e["d_old"], gen="rev1@img1"),
                ph.backend("d_new", "decode", e["d_new"], gen="rev2@img1"),
            ],
        )
        # the pairing rule alone (no decode fallback: d_new would serve "c" whole)
        async with ph.running_proxy(t, decode_fallback=False) as rp:
            h = rp.admin_headers()
            for i in range(6):
                assert (await ph.stream_completion(rp.session, rp.url, f"a{i}")).status == 200
            assert len(e["d_old"].seen()) == 6 and not e["d_new"].seen()
            # the rolling upgrade adds a new-generation prefiller
            spec = ph.backend("p_new", "prefill", e["p_new"], gen="rev2@img1")
            async with rp.session.post(f"{rp.url}/admin/backends", json=spec, headers=h) as r:
                assert r.status == 201
                assert (await r.json())["state"] == "healthy"
            for name in ("p_old", "d_old"):
                assert await rp.backend_action(name, "drain") == 200
            for i in range(6):
                assert (await ph.stream_completion(rp.session, rp.url, f"b{i}")).status == 200
            # old decoder gone entirely: the old prefiller has no same-generation decoder
            assert await rp.backend_action("p_new", "drain") == 200
            assert await rp.backend_action("p_old", "undrain") == 200
            res = await ph.stream_completion(rp.session, rp.url, "c")
            text = await rp.metrics()
    assert len(e["d_new"].seen()) == 6 and len(e["p_new"].seen()) == 6
    assert res.status == 503
    assert "no healthy decoder for prefiller p_old on node n1" in res.text
    mixed = [
        line
        for line in text.splitlines()
        if line.startswith("pdstack_proxy_pairs_total{")
        and 'prefill_generation="rev1@img1",decode_generation="rev2@img1"' in line
    ]
    assert not mixed
    assert (
        ph.metric_value(
            text,
            "pdstack_proxy_pairs_total",
            prefill_generation="rev2@img1",
            decode_generation="rev2@img1",
        )
        == 6
    )


async def test_admin_replace_and_remove_backend() -> None:
    async with (
        ph.engines("p0", "d0", "d0b") as e,
        ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"])) as rp,
    ):
        h = rp.admin_headers()
        spec = ph.backend("d0", "decode", e["d0b"])
        async with rp.session.post(f"{rp.url}/admin/backends", json=spec, headers=h) as r:
            assert r.status == 200
        assert (await ph.stream_completion(rp.session, rp.url, "x")).status == 200
        assert len(e["d0b"].seen()) == 1 and not e["d0"].seen()
        async with rp.session.delete(f"{rp.url}/admin/backends/d0", headers=h) as r:
            assert r.status == 200
        res = await ph.stream_completion(rp.session, rp.url, "y")
        bad = {"name": "x", "role": "decoder", "url": "http://127.0.0.1:1"}
        async with rp.session.post(f"{rp.url}/admin/backends", json=bad, headers=h) as r:
            bad_status = r.status
    assert res.status == 503
    assert bad_status == 400


async def test_client_disconnect_aborts_upstream() -> None:
    async with (
        ph.engines("p0", "d0", output_tokens=50, itl_ms=20) as e,
        ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"])) as rp,
    ):
        body = {"prompt": "x", "stream": True}
        async with rp.session.post(f"{rp.url}/v1/completions", json=body) as resp:
            await resp.content.readline()
        # the context exit closed our connection mid-stream
        for _ in range(40):
            await asyncio.sleep(0.05)
            if e["d0"].counters["aborted"]:
                break
        assert e["d0"].counters["aborted"] == 1
        assert e["d0"].running == 0
        assert rp.proxy.in_flight == 0
        assert rp.registry.backends["d0"].in_flight == 0
        text = await rp.metrics()
    assert ph.metric_value(text, "pdstack_proxy_requests_total", outcome="client_disconnect") == 1


@pytest.mark.parametrize("migratable", [False, True])
async def test_a_client_that_closes_on_done_is_served_not_disconnected(
    migratable: bool,
) -> None:
    """A client that closes its connection as soon as it reads ``data: [DONE]`` (many do)
    while the engine's body has not ended yet: the request counts ``ok``, not
    ``client_disconnect`` (benchmarks/README: 15-45 % of completed streams were), whether
    the stream could migrate (two engines) or not (one)."""
    names = ["c0", "c1"] if migratable else ["c0"]
    async with (
        ph.engines(*names, output_tokens=3) as e,
        ph.running_proxy(ph.table("colocated", [ph.backend(n, "colocated", e[n])
                                                for n in names])) as rp,
    ):
        for engine in e.values():
            engine.faults = Faults(end_delay_ms=500)
        body = {"prompt": "x", "stream": True, "max_tokens": 3}
        async with rp.session.post(f"{rp.url}/v1/completions", json=body) as resp:
            while b"[DONE]" not in await resp.content.readline():
                pass
        # the context exit closed our connection before the engine's body ended
        await ph.until(lambda: rp.proxy.in_flight == 0, "the proxy done with it")
        text = await rp.metrics()
    assert ph.metric_value(text, "pdstack_proxy_requests_total", outcome="ok") == 1
    assert ph.metric_value(text, "pdstack_proxy_requests_total",
                           outcome="client_disconnect") == 0


async def test_client_disconnect_during_prefill_aborts_prefill() -> None:
    async with ph.engines("p0", "d0") as e:
        e["p0"].faults = Faults(hang=True)
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"])) as rp:
            task = asyncio.create_task(ph.stream_completion(rp.session, rp.url, "x"))
            await asyncio.sleep(0.2)
            assert rp.registry.backends["p0"].in_flight == 1
            task.cancel()
            for _ in range(40):
                await asyncio.sleep(0.05)
                if rp.registry.backends["p0"].in_flight == 0:
                    break
            assert rp.registry.backends["p0"].in_flight == 0
            assert rp.proxy.in_flight == 0
    assert not e["d0"].seen()


async def test_acceptance_kill_decoder_mid_load() -> None:
    """Kill a decoder mid-load: requests that had not started streaming succeed elsewhere,
    streaming ones go on on the other decoder (stream migration: every one completes, none
    hangs), the backend is ejected, and it is re-admitted once it is back."""
    async with (
        ph.engines("p0", output_tokens=1) as pe,
        ph.engines("d0", "d1", output_tokens=30, itl_ms=30, ttft_ms=50) as de,
    ):
        e = {**pe, **de}
        cfg = {
            "eject_after": 2,
            "readmit_after": 2,
            "health_interval_s": 0.2,
            "decode_first_byte_timeout_s": 5.0,
            "stream_idle_timeout_s": 5.0,
        }
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0", "d1"]), **cfg) as rp:
            first_wave = [
                asyncio.create_task(ph.stream_completion(rp.session, rp.url, f"w1-{i}"))
                for i in range(40)
            ]
            for _ in range(200):  # until the first wave is streaming on d0
                await asyncio.sleep(0.02)
                if e["d0"].counters["generation_tokens"] > 0 and e["d0"].running >= 2:
                    break
            on_d0 = e["d0"].running
            assert on_d0 > 0
            await e["d0"].kill()
            second_wave = [
                asyncio.create_task(ph.stream_completion(rp.session, rp.url, f"w2-{i}"))
                for i in range(40)
            ]
            started = time.monotonic()
            first = await asyncio.wait_for(asyncio.gather(*first_wave), 20)
            second = await asyncio.wait_for(asyncio.gather(*second_wave), 20)
            assert time.monotonic() - started < 20
            d0 = rp.registry.backends["d0"]
            assert not d0.healthy, "killed decoder must be ejected"
            text = await rp.metrics()
            assert ph.metric_value(text, "pdstack_proxy_ejections_total", backend="d0") == 1
            await e["d0"].start()  # back on the same port
            for _ in range(50):
                await asyncio.sleep(0.1)
                if d0.healthy:
                    break
            assert d0.healthy, "restarted decoder must be re-admitted"
            third = await asyncio.gather(
                *(ph.stream_completion(rp.session, rp.url, f"w3-{i}") for i in range(20))
            )
    # every first-wave request completed, those streaming on d0 continued on d1 (none hung)
    for r in first:
        assert r.status == 200 and r.events[-1] == "[DONE]" and not r.error_events, r.text
        assert len(ph.completion_text(r.events).split()) == 30
    moved = ph.metric_value(text, "pdstack_proxy_migrations_total", outcome="continued")
    assert 1 <= moved <= on_d0  # those on d0 that had not streamed yet were retried
    assert ph.metric_value(text, "pdstack_proxy_migrations_total", outcome="failed") == 0
    # requests that had not started streaming succeeded elsewhere
    assert all(r.status == 200 and not r.error_events for r in second)
    assert all(len(ph.completion_text(r.events).split()) == 30 for r in second)
    assert all(r.status == 200 and not r.error_events for r in third)
    assert e["d0"].seen()[-1].body["prompt"].startswith("w3-")


async def test_engine_still_starting_admitted_on_its_first_passing_probe() -> None:
    """An engine that fails its first probes (still loading when the proxy starts) is taken
    on its first passing probe, not after readmit_after of them: the prefiller of a stack
    that `docker compose up --wait` just reported healthy serves the next request (CI saw
    the decoders serve whole requests because the prefiller still waited to be re-admitted)."""
    async with ph.engines("p0", "d0") as e:
        e["p0"].faults = Faults(health_status=503)
        # no health round, no re-admission probe in the test: only the probes it makes
        cfg = {"readmit_after": 5, "health_interval_s": 60, "readmit_interval_s": 0}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), **cfg) as rp:
            p0 = rp.registry.backends["p0"]
            assert not p0.healthy and p0.state == "down"
            e["p0"].faults = Faults()
            assert await rp.proxy.probe(p0)
            assert p0.healthy and p0.state == "healthy" and not p0.half_open
            res = await ph.stream_completion(rp.session, rp.url, "hello")
            assert res.status == 200
            assert len(e["p0"].seen()) == 1 and len(e["d0"].seen()) == 1
            # once ejected, one passing probe is not enough: it waits for readmit_after
            rp.registry.eject(p0, "test")
            for _ in range(4):
                assert await rp.proxy.probe(p0)
            assert not p0.healthy
            assert await rp.proxy.probe(p0)
            assert p0.healthy and p0.half_open


async def _until(cond, budget: float) -> float:  # type: ignore[no-untyped-def]
    """Seconds until ``cond()`` holds, or ``budget`` when it never does within it."""
    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < budget:
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def test_restarted_backend_readmitted_between_health_rounds() -> None:
    """An ejected backend whose /health passes again (a restarted engine) is re-admitted,
    on trial, within readmit_after x readmit_interval_s, not after readmit_after health
    rounds (issue 38 item 6: 2.6 s of a CPU engine's restart with the 2 s rounds); a wedged
    one is left to the health rounds (its re-admission needs a generation); 0 turns it off."""
    async with ph.engines("p0", "d0", "d1") as e:
        cfg = {"health_interval_s": 30.0, "readmit_after": 2, "readmit_interval_s": 0.2}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0", "d1"]), **cfg) as rp:
            d0 = rp.registry.backends["d0"]
            assert d0.healthy
            rp.registry.eject(d0, "test: its engine was restarted")
            took = await _until(lambda: d0.healthy, 5.0)
            assert d0.healthy and d0.half_open, f"not re-admitted within {took:.1f} s"
            assert took >= 0.3  # two passing probes, 0.2 s apart, not the first one alone
            results = [await ph.stream_completion(rp.session, rp.url, f"q{i}") for i in range(8)]
            assert all(r.status == 200 for r in results)
            assert e["d0"].seen(), "the re-admitted decoder takes requests again"
            d0.wedged = True
            rp.registry.eject(d0, "test: wedged")
            await _until(lambda: d0.healthy, 1.5)
            assert not d0.healthy  # a wedged one waits for a health round (and a generation)
    async with ph.engines("p0", "d0") as e:
        cfg = {"health_interval_s": 30.0, "readmit_interval_s": 0}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), **cfg) as rp:
            d0 = rp.registry.backends["d0"]
            rp.registry.eject(d0, "test")
            await _until(lambda: d0.healthy, 1.5)
            assert not d0.healthy  # 0: the health rounds only
