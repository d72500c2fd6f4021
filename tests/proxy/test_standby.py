"""Warm standbys (issue 55, :mod:`pdstack.proxy.standby`): a standby engine gets no request
while every active engine of its role and generation is usable, takes them at once when one
is not (with no client error: a request's failed try lets its retry reach the standby
before the ejection), and gets none again once the active engine is re-admitted."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pdstack.proxy.backends import BackendRegistry, BackendState
from pdstack.proxy.standby import check_standbys, rotation
from pdstack.testing import proxy_harness as ph
from pdstack.testing.cases import named_cases
from pdstack.testing.fake_engine import FakeEngine

COMPLETIONS = "/v1/completions"
FAST = {"health_interval_s": 0.1, "readmit_interval_s": 0.05, "readmit_after": 2}


def _standby(entry: dict) -> dict:
    return {**entry, "standby": True}


def _served(e: dict[str, FakeEngine], name: str) -> int:
    return len(e[name].seen(COMPLETIONS))


async def _ready(rp: ph.RunningProxy, *names: str) -> None:
    await ph.until(lambda: all(rp.registry.backends[n].usable for n in names),
                   f"{names} admitted", timeout=10)


async def _burst(rp: ph.RunningProxy, n: int, tag: str) -> list[ph.StreamResult]:
    return [await ph.stream_completion(rp.session, rp.url, f"{tag} {i}", max_tokens=4)
            for i in range(n)]


def _all_ok(results: list[ph.StreamResult]) -> bool:
    return all(r.status == 200 and r.events[-1] == "[DONE]" and not r.error_events
               for r in results)


async def _back(rp: ph.RunningProxy, e: dict[str, FakeEngine], active: str, standby: str,
                n: int) -> tuple[int, int]:
    """``active`` starts again and is re-admitted; then ``n`` requests: how many each of
    ``active`` and ``standby`` served."""
    await e[active].start()
    await _ready(rp, active)
    e[active].requests.clear()
    e[standby].requests.clear()
    assert _all_ok(await _burst(rp, n, "after"))
    return _served(e, active), _served(e, standby)


# ------------------------------------------------------------------ colocated


async def test_colocated_standby_takes_over_and_steps_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="pdstack.proxy")
    async with ph.engines("e0", "s0") as e:
        t = ph.table("colocated", [ph.backend("e0", "colocated", e["e0"]),
                                   _standby(ph.backend("s0", "colocated", e["s0"]))])
        async with ph.running_proxy(t, **FAST) as rp:
            await _ready(rp, "e0", "s0")  # the standby is probed and known healthy
            # 1. every active engine usable: all to it, none to the standby
            assert _all_ok(await _burst(rp, 8, "before"))
            assert (_served(e, "e0"), _served(e, "s0")) == (8, 0)
            text = await rp.metrics()
            assert ph.metric_value(text, "pdstack_proxy_backend_in_rotation", backend="e0") == 1
            assert ph.metric_value(text, "pdstack_proxy_backend_in_rotation", backend="s0") == 0

            # 2. the active engine dies: the very next request is served (its retry reaches
            # the standby before e0's ejection), and so is every one after
            await e["e0"].kill()
            during = await _burst(rp, 8, "during")
            assert _all_ok(during), [r.text for r in during if r.status != 200]
            assert _served(e, "s0") == 8
            await ph.until(lambda: rp.registry.backends["e0"].state == "ejected", "e0 ejected")
            s0 = rp.registry.backends["s0"]
            assert s0.stands_in_for == "e0"
            text = await rp.metrics()
            assert ph.metric_value(text, "pdstack_proxy_backend_in_rotation", backend="s0") == 1
            assert ph.metric_value(text, "pdstack_proxy_backend_in_rotation", backend="e0") == 0
            assert ph.metric_value(text, "pdstack_proxy_requests_total", outcome="ok") == 16

            # 3. the active engine is back (re-admitted): new requests go to it, none to s0
            assert await _back(rp, e, "e0", "s0", 8) == (8, 0)
            assert s0.stands_in_for == ""
            text = await rp.metrics()
            assert ph.metric_value(text, "pdstack_proxy_backend_in_rotation", backend="s0") == 0
    logged = [r.getMessage() for r in caplog.records]
    assert any("standby s0 in rotation: stands in for e0" in m for m in logged), logged
    assert any("standby s0 out of rotation: e0 is back" in m for m in logged), logged


async def test_standby_stream_finishes_after_the_active_is_back() -> None:
    """A stream the standby serves when the active engine comes back ends on the standby,
    whole; only new requests go back to the active one."""
    async with ph.engines("e0", "s0", output_tokens=30, itl_ms=40) as e:
        t = ph.table("colocated", [ph.backend("e0", "colocated", e["e0"]),
                                   _standby(ph.backend("s0", "colocated", e["s0"]))])
        async with ph.running_proxy(t, **FAST) as rp:
            await _ready(rp, "e0", "s0")
            await e["e0"].kill()
            await ph.until(lambda: not rp.registry.backends["e0"].usable, "e0 out")
            long = asyncio.create_task(
                ph.stream_completion(rp.session, rp.url, "long one", max_tokens=30))
            await ph.until(lambda: e["s0"].running == 1, "the stream on s0")
            await e["e0"].start()
            await _ready(rp, "e0")
            assert rp.registry.backends["s0"].in_flight == 1  # still streaming there
            short = await ph.stream_completion(rp.session, rp.url, "new one", max_tokens=4)
            res = await long
    assert res.status == 200 and res.events[-1] == "[DONE]" and not res.error_events
    assert len(ph.completion_text(res.events).split()) == 30
    assert short.status == 200 and _served(e, "e0") == 1 and _served(e, "s0") == 1


async def test_two_actives_and_a_standby() -> None:
    """Two active engines and a standby: the standby gets nothing while both serve; a
    request's failed try on one makes the standby a candidate for that request's retry
    only (the caller drops the tried engine itself), not the registry's rotation."""
    async with ph.engines("e0", "e1", "s0") as e:
        t = ph.table("colocated", [ph.backend("e0", "colocated", e["e0"]),
                                   ph.backend("e1", "colocated", e["e1"]),
                                   _standby(ph.backend("s0", "colocated", e["s0"]))])
        async with ph.running_proxy(t, **FAST) as rp:
            await _ready(rp, "e0", "e1", "s0")
            assert _all_ok(await _burst(rp, 12, "x"))
            assert _served(e, "s0") == 0 and _served(e, "e0") + _served(e, "e1") == 12
            names = {b.name for b in rp.registry.by_role("colocated")}
            assert names == {"e0", "e1"}
            # one request's failed try on e0 makes s0 its stand-in, for that request only
            assert {b.name for b in rp.registry.by_role("colocated", out={"e0"})} == \
                {"e0", "e1", "s0"}
            assert rp.registry.backends["s0"].stands_in_for == ""


