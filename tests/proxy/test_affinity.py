"""Session affinity (pdstack.proxy.affinity): the requests of one conversation go to the
same engines, against FakeEngine test doubles (pdstack/testing/fake_engine.py, no model)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import Any

from pdstack.proxy.affinity import MAX_SESSION_CHARS, SESSION_HEADER, session_key
from pdstack.proxy.routing import stable_hash
from pdstack.testing import proxy_harness as ph
from pdstack.testing.fake_engine import FakeEngine, Faults

NAMES = ("e0", "e1", "e2")


def prompt(i: int) -> str:
    return f"conversation turn {i}: " + f"message {i} " * 30


async def post(
    rp: ph.RunningProxy, text: str, session: str | None = None, user: Any = None, chat: bool = False
) -> int:
    headers = {SESSION_HEADER: session} if session is not None else {}
    body: dict[str, Any] = {"model": "fake", "max_tokens": 2}
    if user is not None:
        body["user"] = user
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = text
        path = "/v1/completions"
    async with rp.session.post(rp.url + path, json=body, headers=headers) as resp:
        await resp.read()
        return resp.status


def served_by(e: dict[str, FakeEngine], text: str) -> list[str]:
    """Which engines saw a request whose prompt contains ``text``."""
    out = []
    for name, engine in e.items():
        for r in engine.seen():
            body = r.body or {}
            content = body.get("prompt") or str(body.get("messages"))
            if text in content:
                out.append(name)
    return out


def home(rp: ph.RunningProxy, role: str, key: str, usable: set[str] | None = None) -> str:
    """The first (usable) member on the proxy's ring for ``key``: where affinity points."""
    ring = rp.proxy._ring_for(role)
    for name in ring.walk(stable_hash(key)):
        if usable is None or name in usable:
            return name
    raise AssertionError("empty ring")


async def healthy(rp: ph.RunningProxy) -> None:
    await ph.until(lambda: all(b.usable for b in rp.registry.backends.values()), "all healthy")


def colocated_table(e: dict[str, FakeEngine]) -> dict:
    return ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in e])


# ------------------------------------------------------------------ unit


def test_session_key_rules() -> None:
    assert session_key({SESSION_HEADER: "abc"}, {"user": "u1"}) == "abc"  # header first
    assert session_key({}, {"user": "u1"}) == "u1"
    assert session_key({}, {}) is None
    assert session_key({}, {"user": 42}) is None  # not a string: ignored
    assert session_key({SESSION_HEADER: ""}, {}) is None
    ok = "s" * MAX_SESSION_CHARS
    assert session_key({SESSION_HEADER: ok}, {}) == ok
    assert session_key({SESSION_HEADER: ok + "s"}, {}) is None  # 257 characters
    assert session_key({SESSION_HEADER: "sessión"}, {}) is None  # not ASCII
    assert session_key({SESSION_HEADER: "a\tb"}, {}) is None  # not printable
    # an invalid header falls back to a valid user field
    assert session_key({SESSION_HEADER: "ü" * 3}, {"user": "u2"}) == "u2"


# ------------------------------------------------------------------ colocated


async def test_one_session_one_colocated_engine_and_sessions_spread() -> None:
    async with ph.engines(*NAMES, output_tokens=2) as e, ph.running_proxy(colocated_table(e)) as rp:
        await healthy(rp)
        # without a session, prefix affinity spreads these prompts over the engines
        by_prefix = {home(rp, "colocated", prompt(i)[:1024]) for i in range(8)}
        assert len(by_prefix) > 1, "pick other prompts: prefix affinity alone must spread"
        for i in range(8):
            assert await post(rp, prompt(i), session="conv-1") == 200
        for i in range(8, 12):
            assert await post(rp, prompt(i), user="alice", chat=True) == 200
        expect_conv = home(rp, "colocated", "session:conv-1")
        expect_alice = home(rp, "colocated", "session:alice")
        for i in range(8):
            assert served_by(e, prompt(i)) == [expect_conv], i
        for i in range(8, 12):
            assert served_by(e, prompt(i)) == [expect_alice], i

        # different sessions spread over the engines (each to its ring home)
        for engine in e.values():
            engine.requests.clear()
        sessions = [f"user-{k}" for k in range(12)]
        for k, sid in enumerate(sessions):
            assert await post(rp, prompt(100 + k), session=sid) == 200
        landed = {sid: served_by(e, prompt(100 + k)) for k, sid in enumerate(sessions)}
        for sid, where in landed.items():
            assert where == [home(rp, "colocated", f"session:{sid}")], sid
        assert len({w[0] for w in landed.values()}) > 1, "12 sessions on one engine"


