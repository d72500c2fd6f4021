"""The proxy's KV-event subscriber and routing by cost (issue 56), against stand-in
publishers (pdstack/testing/kv_publisher.py) and FakeEngine test doubles: replay at start,
live batches, an engine restart, a silent publisher, and routing (cost for engines whose
events are fresh, the hash ring for one whose publisher is missing, with the metric)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio

from pdstack.proxy.admission_config import AdmissionConfig
from pdstack.proxy.kv_events import BlockRemoved, KvEventsSubscriber
from pdstack.proxy.kv_events_route import KvEventsConfig
from pdstack.proxy.kv_index import HashScheme, KvIndex, block_hashes
from pdstack.proxy.routing import prompt_text, stable_hash
from pdstack.testing import proxy_harness as ph
from pdstack.testing.fake_engine import Faults
from pdstack.testing.kv_publisher import FakePublisher
from pdstack.testing.ports import free_port

FAST = {"heartbeat_s": 0.2, "stale_after_s": 1.0, "replay_timeout_s": 0.3}


def tokens_of(i: int, n: int = 64) -> list[int]:
    return [1000 * i + t for t in range(n)]


@contextlib.asynccontextmanager
async def publishers(names: list[str], port: int) -> AsyncIterator[dict[str, FakePublisher]]:
    ctx = zmq.asyncio.Context()
    pubs = {
        n: FakePublisher(ctx, n, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{free_port()}")
        for n in names
    }
    try:
        yield {n: p.start() for n, p in pubs.items()}
    finally:
        for p in pubs.values():
            await p.close()
        ctx.term()


def routing_config(port: int, pubs: dict[str, FakePublisher],
                   sources: dict[str, str] | None = None) -> KvEventsConfig:
    """The proxy's KV-event config for routing tests: each publisher's replay endpoint (or
    ``sources``), stale only after 30 s (a starved test machine must not turn engines stale)."""
    if sources is None:
        sources = {n: p.replay_endpoint for n, p in pubs.items()}
    return KvEventsConfig(host="127.0.0.1", port=port, sources=sources,
                          **{**FAST, "stale_after_s": 30.0})


@contextlib.asynccontextmanager
async def subscriber(
    pubs: dict[str, FakePublisher], port: int
) -> AsyncIterator[KvEventsSubscriber]:
    sub = KvEventsSubscriber(KvIndex("0"), "127.0.0.1", port,
                             {n: p.replay_endpoint for n, p in pubs.items()}, **FAST)
    await sub.start()
    try:
        yield sub
    finally:
        await sub.close()


async def test_replay_at_start_then_live_batches_build_the_index() -> None:
    port = free_port()
    async with publishers(["n/e0"], port) as pubs:
        pub = pubs["n/e0"]
        first = await pub.store(tokens_of(1))  # before the proxy runs: only the replay has it
        async with subscriber(pubs, port) as sub:
            await ph.until(lambda: sub.index.held("n/e0", first).gpu_blocks == 4, "replayed")
            assert sub.state("n/e0") == "fresh"
            second = await pub.store(tokens_of(2))
            await ph.until(lambda: sub.index.held("n/e0", second).gpu_blocks == 4, "live")
            await pub.publish(BlockRemoved(block_hashes=[first[2]], medium="GPU"))
            await ph.until(lambda: sub.index.held("n/e0", first).gpu_blocks == 2, "removed")
            assert sub.feeds["n/e0"].batches["replay"] >= 1
            assert sub.feeds["n/e0"].batches["live"] >= 1


async def test_an_engine_restart_empties_its_index_and_it_refills() -> None:
    port = free_port()
    async with publishers(["n/e0"], port) as pubs, subscriber(pubs, port) as sub:
        pub = pubs["n/e0"]
        for i in range(3):
            await pub.store(tokens_of(i))
        old = block_hashes(tokens_of(0), 16, HashScheme("0"))
        await ph.until(lambda: sub.feeds["n/e0"].last_seq == 2, "three batches")
        await pub.restart()  # a new process: seqs from 0, an empty cache
        new = await pub.store(tokens_of(9))
        await ph.until(lambda: sub.index.held("n/e0", new).gpu_blocks == 4, "refilled")
        assert sub.index.held("n/e0", old).gpu_blocks == 0
        assert sub.feeds["n/e0"].resets.get("restart") == 1


async def test_an_idle_restart_is_found_by_the_heartbeat() -> None:
    port = free_port()
    async with publishers(["n/e0"], port) as pubs, subscriber(pubs, port) as sub:
        pub = pubs["n/e0"]
        old = await pub.store(tokens_of(0))
        await ph.until(lambda: sub.index.held("n/e0", old).gpu_blocks == 4, "stored")
        pub.seq, pub.buffer = 0, []  # restarted, published nothing yet
        await ph.until(lambda: sub.index.held("n/e0", old).gpu_blocks == 0, "cleared", 5.0)
        assert sub.state("n/e0") == "fresh"  # its replays answer: alive, empty


async def test_a_silent_publisher_goes_stale_with_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    caplog.set_level(logging.INFO, "pdstack.proxy.kv_events")
    async with publishers(["n/e0"], port) as pubs, subscriber(pubs, port) as sub:
        pub = pubs["n/e0"]
        await pub.store(tokens_of(0))
        await ph.until(lambda: sub.state("n/e0") == "fresh", "fresh")
        pub.answer_replays = False  # its publisher thread is gone
        await ph.until(lambda: sub.state("n/e0") == "stale", "stale", 5.0)
        await ph.until(lambda: "n/e0 stale: routing it by hash" in caplog.text, "logged", 3.0)
        pub.answer_replays = True
        await ph.until(lambda: sub.state("n/e0") == "fresh", "fresh again", 5.0)


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] == name and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}{{{want}}} in the metrics")


def served(engines: dict[str, Any], tokens: list[int]) -> list[str]:
    return [n for n, e in engines.items() for r in e.seen("/v1/completions")
            if (r.body or {}).get("prompt") == tokens]


def ring_home(ring: Any, body: dict[str, Any]) -> str:
    """The engine a request's prompt hashes to on the proxy's ring (its route by hash)."""
    return next(ring.walk(stable_hash(prompt_text(body)[:1024])))


def homed_at(ring: Any, name: str, numbers: range, count: int) -> list[list[int]]:
    """The first ``count`` prompts ``tokens_of(i)``, ``i`` in ``numbers``, whose ring home
    is ``name``."""
    prompts = (tokens_of(i) for i in numbers)
    return [t for t in prompts if ring_home(ring, {"prompt": t}) == name][:count]


async def complete(rp: ph.RunningProxy, tokens: list[int], max_tokens: int) -> None:
    """One completion of a token-id prompt through the proxy, answered 200."""
    body = {"model": "fake", "prompt": tokens, "max_tokens": max_tokens}
    async with rp.session.post(rp.url + "/v1/completions", json=body) as r:
        assert r.status == 200


async def test_routes_by_held_blocks_and_by_hash_where_events_are_missing() -> None:
    port = free_port()
    names = ["n1/engine-0", "n1/engine-1", "n1/engine-2"]
    async with ph.engines(*names) as e, publishers(names[:2], port) as pubs:
        backends = [ph.backend(n, "colocated", e[n]) for n in names]
        table = ph.table("colocated", backends)
        sources = {n: p.replay_endpoint for n, p in pubs.items()}
        # engine-2's publisher is down: nothing answers at its replay endpoint
        sources[names[2]] = f"tcp://127.0.0.1:{free_port()}"
        kv = routing_config(port, pubs, sources)
        async with ph.running_proxy(table, kv_events=kv) as rp:
            await ph.until(lambda: all(rp.registry.backends[n].usable for n in names), "up")
            ring = rp.proxy._ring_for("colocated")
            # prompts whose ring home is engine-0, announced held by engine-1: routed by cost
            held = homed_at(ring, names[0], range(200), 3)
            for t in held:
                await pubs[names[1]].store(t)
            await pubs[names[0]].store(tokens_of(999))  # engine-0 verified too
            await ph.until(lambda: all(rp.proxy.kv_routing.state(n) == "fresh"
                                       for n in names[:2]), "fresh")
            for t in held:
                await complete(rp, t, max_tokens=1)
                assert served(e, t) == [names[1]]
            # prompts whose ring home is engine-2 (no events): routed there by hash
            for t in homed_at(ring, names[2], range(200, 400), 3):
                await complete(rp, t, max_tokens=1)
                assert served(e, t) == [names[2]]
            text = await rp.metrics()
            assert metric(text, "pdstack_proxy_kv_route_total", decision="cost") == 3
            assert metric(text, "pdstack_proxy_kv_route_total", decision="hash_missing") == 3
            assert metric(text, "pdstack_proxy_kv_events_state",
                          backend=names[2], state="missing") == 1
            assert metric(text, "pdstack_proxy_kv_events_state",
                          backend=names[1], state="fresh") == 1
            assert metric(text, "pdstack_proxy_kv_index_blocks",
                          backend=names[1], medium="gpu") == 12
            predicted = {d.request_id: d for d in rp.proxy.kv_routing.recent}
            assert sorted(d.predicted_cached_tokens for d in predicted.values()) == [
                0, 0, 0, 64, 64, 64]


async def test_pd_picks_the_prefiller_holding_the_prompt() -> None:
    port = free_port()
    pre, dec = ["n1/prefill-0", "n1/prefill-1"], ["n1/decode-0"]
    async with ph.engines(*pre, *dec) as e, publishers(pre, port) as pubs:
        table = ph.pd_table(e, pre, dec)
        kv = routing_config(port, pubs)
        async with ph.running_proxy(table, kv_events=kv) as rp:
            await ph.until(lambda: all(b.usable for b in rp.registry.backends.values()), "up")
            # ring home prefill-0, but prefill-1 holds them
            held = homed_at(rp.proxy._ring_for("prefill"), pre[0], range(200), 2)
            for t in held:
                await pubs[pre[1]].store(t)
            await pubs[pre[0]].store(tokens_of(999))
            await ph.until(lambda: all(rp.proxy.kv_routing.state(n) == "fresh" for n in pre),
                           "fresh")
            for t in held:
                await complete(rp, t, max_tokens=2)
                assert served({n: e[n] for n in pre}, t) == [pre[1]]
                assert served({n: e[n] for n in dec}, t) == dec
            text = await rp.metrics()
            assert metric(text, "pdstack_proxy_kv_route_total", decision="cost") == 2


async def test_a_taken_listen_port_leaves_the_proxy_routing_by_hash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    ctx = zmq.asyncio.Context()
    taken = ctx.socket(zmq.PUB)
    taken.bind(f"tcp://127.0.0.1:{port}")
    try:
        async with ph.engines("n1/engine-0", "n1/engine-1") as e:
            table = ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in e])
            kv = KvEventsConfig(host="127.0.0.1", port=port, **FAST,
                                sources={n: f"tcp://127.0.0.1:{free_port()}" for n in e})
            async with ph.running_proxy(table, kv_events=kv) as rp:
                await ph.until(lambda: all(b.usable for b in rp.registry.backends.values()),
                               "up")
                await complete(rp, tokens_of(1), max_tokens=1)
                text = await rp.metrics()
                assert metric(text, "pdstack_proxy_kv_route_total", decision="hash_missing") == 1
        assert "cannot listen on" in caplog.text
    finally:
        taken.close(linger=0)
        ctx.term()


async def test_chat_is_tokenized_by_an_engine_then_routed_by_cost() -> None:
    port = free_port()
    names = ["n1/engine-0", "n1/engine-1"]
    async with ph.engines(*names) as e, publishers(names, port) as pubs:
        table = ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in names])
        kv = routing_config(port, pubs)
        async with ph.running_proxy(table, kv_events=kv) as rp:
            await ph.until(lambda: all(b.usable for b in rp.registry.backends.values()), "up")
            ring = rp.proxy._ring_for("colocated")

            def chat(i: int) -> dict[str, Any]:
                words = " ".join(f"w{i}x{k}" for k in range(40))
                return {"model": "fake", "max_tokens": 1,
                        "messages": [{"role": "user", "content": words}]}

            body = next(b for b in (chat(i) for i in range(100)) if ring_home(ring, b) == names[0])
            # the proxy asks the least busy engine (engine-0 here, both idle) for token ids:
            # ask it first, and let engine-1 announce those blocks
            tokenize = {k: body[k] for k in ("model", "messages")}
            async with rp.session.post(e[names[0]].url + "/tokenize", json=tokenize) as r:
                ids = (await r.json())["tokens"]
            await pubs[names[1]].store(ids)
            await pubs[names[0]].store(tokens_of(999))
            await ph.until(lambda: all(rp.proxy.kv_routing.state(n) == "fresh" for n in names),
                           "fresh")
            async with rp.session.post(rp.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                request_id = r.headers["X-Request-Id"]
            assert [n for n in names if e[n].seen("/v1/chat/completions")] == [names[1]]
            decision = next(d for d in rp.proxy.kv_routing.recent if d.request_id == request_id)
            assert (decision.decision, decision.predicted_cached_tokens) == ("cost", 32)
            text = await rp.metrics()
            assert metric(text, "pdstack_proxy_kv_tokenize_seconds_count") == 1


async def test_two_proxies_route_the_same_requests_the_same_way() -> None:
    """Proxy A gets the engines' live batches; proxy B, started after them (a restarted
    proxy, or a replica the engines' PUBs do not reach), only their replays: both route
    200 requests identically."""
    port_a, port_b = free_port(), free_port()
    names = [f"n1/engine-{i}" for i in range(3)]
    async with ph.engines(*names) as e, publishers(names, port_a) as pubs:
        table = ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in names])
        sources = {n: p.replay_endpoint for n, p in pubs.items()}
        slow = {**FAST, "stale_after_s": 30.0}
        async with ph.running_proxy(table, kv_events=KvEventsConfig(
                host="127.0.0.1", port=port_a, sources=sources, **slow)) as a:
            for i in range(30):  # each engine holds 10 prompts
                await pubs[names[i % 3]].store(tokens_of(i))
            await ph.until(lambda: sum(a.proxy.kv_routing.index.stats().get(n, {}).get("gpu", 0)
                                       for n in names) == 120, "A indexed")
            async with ph.running_proxy(table, kv_events=KvEventsConfig(
                    host="127.0.0.1", port=port_b, sources=sources, **slow)) as b:
                await ph.until(lambda: b.proxy.kv_routing.index.stats()
                               == a.proxy.kv_routing.index.stats(), "B replayed")
                for rp in (a, b):
                    await ph.until(lambda rp=rp: all(
                        rp.registry.backends[n].usable
                        and rp.proxy.kv_routing.state(n) == "fresh" for n in names), "fresh")
                chosen: dict[str, list[str]] = {"a": [], "b": []}
                for i in range(200):
                    body = {"model": "fake", "prompt": tokens_of(i % 40), "max_tokens": 1}
                    for key, rp in (("a", a), ("b", b)):
                        async with rp.session.post(rp.url + "/v1/completions", json=body) as r:
                            assert r.status == 200
                            rid = r.headers["X-Request-Id"]
                        decision = next(d for d in rp.proxy.kv_routing.recent
                                        if d.request_id == rid)
                        chosen[key].append(decision.backend)
                assert chosen["a"] == chosen["b"]
                # the held prompts went to their holders
                assert chosen["a"][:30] == [names[i % 3] for i in range(30)]


async def test_a_gap_no_replay_fills_is_counted_and_live_batches_go_on() -> None:
    port = free_port()
    async with publishers(["n/e0"], port) as pubs, subscriber(pubs, port) as sub:
        pub = pubs["n/e0"]
        feed = sub.feeds["n/e0"]
        for _ in range(100):  # until its PUB has (re)connected: a batch arrives live
            await pub.store(tokens_of(0))
            await asyncio.sleep(0.05)
            if feed.batches["live"]:
                break
        await ph.until(lambda: feed.batches["live"] > 0 and not feed.syncing, "live")
        pub.answer_replays = False
        pub.seq += 3  # three batches the proxy never gets
        later = await pub.store(tokens_of(1))
        await ph.until(lambda: sub.index.held("n/e0", later).gpu_blocks == 4, "applied", 5.0)
        assert sub.feeds["n/e0"].batches["lost"] == 3
        more = await pub.store(tokens_of(2))  # and the live stream goes on
        await ph.until(lambda: sub.index.held("n/e0", more).gpu_blocks == 4, "live again")


def test_the_cli_takes_the_kv_events_from_the_backend_table(tmp_path: Any) -> None:
    from pdstack.cli import build_parser
    from pdstack.proxy.cli import backend_table_from_args, config_from_args

    stack = str(Path(__file__).resolve().parents[2] / "compose" / "cpu" / "backends.json")
    env = tmp_path / "empty.env"
    env.write_text("")

    def config(*flags: str) -> KvEventsConfig:
        args = build_parser(only="proxy").parse_args(
            ["proxy", "--backends", stack, "--env-file", str(env), *flags])
        return config_from_args(args, backend_table_from_args(args)).kv_events

    on = config()
    assert on.active and (on.host, on.port, on.hash_seed) == ("127.0.0.1", 5557, "0")
    assert on.sources == {"local/prefill-0": "tcp://127.0.0.1:5500",
                          "local/decode-0": "tcp://127.0.0.1:5501",
                          "local/decode-1": "tcp://127.0.0.1:5502"}
    assert not config("--kv-events", "off").active
    assert (on.pending_s, on.miss_weight) == (10.0, 8.0)
    tuned = config("--kv-pending-s", "0", "--kv-miss-weight", "1.5", "--kv-headroom", "cost")
    assert (tuned.pending_s, tuned.miss_weight, tuned.headroom) == (0.0, 1.5, "cost")
    assert on.headroom == "filter"
    with pytest.raises(SystemExit):
        config("--kv-headroom", "open")
    for flag in ("--kv-pending-s", "--kv-miss-weight"):
        for bad in ("-1", "inf", "nan"):  # inf x a full hit's 0 miss: no engine is cheapest
            with pytest.raises(SystemExit,
                               match=f"{flag} must be a finite number >= 0, got {float(bad)}"):
                config(flag, bad)


async def test_pd_picks_the_decoder_holding_the_prompt() -> None:
    port = free_port()
    pre, dec = ["n1/prefill-0"], ["n1/decode-0", "n1/decode-1"]
    async with ph.engines(*pre, *dec) as e, publishers(dec, port) as pubs:
        table = ph.pd_table(e, pre, dec)
        kv = routing_config(port, pubs)
        async with ph.running_proxy(table, kv_events=kv) as rp:
            await ph.until(lambda: all(b.usable for b in rp.registry.backends.values()), "up")

            async def send(tokens: list[int]) -> list[str]:
                await complete(rp, tokens, max_tokens=2)
                return served({n: e[n] for n in dec}, tokens)

            # events missing: the least loaded decoder (as before)
            [default] = await send(tokens_of(1))
            other = next(d for d in dec if d != default)
            held = tokens_of(2)
            await pubs[other].store(held)  # a conversation's earlier turn decoded there
            await pubs[default].store(tokens_of(999))
            await ph.until(lambda: all(rp.proxy.kv_routing.state(n) == "fresh" for n in dec),
                           "fresh")
            assert await send(held) == [other]
            assert len(await send(tokens_of(3))) == 1  # nobody holds it: load decides
            text = await rp.metrics()
            assert metric(text, "pdstack_proxy_kv_decoder_route_total", decision="cost") == 2
            assert metric(text, "pdstack_proxy_kv_decoder_route_total", decision="load") == 1


async def test_pd_chat_is_tokenized_once_by_a_prefiller() -> None:
    port = free_port()
    pre, dec = ["n1/prefill-0"], ["n1/decode-0", "n1/decode-1"]
    async with ph.engines(*pre, *dec) as e, publishers([*pre, *dec], port) as pubs:
        kv = routing_config(port, pubs)
        async with ph.running_proxy(ph.pd_table(e, pre, dec), kv_events=kv) as rp:
            await ph.until(lambda: all(b.usable for b in rp.registry.backends.values()), "up")
            for p in pubs.values():
                await p.store(tokens_of(999))
            await ph.until(lambda: all(rp.proxy.kv_routing.state(n) == "fresh" for n in pubs),
                           "fresh")
            body = {"model": "fake", "max_tokens": 2, "messages": [
                {"role": "user", "content": " ".join(f"w{k}" for k in range(40))}]}
            async with rp.session.post(rp.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
            assert [n for n in e if e[n].seen("/tokenize")] == pre
            text = await rp.metrics()
            assert metric(text, "pdstack_proxy_kv_tokenize_seconds_count") == 1
            assert metric(text, "pdstack_proxy_kv_decoder_route_total", decision="cost") == 1


async def test_one_engine_costs_nothing_no_tokenize_no_route_decision() -> None:
    """With one usable engine there is nothing to choose: a chat request is not tokenized
    (no extra round trip before its first byte) and no routing decision is counted."""
    port = free_port()
    names = ["n1/engine-0"]
    async with ph.engines(*names) as e, publishers(names, port) as pubs:
        table = ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in names])
        kv = routing_config(port, pubs)
        async with ph.running_proxy(table, kv_events=kv) as rp:
            await ph.until(lambda: all(b.usable for b in rp.registry.backends.values()), "up")
            await pubs[names[0]].store(tokens_of(1))
            await ph.until(lambda: rp.proxy.kv_routing.state(names[0]) == "fresh", "fresh")
            body = {"model": "fake", "max_tokens": 1,
                    "messages": [{"role": "user", "content": "one engine, " * 40}]}
            async with rp.session.post(rp.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
            assert not e[names[0]].seen("/tokenize")
            text = await rp.metrics()
            assert metric(text, "pdstack_proxy_kv_tokenize_seconds_count") == 0


@pytest.mark.parametrize("headroom", ["filter", "cost"])
async def test_a_full_holder_loses_its_prompt_only_with_the_headroom_filter(
    headroom: str,
) -> None:
    """The gate open on engine-0 only (engine-1's KV past the mark, a request on it), and
    engine-1 holding the prompt: ``--kv-headroom filter`` (the default) sends the prompt to
    engine-0, to compute again; ``cost`` keeps it on its holder (64 tokens of wait against
    8 x 64 to compute: ``cost_no_headroom``)."""
    capacity = 1024  # tokens of KV per fake engine
    gate = AdmissionConfig(enabled=True, kv_high=0.8, scrape_interval_s=0.05,
                           scrape_idle_interval_s=0.05, stale_after_s=30.0)
    port = free_port()
    names = ["n1/engine-0", "n1/engine-1"]
    prompt = tokens_of(7)
    async with (
        ph.engines(*names, kv_capacity_tokens=capacity, output_tokens=2) as e,
        publishers(names, port) as pubs,
    ):
        table = ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in names])
        kv = dataclasses.replace(routing_config(port, pubs), headroom=headroom)
        async with ph.running_proxy(table, kv_events=kv, admission=gate) as rp:
            reg, admission = rp.registry, rp.proxy.admission
            await ph.until(lambda: all(reg.backends[n].usable for n in names), "up")
            await pubs[names[1]].store(prompt)
            await pubs[names[0]].store(tokens_of(999))
            await ph.until(lambda: all(rp.proxy.kv_routing.state(n) == "fresh"
                                       for n in names), "fresh")
            # engine-1 busy (a request that hangs after its first token) and past the mark
            reg.backends[names[0]].drained = True
            e[names[1]].faults = Faults(hang_after_chunks=1, times=1)
            busy = asyncio.create_task(ph.stream_completion(
                rp.session, rp.url, "busy " * 20, max_tokens=4))
            try:
                await ph.until(lambda: e[names[1]].running > 0, "engine-1 busy")
                reg.backends[names[0]].drained = False
                e[names[1]].kv_held_tokens = capacity - 64
                await ph.until(lambda: (load := admission.loads.get(names[1])) is not None
                               and load.kv_usage >= 0.9 and load.base, "engine-1 full")
                assert admission.open_among(list(reg.backends.values()), 64) == [
                    reg.backends[names[0]]]
                await complete(rp, prompt, max_tokens=1)
            finally:
                await ph.cancel([busy])
            text = await rp.metrics()
    if headroom == "filter":
        assert served(e, prompt) == [names[0]]
        assert metric(text, "pdstack_proxy_kv_route_total", decision="cost_no_headroom") == 0
    else:
        assert served(e, prompt) == [names[1]]
        assert metric(text, "pdstack_proxy_kv_route_total", decision="cost_no_headroom") == 1