# ------------------------------------------------------------------ P/D


async def test_standby_decoder_takes_a_dead_decoders_pairing() -> None:
    async with ph.engines("p0", "d0", "d1") as e:
        t = ph.table("nixl", [ph.backend("p0", "prefill", e["p0"]),
                              ph.backend("d0", "decode", e["d0"]),
                              _standby(ph.backend("d1", "decode", e["d1"]))])
        async with ph.running_proxy(t, **FAST) as rp:
            reg = rp.registry
            await _ready(rp, "p0", "d0", "d1")
            p0 = reg.backends["p0"]
            assert [d.name for d, _ in reg.decoders_for(p0)] == ["d0"]
            assert _all_ok(await _burst(rp, 6, "before"))
            assert (_served(e, "d0"), _served(e, "d1")) == (6, 0)

            await e["d0"].kill()
            during = await _burst(rp, 6, "during")
            assert _all_ok(during), [r.text for r in during if r.status != 200]
            assert _served(e, "d1") == 6
            await ph.until(lambda: not reg.backends["d0"].usable, "d0 out")
            assert [(d.name, path) for d, path in reg.decoders_for(p0)] == [("d1", "nixl")]
            text = await rp.metrics()
            assert ph.metric_value(text, "pdstack_proxy_pairs_total", prefill="p0",
                                   decode="d1") == 6
            assert ph.metric_value(text, "pdstack_proxy_decode_fallback_total") == 0
            # the decode legs carried the prefill's KV handoff: a real P/D pairing
            assert all(r.body and r.body.get("kv_transfer_params")
                       for r in e["d1"].seen(COMPLETIONS))

            assert await _back(rp, e, "d0", "d1", 6) == (6, 0)