async def test_ejected_session_engine_hands_over_and_gets_it_back() -> None:
    async with (
        ph.engines(*NAMES, output_tokens=2) as e,
        ph.running_proxy(colocated_table(e), readmit_after=1) as rp,
    ):
        await healthy(rp)
        sid = "conv-eject"
        first = home(rp, "colocated", f"session:{sid}")
        assert await post(rp, prompt(1), session=sid) == 200
        assert served_by(e, prompt(1)) == [first]

        e[first].faults = Faults(health_status=503)
        await ph.until(lambda: not rp.registry.backends[first].usable, f"{first} ejected")
        others = {n for n in NAMES if n != first}
        second = home(rp, "colocated", f"session:{sid}", usable=others)
        for i in range(2, 6):
            assert await post(rp, prompt(i), session=sid) == 200
            assert served_by(e, prompt(i)) == [second], i  # one stand-in, not a scatter

        e[first].faults = Faults()
        await ph.until(lambda: rp.registry.backends[first].usable, f"{first} re-admitted")
        assert await post(rp, prompt(6), session=sid) == 200
        assert served_by(e, prompt(6)) == [first]


async def test_hot_session_spills_under_bounded_load() -> None:
    """Requests of one session that pile up (each hangs in its engine) spill to other
    engines once the home engine carries more than load_factor x its fair share."""
    async with (
        ph.engines(*NAMES, output_tokens=2) as e,
        ph.running_proxy(colocated_table(e), load_factor=1.25) as rp,
    ):
        await healthy(rp)
        for engine in e.values():
            engine.faults = Faults(hang=True)
        sid = "hot"
        first = home(rp, "colocated", f"session:{sid}")
        tasks: list[asyncio.Task[int]] = []

        def seen_total() -> int:
            return sum(len(x.seen()) for x in e.values())

        try:
            for i in range(9):
                tasks.append(asyncio.create_task(post(rp, prompt(i), session=sid)))
                await ph.until(lambda: seen_total() == len(tasks), f"request {i} in flight")
            counts = Counter({n: len(x.seen()) for n, x in e.items()})
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    assert sum(counts.values()) == 9
    assert len([n for n in counts if counts[n]]) > 1, f"no spill: {counts}"
    # bounded load: nobody above ceil(1.25 * 9 / 3) = 4, the home engine filled first
    assert max(counts.values()) <= 4, counts
    assert counts[first] == max(counts.values()), counts


async def test_invalid_session_ids_are_ignored() -> None:
    async with ph.engines(*NAMES, output_tokens=2) as e, ph.running_proxy(colocated_table(e)) as rp:
        await healthy(rp)
        cases: list[dict[str, Any]] = [
            {"session": "x" * (MAX_SESSION_CHARS + 1)},
            {"user": "usuário-ñ"},  # non-ASCII
            {"user": "u" * 1000},
            {"user": {"id": 1}},  # not a string
        ]
        for i, case in enumerate(cases):
            text = prompt(200 + i)
            assert await post(rp, text, **case) == 200, case
            # routed by prefix affinity, exactly as without a session
            assert served_by(e, text) == [home(rp, "colocated", text[:1024])], case


# ------------------------------------------------------------------ P/D


async def test_one_session_one_prefiller_and_one_decoder() -> None:
    names = ("p0", "p1", "p2", "d0", "d1", "d2")
    async with ph.engines(*names, output_tokens=2) as e:
        t = ph.table(
            "nixl",
            [ph.backend(n, "prefill" if n[0] == "p" else "decode", e[n]) for n in names],
        )
        async with ph.running_proxy(t) as rp:
            await healthy(rp)
            for i in range(6):
                assert await post(rp, prompt(i), session="conv-pd") == 200
            for i in range(6, 10):
                assert await post(rp, prompt(i), user="bob") == 200
            p_home = home(rp, "prefill", "session:conv-pd")
            d_home = home(rp, "decode", "session:conv-pd")
            for i in range(6):
                where = served_by(e, prompt(i))
                assert where == [p_home, d_home], (i, where)
            bob = {tuple(served_by(e, prompt(i))) for i in range(6, 10)}
            assert bob == {(home(rp, "prefill", "session:bob"), home(rp, "decode", "session:bob"))}

            # many sessions: both roles spread
            for k in range(12):
                assert await post(rp, prompt(300 + k), session=f"s{k}") == 200
            pairs = [served_by(e, prompt(300 + k)) for k in range(12)]
            assert len({p[0] for p in pairs}) > 1 and len({p[1] for p in pairs}) > 1, pairs

            # the session's decoder goes down: another decoder serves, the prefiller stays
            e[d_home].faults = Faults(health_status=503)
            await ph.until(lambda: not rp.registry.backends[d_home].usable, "decoder ejected")
            assert await post(rp, prompt(50), session="conv-pd") == 200
            where = served_by(e, prompt(50))
            assert where[0] == p_home and where[1] != d_home and len(where) == 2, where
