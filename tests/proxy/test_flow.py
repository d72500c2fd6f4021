"""Two-leg flow, headers, kv_transfer_params, modes, routing — against FakeEngine test doubles."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import aiohttp

from pdstack.testing import proxy_harness as ph
from pdstack.testing.fake_engine import FakeEngine

SYSTEM = "You are a helpful assistant. " * 40  # ~1200 chars, shared by most requests


async def test_nixl_two_leg_flow_exact() -> None:
    async with ph.engines("p0", "d0", output_tokens=6) as e:
        t = ph.table(
            "nixl", [ph.backend("p0", "prefill", e["p0"]), ph.backend("d0", "decode", e["d0"])]
        )
        async with ph.running_proxy(t) as rp:
            res = await ph.stream_completion(
                rp.session,
                rp.url,
                SYSTEM + "question 1",
                headers={"X-Request-Id": "req-abc"},
                max_tokens=5,
                min_tokens=2,
                stream_options={"include_usage": True},
            )
            assert res.status == 200
            assert res.headers["X-Request-Id"] == "req-abc"
            assert res.events[-1] == "[DONE]"
            # same tokens as asking the decoder directly (the fake is deterministic per prompt)
            direct = await ph.stream_completion(
                rp.session, e["d0"].url, SYSTEM + "question 1", max_tokens=5
            )
            assert ph.completion_text(res.events) == ph.completion_text(direct.events)

    (pre,) = e["p0"].seen()
    assert pre.request_id == "req-abc"
    assert pre.body["max_tokens"] == 1
    assert pre.body["stream"] is False
    assert "stream_options" not in pre.body
    assert "min_tokens" not in pre.body
    assert pre.body["kv_transfer_params"] == {"do_remote_decode": True}
    dec = e["d0"].seen()[0]
    assert dec.request_id == "req-abc"
    assert dec.body["max_tokens"] == 5 and dec.body["min_tokens"] == 2
    assert dec.body["stream"] is True
    assert dec.body["stream_options"] == {"include_usage": True}
    params = dec.body["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params["remote_engine_id"] == "p0"
    assert params["request_id"] == "req-abc"


async def test_request_id_generated_and_non_stream_chat() -> None:
    async with ph.engines("p0", "d0", output_tokens=4) as e:
        t = ph.table(
            "nixl", [ph.backend("p0", "prefill", e["p0"]), ph.backend("d0", "decode", e["d0"])]
        )
        async with ph.running_proxy(t) as rp:
            body = {
                "model": "fake",
                "messages": [{"role": "user", "content": "hello"}],
                "max_completion_tokens": 3,
            }
            async with rp.session.post(f"{rp.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                data = await resp.json()
                rid = resp.headers["X-Request-Id"]
    assert data["object"] == "chat.completion"
    assert len(data["choices"][0]["message"]["content"].split()) == 3
    assert rid and e["p0"].seen()[0].request_id == rid == e["d0"].seen()[0].request_id
    assert e["p0"].seen()[0].body["max_completion_tokens"] == 1
    assert e["p0"].seen()[0].path == "/v1/chat/completions"


async def test_shared_l1_pairs_same_node_only_and_no_kv_params() -> None:
    async with ph.engines("p1", "d1", "p2", "d2") as e:
        t = ph.table(
            "shared-l1",
            [
                ph.backend("n1/p", "prefill", e["p1"], node="n1"),
                ph.backend("n1/d", "decode", e["d1"], node="n1"),
                ph.backend("n2/p", "prefill", e["p2"], node="n2"),
                ph.backend("n2/d", "decode", e["d2"], node="n2"),
            ],
        )
        # a bogus cross-node shared-l1 pairing must still never be used
        t["pairings"].append({"prefill": "n1/p", "decode": "n2/d", "kv_path": "shared-l1"})
        async with ph.running_proxy(t) as rp:
            results = await asyncio.gather(
                *(ph.stream_completion(rp.session, rp.url, f"prompt {i} " * 50) for i in range(40))
            )
    assert all(r.status == 200 and r.events[-1] == "[DONE]" for r in results)
    ids = {1: {r.request_id for r in e["p1"].seen()}, 2: {r.request_id for r in e["p2"].seen()}}
    assert ids[1] and ids[2], "affinity hashing should use both prefillers for 40 prompts"
    assert ids[1] == {r.request_id for r in e["d1"].seen()}
    assert ids[2] == {r.request_id for r in e["d2"].seen()}
    for name in e:
        assert all("kv_transfer_params" not in r.body for r in e[name].seen())


def _one_prefiller_two_nodes(e: dict[str, FakeEngine]) -> dict[str, Any]:
    """shared-l1+nixl: prefiller p1 and decoder d1 on node n1, decoder d2 on node n2."""
    return ph.table(
        "shared-l1+nixl",
        [
            ph.backend("n1/p", "prefill", e["p1"], node="n1"),
            ph.backend("n1/d", "decode", e["d1"], node="n1"),
            ph.backend("n2/d", "decode", e["d2"], node="n2"),
        ],
    )


async def test_shared_l1_plus_nixl_prefers_same_node_and_uses_nixl_across() -> None:
    async with ph.engines("p1", "d1", "d2") as e:
        t = _one_prefiller_two_nodes(e)
        async with ph.running_proxy(t) as rp:
            ok = await ph.stream_completion(rp.session, rp.url, "x " * 10)
            assert ok.status == 200
            assert len(e["d1"].seen()) == 1 and not e["d2"].seen()
            assert "kv_transfer_params" not in e["p1"].seen()[0].body
            assert await rp.backend_action("n1/d", "drain") == 200
            ok = await ph.stream_completion(rp.session, rp.url, "y " * 10)
            assert ok.status == 200
    assert len(e["d2"].seen()) == 1
    assert e["p1"].seen()[1].body["kv_transfer_params"] == {"do_remote_decode": True}
    assert e["d2"].seen()[0].body["kv_transfer_params"]["do_remote_prefill"] is True


async def test_shared_l1_plus_nixl_spreads_load_to_the_other_nodes_decoder() -> None:
    """Under load the NIXL-paired decoder of another node takes its share (on one H200,
    issue 35, the same-node decoder got every request and node b's stayed idle)."""
    async with ph.engines("p1", "d1", "d2", output_tokens=20, itl_ms=20) as e:
        t = _one_prefiller_two_nodes(e)
        async with ph.running_proxy(t) as rp:
            results = await asyncio.gather(
                *(ph.stream_completion(rp.session, rp.url, f"p{i} " * 20) for i in range(20))
            )
    assert all(r.status == 200 and r.events[-1] == "[DONE]" for r in results)
    same, other = e["d1"].seen(), e["d2"].seen()
    assert len(same) + len(other) == 20
    assert len(other) >= 5 and len(same) >= 5, (len(same), len(other))
    # each leg took its own path: NIXL params exactly for the other node's decoder
    assert all(r.body["kv_transfer_params"]["do_remote_prefill"] is True for r in other)
    assert all("kv_transfer_params" not in r.body for r in same)
    nixl_ids = {r.request_id for r in other}
    for r in e["p1"].seen():
        assert ("kv_transfer_params" in r.body) == (r.request_id in nixl_ids)


async def test_colocated_is_one_leg() -> None:
    async with ph.engines("e0", "e1") as e:
        t = ph.table(
            "colocated",
            [ph.backend("e0", "colocated", e["e0"]), ph.backend("e1", "colocated", e["e1"])],
        )
        async with ph.running_proxy(t) as rp:
            res = await ph.stream_completion(rp.session, rp.url, "hello there", max_tokens=3)
            assert res.status == 200
            text = await rp.metrics()
    seen = e["e0"].seen() + e["e1"].seen()
    assert len(seen) == 1
    assert seen[0].body["max_tokens"] == 3 and "kv_transfer_params" not in seen[0].body
    assert ph.metric_value(text, "pdstack_proxy_ttft_seconds_count", route="colocated") == 1


async def test_prefix_affinity_sticks_and_bounded_load_spreads_hot_prefix() -> None:
    async with ph.engines("p0", "p1", "p2", "p3", "d0", ttft_ms=0) as e:
        pre = [ph.backend(f"p{i}", "prefill", e[f"p{i}"]) for i in range(4)]
        t = ph.table("nixl", [*pre, ph.backend("d0", "decode", e["d0"])])
        async with ph.running_proxy(t, prefix_chars=256, load_factor=1.25) as rp:
            # sequential (no load): one shared system prompt -> always one prefiller
            for i in range(8):
                res = await ph.stream_completion(rp.session, rp.url, SYSTEM + f"user {i}")
                assert res.status == 200
            used = [n for n in ("p0", "p1", "p2", "p3") if e[n].seen()]
            assert len(used) == 1, used
            hot = used[0]
            # concurrent with slow prefill: the hot prompt spills to other prefillers
            for n in ("p0", "p1", "p2", "p3"):
                e[n].requests.clear()
                e[n].ttft_ms = 150
            results = await asyncio.gather(
                *(ph.stream_completion(rp.session, rp.url, SYSTEM + f"user {i}") for i in range(16))
            )
            assert all(r.status == 200 for r in results)
    counts = {n: len(e[n].seen()) for n in ("p0", "p1", "p2", "p3")}
    assert sum(counts.values()) == 16
    # capacity = ceil(1.25 * (in_flight + 1) / 4) <= 5 when all 16 are in flight
    assert max(counts.values()) <= 5, counts
    assert counts[hot] == max(counts.values())


async def test_decode_power_of_two_balances() -> None:
    async with (
        ph.engines("p0", output_tokens=4) as pe,
        ph.engines("d0", "d1", "d2", "d3", output_tokens=20, itl_ms=20) as de,
    ):
        t = ph.table(
            "nixl",
            [ph.backend("p0", "prefill", pe["p0"]), *[ph.backend(n, "decode", de[n]) for n in de]],
        )
        async with ph.running_proxy(t) as rp:
            results = []
            for _ in range(4):  # waves, so that in-flight counts matter
                wave = [ph.stream_completion(rp.session, rp.url, f"q{i}") for i in range(20)]
                results += await asyncio.gather(*wave)
    assert all(r.status == 200 for r in results)
    counts = Counter({n: len(de[n].seen()) for n in de})
    assert sum(counts.values()) == 80
    assert min(counts.values()) >= 10, counts  # p2c: no decoder starves / melts


async def test_models_health_metrics_endpoints() -> None:
    async with ph.engines("p0", "d0") as e:
        t = ph.table(
            "nixl", [ph.backend("p0", "prefill", e["p0"]), ph.backend("d0", "decode", e["d0"])]
        )
        async with ph.running_proxy(t) as rp:
            async with rp.session.get(f"{rp.url}/v1/models") as resp:
                assert (await resp.json())["data"][0]["id"] == "fake"
            async with rp.session.get(f"{rp.url}/health") as resp:
                assert resp.status == 200
            await ph.stream_completion(rp.session, rp.url, "hi")
            text = await rp.metrics()
            e["d0"].faults.health_status = 503
            await asyncio.sleep(1.0)
            async with rp.session.get(f"{rp.url}/health") as resp:
                assert resp.status == 503
                assert await resp.json() == {"status": "degraded"}  # no names without a token
            async with rp.session.get(f"{rp.url}/health", headers=rp.admin_headers()) as resp:
                assert resp.status == 503
                body = await resp.json()
    assert "no healthy decoder for prefiller p0 on node n1" in body["reason"]
    assert ph.metric_value(text, "pdstack_proxy_requests_total", outcome="ok") == 1
    assert ph.metric_value(text, "pdstack_proxy_ttft_seconds_count", route="pd") == 1
    assert ph.metric_value(text, "pdstack_proxy_leg_seconds_count", leg="prefill") == 1
    assert ph.metric_value(text, "pdstack_proxy_leg_seconds_count", leg="decode") == 1
    assert "pdstack_proxy_backend_in_flight{" in text
    assert ph.metric_value(text, "pdstack_proxy_pairs_total", prefill="p0", decode="d0") == 1


async def test_bad_json_is_openai_error() -> None:
    async with ph.engines("p0", "d0") as e:
        t = ph.table(
            "nixl", [ph.backend("p0", "prefill", e["p0"]), ph.backend("d0", "decode", e["d0"])]
        )
        async with (
            ph.running_proxy(t) as rp,
            rp.session.post(f"{rp.url}/v1/completions", data=b"{nope") as resp,
        ):
            assert resp.status == 400
            err = (await resp.json())["error"]
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}


