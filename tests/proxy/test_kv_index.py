"""The KV-event index, its block hashes and the cost policy (issue 56), without engines.

Parity with vLLM: ``data/kv_events_vllm.json`` holds block hashes and encoded event batches
made by vLLM's own code (``kv_events_fixture.py`` under the vLLM venv; the vllm-marked test
below makes them again and compares)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pdstack.proxy.backends import BackendState
from pdstack.proxy.kv_events import decode_batch
from pdstack.proxy.kv_index import (
    CPU,
    GPU,
    HashScheme,
    Held,
    KvIndex,
    block_hashes,
    external_hash,
)
from pdstack.proxy.routing import pick_by_cost, stable_hash
from pdstack.testing import vllm_engines as ve

DATA = Path(__file__).parent / "data" / "kv_events_vllm.json"
FIXTURE = json.loads(DATA.read_text())


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: f"{c['block_size']}-"
                         f"{c['salt']}-{'tagged' if c['tagged'] else 'bare'}")
def test_block_hashes_equal_vllms(case: dict) -> None:
    scheme = HashScheme(FIXTURE["vllm_seed"], case["tagged"])
    got = block_hashes(case["tokens"], case["block_size"], scheme, case["salt"])
    assert got == case["hashes"]
    assert len(got) == len(case["tokens"]) // case["block_size"]  # full blocks only


def test_another_seed_gives_other_hashes() -> None:
    case = FIXTURE["cases"][0]
    assert block_hashes(case["tokens"], case["block_size"], HashScheme("1")) != case["hashes"]


def test_bytes_hashes_fold_to_the_events_int() -> None:
    raw = bytes(range(32))
    assert external_hash(raw) == int.from_bytes(raw[-8:], "big")
    assert external_hash(2**70 + 5) == 5


def _apply_all(index: KvIndex, name: str, hexes: list[str]) -> None:
    for h in hexes:
        for event in decode_batch(bytes.fromhex(h)).events:
            index.apply(name, event)


def test_vllm_batches_build_the_index_by_tier_and_verify_the_scheme() -> None:
    index = KvIndex(seed="0")
    h = FIXTURE["gpu_hashes"]
    _apply_all(index, "e1", FIXTURE["batches"][:1])
    eng = index.engines["e1"]
    assert eng.block_size == 16
    # the first-block events matched: seed 0 and the tagged salt (vLLM 0.32)
    assert eng.scheme == HashScheme("0", salt_tagged=True) and eng.salt_known
    assert index.held("e1", h) == Held(3, 0, 16)
    assert index.schemes_for("e1", salted=True) == [HashScheme("0", True)]
    # batch 2: blocks 3-4 offloaded to the CPU tier, block 2 evicted from the GPU
    _apply_all(index, "e1", FIXTURE["batches"][1:2])
    assert index.held("e1", h) == Held(2, 0, 16)  # the chain breaks at the evicted block
    assert index.stats()["e1"] == {"gpu": 3, "cpu": 2}
    # batch 3: reset_prefix_cache clears the GPU tier only
    _apply_all(index, "e1", FIXTURE["batches"][2:])
    assert index.held("e1", h) == Held(0, 0, 16)
    assert index.stats()["e1"] == {"cpu": 2}


class _Stored:
    """A BlockStored as the index reads it (attribute names are vLLM's)."""

    def __init__(self, hashes: list[int], tokens: list[int], medium: str | None = GPU,
                 parent: int | None = None, extra: list | None = None) -> None:
        self.block_hashes = hashes
        self.parent_block_hash = parent
        self.token_ids = tokens
        self.block_size = 16
        self.medium = medium
        self.extra_keys = extra


_Stored.__name__ = "BlockStored"


def test_cpu_tier_continues_the_gpu_prefix() -> None:
    tokens = list(range(80))
    h = block_hashes(tokens, 16, HashScheme("0"))
    index = KvIndex(seed="0")
    index.apply("e", _Stored(h[:2], tokens[:32]))
    index.apply("e", _Stored(h[1:4], tokens[16:64], CPU, parent=h[0]))
    assert index.held("e", h) == Held(2, 2, 16)
    assert index.held("e", h).tokens == 64
    assert index.held("other", h) == Held(0, 0, 0)


def test_an_engine_hashing_otherwise_is_unverified() -> None:
    tokens = list(range(16))
    index = KvIndex(seed="0")
    foreign = block_hashes(tokens, 16, HashScheme("a random per-process seed"))
    for _ in range(3):
        index.apply("e", _Stored(foreign, tokens))
    eng = index.engines["e"]
    assert eng.scheme is None and eng.unverified
    assert index.schemes_for("e", salted=False) == []
    # vLLM 0.32 without PYTHONHASHSEED: its fixed default seed is recognised
    index.apply("f", _Stored(block_hashes(tokens, 16, HashScheme("vllm-none-hash")), tokens))
    assert index.engines["f"].scheme == HashScheme("vllm-none-hash", True)


def test_a_bare_salt_means_vllm_026() -> None:
    tokens = list(range(16))
    bare = block_hashes(tokens, 16, HashScheme("0", salt_tagged=False), "s")
    index = KvIndex(seed="0")
    index.apply("e", _Stored(bare, tokens, extra=[["s"]]))
    assert index.engines["e"].scheme == HashScheme("0", salt_tagged=False)
    assert index.engines["e"].salt_known


def test_unsalted_engine_tries_both_salt_forms() -> None:
    tokens = list(range(16))
    index = KvIndex(seed="0")
    index.apply("e", _Stored(block_hashes(tokens, 16, HashScheme("0")), tokens))
    assert set(index.schemes_for("e", salted=True)) == {HashScheme("0", True),
                                                         HashScheme("0", False)}


def test_index_is_bounded_oldest_first() -> None:
    index = KvIndex(seed="0", capacity=10)
    index.apply("e", _Stored(list(range(100, 125)), [], parent=1))
    tier = index.engines["e"].tiers[GPU]
    assert len(tier) == 10 and list(tier) == list(range(115, 125))


def test_clear_keeps_what_was_learnt_about_hashing() -> None:
    tokens = list(range(16))
    index = KvIndex(seed="0")
    h = block_hashes(tokens, 16, HashScheme("0"))
    index.apply("e", _Stored(h, tokens))
    index.clear("e")
    assert index.held("e", h).tokens == 0
    assert index.engines["e"].scheme is not None


def _b(name: str, in_flight: int = 0, held: int = 0) -> BackendState:
    return BackendState(name=name, role="colocated", node="n", url="http://x",
                        healthy=True, in_flight=in_flight, engine_held=held)


def test_cost_prefers_the_engine_holding_the_prompt() -> None:
    a, b = _b("a"), _b("b")
    chosen, miss = pick_by_cost([(a, Held(0, 0, 16)), (b, Held(6, 0, 16))], 100, 0.25, {},
                                miss_weight=1.0)
    assert chosen is b and miss == 4


def test_cost_counts_a_cpu_hit_as_its_load_share() -> None:
    a, b = _b("a"), _b("b")
    # a: 64 tokens in its CPU tier (load 0.25 x 64 + 36 computed = 52); b: 32 on its GPU
    # (68 computed)
    chosen, miss = pick_by_cost([(b, Held(2, 0, 16)), (a, Held(0, 4, 16))], 100, 0.25, {},
                                miss_weight=1.0)
    assert chosen is a and miss == pytest.approx(52.0)
    # 48 on its GPU (52 computed) ties with a: ring order (b first) decides
    chosen, _ = pick_by_cost([(b, Held(3, 0, 16)), (a, Held(0, 4, 16))], 100, 0.25, {},
                             miss_weight=1.0)
    assert chosen is b


def test_cost_spills_when_prefills_queue_on_the_holder_and_ties_keep_ring_order() -> None:
    holder, idle = _b("holder"), _b("idle")
    # holder: 4 tokens to compute, 120 queued ahead; idle: 100 to compute
    chosen, _ = pick_by_cost([(holder, Held(6, 0, 16)), (idle, Held(0, 0, 16))], 100, 0.25,
                             {"holder": 120.0}, miss_weight=1.0)
    assert chosen is idle
    # the engine's own count at its last scrape (a burst since finished) is no load
    chosen, _ = pick_by_cost([(_b("x", held=10), Held(6, 0, 16)), (idle, Held(0, 0, 16))],
                             100, 0.25, {}, miss_weight=1.0)
    assert chosen.name == "x"
    first, second = _b("first"), _b("second")
    chosen, _ = pick_by_cost([(first, Held(0, 0, 16)), (second, Held(0, 0, 16))], 100, 0.25, {},
                             miss_weight=1.0)
    assert chosen is first


def test_decoding_requests_do_not_break_affinity() -> None:
    """Issue 56 run 1 (one H100, three engines): counting every request in flight as a
    prefill sent a prompt away from the engine holding it whenever a few more streams were
    decoding there, and the engines' hit ratio fell to 0.42-0.47 (a sticky router: 0.57-0.70).
    In-flight requests whose prompt was answered cost nothing; the holder keeps it."""
    busy, idle = _b("busy", in_flight=30, held=30), _b("idle", in_flight=2, held=2)
    chosen, miss = pick_by_cost([(idle, Held(0, 0, 16)), (busy, Held(180, 0, 16))], 3000,
                                0.25, {}, miss_weight=1.0)
    assert chosen is busy and miss == 3000 - 180 * 16


@pytest.mark.vllm
def test_fixture_is_what_the_installed_vllm_makes() -> None:
    ve.require_venv()
    script = Path(__file__).parent / "kv_events_fixture.py"
    out = subprocess.run([str(ve.VENV / "bin" / "python"), str(script)], capture_output=True,
                         text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == FIXTURE


def test_a_hot_prefix_holder_takes_at_most_its_bounded_share() -> None:
    from prometheus_client import CollectorRegistry

    from pdstack.proxy.kv_events_route import KvEventsConfig, KvRouting, RequestBlocks
    from pdstack.proxy.routing import HashRing

    routing = KvRouting(KvEventsConfig(enabled=False), lambda: None, dict, CollectorRegistry())
    routing.state = lambda name: "fresh"  # type: ignore[method-assign]
    tokens = list(range(64))
    scheme = HashScheme("0")
    h = block_hashes(tokens, 16, scheme)
    routing.index.apply("a", _Stored(h, tokens))
    for name in ("b", "c"):
        routing.index.apply(name, _Stored(block_hashes([9] * 16, 16, scheme), [9] * 16))
    blocks = RequestBlocks(64, {(scheme, 16): h})
    ring = HashRing(["a", "b", "c"])
    backends = {n: _b(n) for n in "abc"}
    assert routing.pick(ring, 1, backends, 1.25, blocks).name == "a"  # type: ignore[union-attr]
    backends["a"].in_flight = 5  # bound: ceil(1.25 x 6 / 3) = 3
    chosen = routing.pick(ring, 1, backends, 1.25, blocks)
    assert chosen is not None and chosen.name != "a"


def test_prompts_queue_on_their_engine_until_their_first_byte() -> None:
    """The router's load is the prompt tokens it sent an engine that it has not answered:
    a burst of new prompts spreads (each queued miss costs the next), a prompt whose holder
    has only decoding streams goes to the holder, and a request's share leaves at its first
    byte (or end; twice is harmless). With ``unheld_home`` off: the cost decides among
    engines that hold none of a prompt (the next test has the default)."""
    from prometheus_client import CollectorRegistry

    from pdstack.proxy.kv_events_route import KvEventsConfig, KvRouting, RequestBlocks
    from pdstack.proxy.routing import HashRing

    config = KvEventsConfig(enabled=False, unheld_home=False)
    routing = KvRouting(config, lambda: None, dict, CollectorRegistry())
    routing.state = lambda name: "fresh"  # type: ignore[method-assign]
    scheme = HashScheme("0")
    for name in ("a", "b"):  # each engine has announced its block size (nothing useful held)
        routing.index.apply(name, _Stored(block_hashes([7] * 16, 16, scheme), [7] * 16))
    ring = HashRing(["a", "b"])
    backends = {n: _b(n) for n in "ab"}

    def blocks(seed: int) -> RequestBlocks:
        tokens = [seed] * 64
        return RequestBlocks(64, {(scheme, 16): block_hashes(tokens, 16, scheme)})

    first = routing.pick(ring, 1, backends, 10.0, blocks(1), "r1")
    assert first is not None and routing.queued_tokens[first.name] == 64
    second = routing.pick(ring, 1, backends, 10.0, blocks(2), "r2")
    assert second is not None and second.name != first.name  # 64 queued on the first
    routing.prefilled("r1")
    routing.prefilled("r1")
    assert routing.queued_tokens[first.name] == 0 and routing.queued_tokens[second.name] == 64
    # the first engine now holds prompt 1 and streams 20 answers: a repeat still goes there
    routing.index.apply(first.name, _Stored(blocks(1).hashes[(scheme, 16)], [1] * 64))
    backends[first.name].in_flight = 20
    again = routing.pick(ring, 1, backends, 10.0, blocks(1), "r3")
    assert again is first and routing.queued_tokens[first.name] == 0  # a full hit: 0 to compute


def test_a_prompt_no_engine_holds_goes_to_its_ring_home() -> None:
    """A prompt no engine holds (none of it, or only a first block every engine has): the
    ring's home under the load bound, whatever is queued where (``ring_unheld``); an engine
    holding it, or all of them: the cost, as before (a hot prefix held everywhere spreads
    by what is queued). Past capacity, least-queued spread every evicted prefix
    over every engine (routing run 3: hit ratio 0.46 vs cache_aware's 0.64)."""
    from prometheus_client import CollectorRegistry

    from pdstack.proxy.kv_events_route import KvEventsConfig, KvRouting, RequestBlocks
    from pdstack.proxy.routing import HashRing

    routing = KvRouting(KvEventsConfig(enabled=False), lambda: None, dict, CollectorRegistry())
    routing.state = lambda name: "fresh"  # type: ignore[method-assign]
    scheme = HashScheme("0")
    template = [5] * 16  # a first block every prompt starts with (a chat template's)
    for name in ("a", "b", "c"):
        routing.index.apply(name, _Stored(block_hashes(template, 16, scheme), template))
    ring = HashRing(["a", "b", "c"])
    home = next(iter(ring.walk(7)))
    backends = {n: _b(n) for n in "abc"}

    def blocks(seed: int) -> RequestBlocks:
        tokens = template + [seed] * 144
        return RequestBlocks(160, {(scheme, 16): block_hashes(tokens, 16, scheme)})

    routing.queued_tokens[home] = 10_000.0  # its queue is the longest by far
    for i in range(3):  # three new prompts of one key: one home (pending marks or not)
        assert routing.pick(ring, 7, backends, 10.0, blocks(i), f"n{i}") is backends[home]
    assert [d.decision for d in routing.recent][-3:] == ["ring_unheld"] * 3
    # another engine holds the prompt: the cost sends it there
    other = next(n for n in "abc" if n != home)
    tokens = template + [9] * 144
    routing.index.apply(other, _Stored(block_hashes(tokens, 16, scheme)[1:], tokens[16:],
                                       parent=block_hashes(template, 16, scheme)[0]))
    assert routing.pick(ring, 7, backends, 10.0, blocks(9), "h") is backends[other]
    assert routing.recent[-1].decision == "cost"
    # every engine holds it (a hot prefix): the cost spreads it by what is queued
    hot = template + [11] * 144
    for name in "abc":
        routing.index.apply(name, _Stored(block_hashes(hot, 16, scheme)[1:], hot[16:],
                                          parent=block_hashes(template, 16, scheme)[0]))
    chosen = routing.pick(ring, 7, backends, 10.0, blocks(11), "hot")
    assert chosen is not None and chosen.name != home  # home's queue is the longest
    assert routing.recent[-1].decision == "cost"
    # one fresh candidate: no choice to make, the cost's answer
    routing.state = lambda name: "fresh" if name == home else "missing"  # type: ignore
    assert routing.pick(ring, 7, backends, 10.0, blocks(30), "one") is backends[home]
    assert routing.recent[-1].decision == "cost"
    routing.state = lambda name: "fresh"  # type: ignore[method-assign]
    # the home at its load bound: the next one in ring order
    backends[home].in_flight = 9  # bound: ceil(1.25 x 10 / 3) = 5
    chosen = routing.pick(ring, 7, backends, 1.25, blocks(20), "b")
    assert chosen is not None and chosen.name == next(n for n in ring.walk(7) if n != home)


def test_routed_blocks_count_as_held_until_events_tell_or_they_lapse() -> None:
    tokens = list(range(64))
    h = block_hashes(tokens, 16, HashScheme("0"))
    index = KvIndex(seed="0")
    index.apply("e", _Stored(h[:1], tokens[:16]))  # e holds block 0
    index.route("e", h, now=100.0, ttl=10.0)
    assert index.engines["e"].pending == {h[1]: 110.0, h[2]: 110.0, h[3]: 110.0}
    assert index.held("e", h, now=105.0) == Held(4, 0, 16)
    assert index.held("e", h) == Held(1, 0, 16)  # without a clock: only what events told
    assert index.held("e", h, now=110.0) == Held(1, 0, 16)  # lapsed
    # its events tell of blocks 1-2 (stored) and 3 (evicted at once): the marks go
    index.apply("e", _Stored(h[1:3], tokens[16:48], parent=h[0]))
    removed = type("BlockRemoved", (), {"block_hashes": [h[3]], "medium": GPU})()
    index.apply("e", removed)
    assert index.engines["e"].pending == {}
    assert index.held("e", h, now=105.0) == Held(3, 0, 16)
    # a restart forgets them with the rest; an unknown engine is not marked
    index.route("e", h, now=200.0, ttl=10.0)
    index.clear("e")
    assert index.engines["e"].pending == {}
    index.route("other", h, now=200.0, ttl=10.0)
    assert "other" not in index.engines


def test_pending_marks_are_bounded_and_lapsed_ones_go_first() -> None:
    index = KvIndex(seed="0", capacity=4)
    index.apply("e", _Stored([1], list(range(16))))
    index.route("e", [10, 11, 12], now=0.0, ttl=5.0)
    index.route("e", [20, 21], now=6.0, ttl=5.0)  # 10-12 lapsed at 5
    assert list(index.engines["e"].pending) == [20, 21]
    index.route("e", [30, 31, 32, 33], now=7.0, ttl=5.0)  # over capacity: oldest out
    assert list(index.engines["e"].pending) == [30, 31, 32, 33]


def test_cost_miss_weight_keeps_a_prefix_on_its_holder_behind_a_queue() -> None:
    holder, idle = _b("holder"), _b("idle")
    costed = [(idle, Held(0, 0, 16)), (holder, Held(6, 0, 16))]
    # holder: 4 to compute behind 120 queued (124) against idle's 100 (weight 1: idle)
    assert pick_by_cost(costed, 100, 0.25, {"holder": 120.0}, miss_weight=1.0)[0] is idle
    # a miss weighs twice (it is also paid by every prompt queued behind it): holder
    assert pick_by_cost(costed, 100, 0.25, {"holder": 120.0}, miss_weight=2.0)[0] is holder


def test_a_burst_of_one_new_prefix_follows_its_first_request() -> None:
    """Issue 56: a new prefix's blocks reach the index only once its first request's
    prefill has computed them; meanwhile a second request with it found no holder and, its
    first request's tokens queued on that engine, went to another engine and computed the
    prefix again (every request of a burst did). Routed blocks count as held there until
    the events tell: the burst stays on one engine. With ``pending_s`` 0 it does not (the
    cost deciding among equals); the ring home for a prompt nobody holds keeps it too."""
    from prometheus_client import CollectorRegistry

    from pdstack.proxy.kv_events_route import KvEventsConfig, KvRouting, RequestBlocks
    from pdstack.proxy.routing import HashRing

    scheme = HashScheme("0")
    prefix = list(range(1000, 1000 + 160))

    def burst(pending_s: float, unheld_home: bool = False) -> list[str]:
        config = KvEventsConfig(enabled=False, pending_s=pending_s, unheld_home=unheld_home)
        routing = KvRouting(config, lambda: None, dict, CollectorRegistry())
        routing.state = lambda name: "fresh"  # type: ignore[method-assign]
        for name in ("a", "b", "c"):
            routing.index.apply(name, _Stored(block_hashes([7] * 16, 16, scheme), [7] * 16))
        ring = HashRing(["a", "b", "c"])
        backends = {n: _b(n) for n in "abc"}
        chosen = []
        for i in range(3):  # the shared prefix + 16 tokens of its own, none answered yet
            tokens = prefix + [i] * 16
            blocks = RequestBlocks(len(tokens), {(scheme, 16): block_hashes(tokens, 16, scheme)})
            b = routing.pick(ring, 1, backends, 10.0, blocks, f"r{i}")
            assert b is not None
            backends[b.name].in_flight += 1
            chosen.append(b.name)
        return chosen

    assert len(set(burst(10.0))) == 1
    assert len(set(burst(0.0))) == 3
    assert len(set(burst(0.0, unheld_home=True))) == 1


def test_a_holder_without_kv_headroom_keeps_its_prefix_only_by_cost() -> None:
    """``--kv-headroom cost``: the engine holding a prompt but without KV headroom for it
    (the gate's ``closed``) stays a candidate costed the whole prompt's tokens more: it
    keeps the prompt while computing it elsewhere costs more (a miss weighs 8), loses it to
    an open engine that holds it too, and a prompt no engine holds goes to the first *open*
    engine in ring order (``ring_unheld``), not to a closed ring home."""
    from prometheus_client import CollectorRegistry

    from pdstack.proxy.kv_events_route import KvEventsConfig, KvRouting, RequestBlocks
    from pdstack.proxy.routing import HashRing

    routing = KvRouting(KvEventsConfig(enabled=False, headroom="cost"), lambda: None, dict,
                        CollectorRegistry())
    routing.state = lambda name: "fresh"  # type: ignore[method-assign]
    scheme = HashScheme("0")
    ring = HashRing(["a", "b", "c"])
    backends = {n: _b(n) for n in "abc"}
    tokens = [3] * 160

    def blocks(prompt: list[int]) -> RequestBlocks:
        return RequestBlocks(len(prompt), {(scheme, 16): block_hashes(prompt, 16, scheme)})

    order = list(ring.walk(7))
    holder = order[-1]  # the last in ring order: ties would never pick it
    routing.index.apply(holder, _Stored(block_hashes(tokens, 16, scheme), tokens))
    # the holder has no headroom: 160 tokens more to it, 8 x 160 to compute elsewhere
    chosen = routing.pick(ring, 7, backends, 10.0, blocks(tokens), "r1",
                          closed=frozenset({holder}))
    assert chosen is backends[holder] and routing.recent[-1].decision == "cost_no_headroom"
    routing.prefilled("r1")
    # another engine (open) holds it too: that one, with no wait
    other = order[0]
    routing.index.apply(other, _Stored(block_hashes(tokens, 16, scheme), tokens))
    chosen = routing.pick(ring, 7, backends, 10.0, blocks(tokens), "r2",
                          closed=frozenset({holder}))
    assert chosen is backends[other] and routing.recent[-1].decision == "cost"
    routing.prefilled("r2")
    # a prompt nobody holds, its ring home closed: the first open one in ring order
    new = [4] * 160
    chosen = routing.pick(ring, 7, backends, 10.0, blocks(new), "r3",
                          closed=frozenset({order[0]}))
    assert chosen is backends[order[1]] and routing.recent[-1].decision == "ring_unheld"
    # events not fresh: the hash ring's pick among the engines with headroom
    routing.state = lambda name: "stale"  # type: ignore[method-assign]
    keys = (stable_hash(f"key {i}") for i in range(200))
    homed = [k for k in keys if next(iter(ring.walk(k))) == holder][:4]
    assert homed, "no key whose ring home is the holder: the check proves nothing"
    for k in homed:
        chosen = routing.pick(ring, k, backends, 10.0, blocks(tokens), f"s{k}",
                              closed=frozenset({holder}))
        assert chosen is not None and chosen.name != holder
    routing.state = lambda name: "fresh"  # type: ignore[method-assign]
    # without ``closed`` (the filter's callers pass none): the cost alone
    routing.prefilled("r3")
    chosen = routing.pick(ring, 7, backends, 10.0, blocks(tokens), "r4")
    assert chosen is backends[other]