# ------------------------------------------------------------------ generations


async def test_a_standby_of_another_generation_never_stands_in() -> None:
    async with ph.engines("e0", "s0") as e:
        t = ph.table("colocated", [ph.backend("e0", "colocated", e["e0"], gen="g1"),
                                   _standby(ph.backend("s0", "colocated", e["s0"], gen="g2"))])
        async with ph.running_proxy(t, **FAST) as rp:
            await _ready(rp, "e0", "s0")
            await e["e0"].kill()
            await ph.until(lambda: not rp.registry.backends["e0"].usable, "e0 out")
            results = await _burst(rp, 4, "x")
            assert rp.registry.by_role("colocated") == [rp.registry.backends["e0"]]
    assert all(r.status == 503 for r in results), [r.status for r in results]
    assert _served(e, "s0") == 0


# ------------------------------------------------------------------ the rule itself


def _b(name: str, standby: bool = False, up: bool = True, gen: str = "g1",
       drained: bool = False) -> BackendState:
    return BackendState(name=name, role="decode", node="n1", url=f"http://{name}",
                        generation=gen, standby=standby, healthy=up, drained=drained)


ROTATION = [
    ("all active up: none", [_b("a0"), _b("s0", True)], (), {}),
    ("one out: the first standby by name", [_b("a0", up=False), _b("a1"), _b("s1", True),
                                            _b("s0", True)], (), {"s0": "a0"}),
    ("two out, two standbys", [_b("a1", up=False), _b("a0", drained=True), _b("s1", True),
                               _b("s0", True)], (), {"s0": "a0", "s1": "a1"}),
    ("two out, one standby up", [_b("a0", up=False), _b("a1", up=False),
                                 _b("s0", True, up=False), _b("s1", True)], (), {"s1": "a0"}),
    ("counted out by the caller", [_b("a0"), _b("s0", True)], ("a0",), {"s0": "a0"}),
    ("a standby the caller counts out", [_b("a0"), _b("s0", True), _b("s1", True)],
     ("a0", "s0"), {"s1": "a0"}),
    ("another generation's standby", [_b("a0", up=False), _b("s0", True, gen="g2")], (), {}),
    ("each generation its own", [_b("a0", up=False), _b("b0", gen="g2", up=False),
                                 _b("s0", True, gen="g2")], (), {"s0": "b0"}),
]


@named_cases(("backends", "out", "want"), ROTATION)
def test_rotation_rule(backends: list[BackendState], out: tuple[str, ...],
                       want: dict[str, str]) -> None:
    assert rotation(backends, out) == want


def test_only_standbys_is_refused() -> None:
    with pytest.raises(ValueError, match="every decode backend is a standby"):
        check_standbys([_b("s0", True), _b("s1", True)])
    check_standbys([_b("s0", True), _b("a0")])  # one active: fine
    table = ph.table("colocated", [{"name": "s0", "role": "colocated", "url": "http://x",
                                    "standby": True}])
    with pytest.raises(ValueError, match="every colocated backend is a standby"):
        BackendRegistry.from_table(table)


def test_a_replacement_keeps_its_standby_mark_and_the_admin_lists_it() -> None:
    reg = BackendRegistry.from_table(ph.table("colocated", [
        {"name": "e0", "role": "colocated", "url": "http://e0"},
        {"name": "s0", "role": "colocated", "url": "http://s0", "standby": True},
    ]))
    assert reg.backends["s0"].standby and not reg.backends["e0"].standby
    # an upgrade re-registers it without the key (pdstack.upgrade.upgrader)
    new = reg.upsert({"name": "s0", "role": "colocated", "url": "http://s0", "generation": "g2"})
    assert new.standby
    listed = {b["name"]: b for b in reg.to_json()["backends"]}
    assert listed["s0"]["standby"] is True and "standby" not in listed["e0"]