async def test_upstream_4xx_is_passed_through_not_retried() -> None:
    async with ph.engines("p0", "p1", "d0") as e:
        e["p0"].faults.status = 400
        e["p1"].faults.status = 400
        t = ph.table(
            "nixl",
            [
                ph.backend("p0", "prefill", e["p0"]),
                ph.backend("p1", "prefill", e["p1"]),
                ph.backend("d0", "decode", e["d0"]),
            ],
        )
        async with ph.running_proxy(t) as rp:
            res = await ph.stream_completion(rp.session, rp.url, "x")
    assert res.status == 400
    assert "error" in json.loads(res.text)
    assert len(e["p0"].seen()) + len(e["p1"].seen()) == 1
    assert not e["d0"].seen()


async def test_client_kv_transfer_params_are_dropped() -> None:
    async with ph.engines("p0", "d0") as e:
        t = ph.table(
            "shared-l1", [ph.backend("p0", "prefill", e["p0"]), ph.backend("d0", "decode", e["d0"])]
        )
        async with ph.running_proxy(t) as rp:
            evil = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 1}
            res = await ph.stream_completion(rp.session, rp.url, "x", kv_transfer_params=evil)
    assert res.status == 200
    assert "kv_transfer_params" not in e["p0"].seen()[0].body
    assert "kv_transfer_params" not in e["d0"].seen()[0].body


async def test_http10_client_gets_unchunked_stream() -> None:
    async with ph.engines("p0", "d0", output_tokens=3) as e:
        t = ph.table(
            "nixl", [ph.backend("p0", "prefill", e["p0"]), ph.backend("d0", "decode", e["d0"])]
        )
        async with ph.running_proxy(t) as rp:
            body = {"prompt": "x", "stream": True}
            async with (
                aiohttp.ClientSession(version=aiohttp.HttpVersion10) as session,
                session.post(f"{rp.url}/v1/completions", json=body) as resp,
            ):
                assert resp.status == 200
                assert "chunked" not in resp.headers.get("Transfer-Encoding", "")
                text = (await resp.read()).decode()
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(ph.completion_text(events).split()) == 3
