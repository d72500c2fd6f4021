"""Stream migration (issue 55) against FakeEngine test doubles: a stream whose leg fails
mid-stream goes on on another engine of the same role and generation, in the same client
stream (same id, every token once, usage of what the client got); what cannot migrate keeps
the error event. The fake answers a prompt identically on every engine, and a continuation
(prompt token ids + the output's so far) with the tokens that follow: greedy decoding."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from pdstack.proxy.migration_stream import StreamTracker, cannot_migrate, with_token_ids
from pdstack.testing import proxy_harness as ph
from pdstack.testing.fake_engine import OUTPUT_ID_BASE, Faults

TOKENS = 12
PROMPTS = [f"migrate me please number {i}" for i in range(6)]


def _docs(res: ph.StreamResult) -> list[dict[str, Any]]:
    return [json.loads(e) for e in res.events if e != "[DONE]"]


def _check_whole(res: ph.StreamResult, expected: str, chat: bool) -> None:
    """One well-formed stream: 200, [DONE] last, no error event, one id, the expected
    text, finish_reason once at the end, usage of every token the client got."""
    assert res.status == 200, res.text
    assert res.events[-1] == "[DONE]" and not res.error_events, res.text
    docs = _docs(res)
    assert len({d["id"] for d in docs}) == 1, res.text
    assert {d["object"] for d in docs} == {"chat.completion.chunk" if chat else "text_completion"}
    assert ph.completion_text(res.events) == expected
    finishes = [c["finish_reason"] for d in docs for c in d["choices"] if c.get("finish_reason")]
    assert finishes == ["length"], res.text
    usage = docs[-1]["usage"]
    words = len(expected.split())
    assert usage["completion_tokens"] == words == TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + words
    assert '"token_ids": [' not in res.text and '"token_ids":[' not in res.text  # not asked


async def _unbroken(prompts: list[str], chat: bool) -> dict[str, ph.StreamResult]:
    """The same requests on one engine with no fault: what a migrated stream must equal."""
    async with (
        ph.engines("ref", output_tokens=TOKENS) as e,
        ph.running_proxy(ph.table("colocated", [ph.backend("ref", "colocated", e["ref"])])) as rp,
    ):
        results = await asyncio.gather(*(
            ph.stream_completion(rp.session, rp.url, p, chat=chat,
                                 stream_options={"include_usage": True}) for p in prompts))
    return dict(zip(prompts, results, strict=True))


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("fault", ["cut", "error_event"])
async def test_colocated_engine_dies_mid_stream_streams_go_on(chat: bool, fault: str) -> None:
    """c0 cuts (or sends a 5xx error event on) every stream after 4 tokens: each of its
    streams goes on on c1, equal to an unbroken run; c1 got the continuation as token
    ids with max_tokens reduced; the migrations are counted with their gap."""
    reference = await _unbroken(PROMPTS, chat)
    async with ph.engines("c0", "c1", output_tokens=TOKENS) as e:
        t = ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in ("c0", "c1")])
        async with ph.running_proxy(t, eject_after=100) as rp:
            e["c0"].faults = (Faults(close_after_chunks=4) if fault == "cut"
                              else Faults(error_event_after_chunks=4))
            results = await asyncio.gather(*(
                ph.stream_completion(rp.session, rp.url, p, chat=chat, max_tokens=TOKENS,
                                     stream_options={"include_usage": True}) for p in PROMPTS))
            # a handler ends after its client's stream (a 5xx event is confirmed by /health)
            await ph.until(lambda: rp.proxy.in_flight == 0, "every handler ended")
            text = await rp.metrics()
    broken = [r for r in e["c0"].seen() if r.path.startswith("/v1/")]
    assert broken, "no request landed on c0: the test proves nothing"
    for prompt, res in zip(PROMPTS, results, strict=True):
        _check_whole(res, ph.completion_text(reference[prompt].events), chat)
    continued = [r for r in e["c1"].seen() if r.body and isinstance(r.body.get("prompt"), list)]
    assert len(continued) == len(broken)
    for seen in continued:
        assert seen.path == "/v1/completions"
        assert seen.body is not None and seen.body["max_tokens"] == TOKENS - 4
        assert sum(t >= OUTPUT_ID_BASE for t in seen.body["prompt"]) == 4
        assert seen.request_id is not None and seen.request_id.endswith("-m1")
    reason = "cut" if fault == "cut" else "error_event"
    n = len(broken)
    assert ph.metric_value(text, "pdstack_proxy_migrations_total", reason=reason,
                           outcome="continued") == n
    assert ph.metric_value(text, "pdstack_proxy_migration_gap_seconds_count") == n
    assert ph.metric_value(text, "pdstack_proxy_requests_total", outcome="ok") == len(PROMPTS)


async def test_decoder_dies_mid_stream_continues_on_other_decoder() -> None:
    """P/D: each decoder cuts its first stream after 5 tokens: the stream goes from the
    first decoder to a second and a third (5 + 5 + 2 tokens), which compute prompt + output
    themselves (no KV handoff)."""
    reference = await _unbroken(["pd prompt"], chat=False)
    async with ph.engines("p0", "d0", "d1", "d2", output_tokens=TOKENS) as e:
        t = ph.pd_table(e, ["p0"], ["d0", "d1", "d2"])
        async with ph.running_proxy(t, eject_after=100) as rp:
            for name in ("d0", "d1", "d2"):
                e[name].faults = Faults(close_after_chunks=5, times=1)
            res = await ph.stream_completion(rp.session, rp.url, "pd prompt",
                                             stream_options={"include_usage": True})
    _check_whole(res, ph.completion_text(reference["pd prompt"].events), chat=False)
    legs = sorted((r for n in ("d0", "d1", "d2") for r in e[n].seen()),
                  key=lambda r: r.received_at)
    assert len(legs) == 3
    assert legs[0].body is not None and "kv_transfer_params" in legs[0].body
    for leg, made in zip(legs[1:], (5, 10), strict=True):
        assert leg.body is not None and "kv_transfer_params" not in leg.body
        assert len(leg.body["prompt"]) == len("pd prompt") + made


async def test_stalled_stream_moves_after_its_idle_budget() -> None:
    """Each engine stalls its first stream after 5 tokens: past stream_idle_timeout the
    stream moves on (reason stall), 5 + 5 + 2 tokens, equal to an unbroken run."""
    reference = await _unbroken(["stall"], chat=True)
    async with ph.engines("c0", "c1", "c2", output_tokens=TOKENS) as e:
        t = ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in e])
        async with ph.running_proxy(t, eject_after=100, stream_idle_timeout_s=0.3) as rp:
            for engine in e.values():
                engine.faults = Faults(hang_after_chunks=5, times=1)
            res = await ph.stream_completion(rp.session, rp.url, "stall", chat=True,
                                             stream_options={"include_usage": True})
            text = await rp.metrics()
    _check_whole(res, ph.completion_text(reference["stall"].events), chat=True)
    assert ph.metric_value(text, "pdstack_proxy_migrations_total", reason="stall",
                           outcome="continued") == 2


async def test_second_death_is_migrated_again_then_bounded() -> None:
    """Every engine cuts after 3 tokens: the stream moves twice (max_migrations 2), 9
    tokens reach the client once each, then the error event; never a fourth engine."""
    async with ph.engines("c0", "c1", "c2", "c3", output_tokens=TOKENS) as e:
        t = ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in e])
        async with ph.running_proxy(t, eject_after=100, max_migrations=2) as rp:
            for engine in e.values():
                engine.faults = Faults(close_after_chunks=3)
            res = await ph.stream_completion(rp.session, rp.url, "hop")
            text = await rp.metrics()
    assert res.status == 200
    (err,) = res.error_events
    assert "failed mid-stream" in err["message"] and res.events[-1] == "[DONE]"
    words = ph.completion_text(res.events[:-2]).split()
    assert len(words) == 9
    assert sum(len(engine.seen()) for engine in e.values()) == 3
    assert ph.metric_value(text, "pdstack_proxy_migrations_total", outcome="continued") == 2
    assert ph.metric_value(text, "pdstack_proxy_migrations_total", outcome="failed") == 1
    assert ph.metric_value(text, "pdstack_proxy_requests_total", outcome="stream_error") == 1


async def test_never_migrates_to_another_generation() -> None:
    async with ph.engines("old", "new", output_tokens=TOKENS) as e:
        t = ph.table("colocated", [ph.backend("old", "colocated", e["old"], gen="g1"),
                                   ph.backend("new", "colocated", e["new"], gen="g2")])
        async with ph.running_proxy(t, eject_after=100) as rp:
            assert await rp.backend_action("new", "drain") == 200
            e["old"].faults = Faults(close_after_chunks=2)
            task = asyncio.create_task(ph.stream_completion(rp.session, rp.url, "gen"))
            await ph.until(lambda: len(e["old"].seen()) == 1, "the leg on old")
            assert await rp.backend_action("new", "undrain") == 200
            res = await task
    (err,) = res.error_events
    # the only engine of its generation: nothing tracked, the failure told as it was
    assert "colocated old failed mid-stream" in err["message"]
    assert not e["new"].seen()
    assert [r.body.get("return_token_ids") for r in e["old"].seen() if r.body] == [None]


@pytest.mark.parametrize("extra", [{"logprobs": 1}, {"n": 2}, {"stop": ["zzz"]}],
                         ids=["logprobs", "n2", "stop"])
async def test_what_cannot_migrate_keeps_the_error_event(extra: dict[str, Any]) -> None:
    async with ph.engines("c0", "c1", output_tokens=TOKENS) as e:
        t = ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in e])
        async with ph.running_proxy(t, eject_after=100) as rp:
            for engine in e.values():
                engine.faults = Faults(close_after_chunks=2)
            res = await ph.stream_completion(rp.session, rp.url, "no", **extra)
    (err,) = res.error_events
    assert "failed mid-stream" in err["message"]
    assert sum(len(engine.seen()) for engine in e.values()) == 1
    (seen,) = [r for engine in e.values() for r in engine.seen()]
    assert seen.body is not None and "return_token_ids" not in seen.body


async def test_client_that_asked_for_token_ids_gets_them_all() -> None:
    async with ph.engines("c0", "c1", "c2", output_tokens=TOKENS) as e:
        t = ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in e])
        async with ph.running_proxy(t, eject_after=100) as rp:
            for engine in e.values():
                engine.faults = Faults(close_after_chunks=5, times=1)
            res = await ph.stream_completion(rp.session, rp.url, "ids", return_token_ids=True)
    assert res.status == 200 and not res.error_events
    docs = _docs(res)
    ids = [t for d in docs for c in d["choices"] for t in (c.get("token_ids") or [])]
    words = ph.completion_text(res.events).split()
    assert len(ids) == len(words) == TOKENS
    assert [f"t{t - OUTPUT_ID_BASE}" for t in ids] == words
    prompts = [c["prompt_token_ids"] for d in docs for c in d["choices"]
               if c.get("prompt_token_ids")]
    assert prompts == [[ord(c) for c in "ids"]]  # once, the client's prompt


# ------------------------------------------------------------ the tracker alone
def test_cannot_migrate_lists_why() -> None:
    ok = {"stream": True, "prompt": "hi"}
    assert cannot_migrate("/v1/completions", ok) is None
    assert cannot_migrate("/v1/completions", {**ok, "prompt": [1, 2, 3]}) is None
    assert cannot_migrate("/v1/completions", {**ok, "prompt": ["a", "b"]}) == "several prompts"
    assert cannot_migrate("/v1/completions", {**ok, "stream": False}) is not None
    chat = {"stream": True, "messages": [{"role": "user", "content": "hi"}]}
    assert cannot_migrate("/v1/chat/completions", chat) is None
    assert cannot_migrate("/v1/chat/completions", {**chat, "logprobs": True}) == "logprobs"
    assert cannot_migrate("/v1/chat/completions", {**chat, "tools": [{}]}) is not None
    assert cannot_migrate("/v1/chat/completions", {**chat, "n": 3}) == "n > 1"


def test_with_token_ids_wins_over_the_clients_own() -> None:
    body = json.loads(with_token_ids(b'{"prompt": "x", "return_token_ids": false}\n'))
    assert body == {"prompt": "x", "return_token_ids": True}
    assert json.loads(with_token_ids(b"{}")) == {"return_token_ids": True}


def test_tracker_hides_ids_and_continues_with_usage_of_the_client() -> None:
    seen: list[bytes] = []

    def downstream(data: bytes) -> bytes:
        seen.append(data)
        return data

    tracker = StreamTracker(chat=True, keep_ids=False, downstream=downstream)
    head = b'{"id":"chatcmpl-a","object":"chat.completion.chunk","created":7,"model":"m",'
    first = (b"data: " + head + b'"choices":[{"index":0,"delta":{"role":"assistant",'
             b'"content":""},"finish_reason":null}],"prompt_token_ids":[5,6]}\n\n'
             b"data: " + head + b'"choices":[{"index":0,"delta":{"content":" a"},'
             b'"finish_reason":null,"token_ids":[9]}]}\n\n')
    out = tracker(first)
    assert b"token_ids\":[" not in out and out.count(b'"prompt_token_ids":null') == 1
    assert tracker.prompt_ids == (5, 6) and tracker.token_ids == [9] and tracker.migratable
    error = b'data: {"error":{"message":"boom","type":"InternalServerError","code":500}}\n\n'
    assert tracker(error + b"data: [DONE]\n\n") == b""
    assert tracker.error is not None and tracker.error[0] == 500
    path, payload = tracker.continuation({"messages": [], "max_tokens": 5, "stream": True,
                                          "temperature": 0}) or ("", b"")
    cont = json.loads(payload)
    assert path == "/v1/completions" and "messages" not in cont
    assert cont["prompt"] == [5, 6, 9] and cont["max_tokens"] == 4 and cont["temperature"] == 0
    tracker.resume()
    other = b'{"id":"cmpl-b","object":"text_completion","created":8,"model":"m",'
    rest = tracker(b"data: " + other + b'"choices":[{"index":0,"text":" b","finish_reason":'
                   b'"length","token_ids":[3],"prompt_token_ids":[5,6,9]}]}\n\n'
                   b"data: " + other + b'"choices":[],"usage":{"prompt_tokens":3,'
                   b'"completion_tokens":1,"total_tokens":4}}\n\ndata: [DONE]\n\n')
    events = [json.loads(e[6:]) for e in rest.split(b"\n\n") if e.startswith(b"data: {")]
    assert [e["id"] for e in events] == ["chatcmpl-a", "chatcmpl-a"]
    assert events[0]["object"] == "chat.completion.chunk" and events[0]["created"] == 7
    assert events[0]["choices"][0]["delta"] == {"content": " b"}
    assert events[0]["choices"][0]["finish_reason"] == "length"
    assert events[0]["choices"][0]["token_ids"] is None
    assert events[1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2,
                                  "total_tokens": 4}
    assert rest.endswith(b"data: [DONE]\n\n") and tracker.finished and tracker.done
    assert tracker.token_ids == [9, 3]


async def test_held_back_error_event_reaches_the_client_when_nothing_can_continue() -> None:
    """A 5xx error event after 2 tokens on c0 while c1 (its generation) is drained: held
    back for a migration that finds no usable engine, then passed on as the proxy's error
    event, as without migration."""
    async with ph.engines("c0", "c1", output_tokens=TOKENS) as e:
        t = ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in ("c0", "c1")])
        async with ph.running_proxy(t, eject_after=100) as rp:
            assert await rp.backend_action("c1", "drain") == 200
            e["c0"].faults = Faults(error_event_after_chunks=2)
            res = await ph.stream_completion(rp.session, rp.url, "alone", chat=True)
            await ph.until(lambda: rp.proxy.in_flight == 0, "the handler ended")
            text = await rp.metrics()
    assert len(ph.completion_text(res.events[:-2]).split()) == 2
    (err,) = res.error_events
    assert err == {"message": "Internal server error", "type": "server_error", "param": None,
                   "code": 500}
    assert res.events[-1] == "[DONE]" and res.events[-2].startswith('{"error"')
    assert ph.metric_value(text, "pdstack_proxy_migrations_total", reason="error_event",
                           outcome="failed") == 1
    assert ph.metric_value(text, "pdstack_proxy_requests_total", outcome="stream_error") == 1


def test_tracker_continues_after_the_last_token_with_text() -> None:
    """A token whose text vLLM held back (bytes of a character not complete yet: "" text)
    is made again by the next engine: the continuation carries only the tokens whose text
    reached the client (a token-id prompt ending mid-character makes vLLM echo the prompt)."""
    head = b'data: {"id":"cmpl-a","object":"text_completion","created":7,"model":"m",'
    events = (head + b'"choices":[{"index":0,"text":" a","finish_reason":null,'
              b'"prompt_token_ids":[5,6],"token_ids":[9]}]}\n\n'
              + head + b'"choices":[{"index":0,"text":"","finish_reason":null,'
              b'"token_ids":[200]}]}\n\n')
    tracker = StreamTracker(chat=False, keep_ids=False)
    tracker(events)
    assert tracker.token_ids == [9, 200] and tracker.clean == 1 and tracker.migratable
    _, payload = tracker.continuation({"prompt": "x", "max_tokens": 10}) or ("", b"")
    assert json.loads(payload)["prompt"] == [5, 6, 9]
    assert json.loads(payload)["max_tokens"] == 9
    tracker.resume()
    assert tracker.token_ids == [9] and tracker.carried == 1
    keeping = StreamTracker(chat=False, keep_ids=True)
    keeping(events)
    assert not keeping.migratable  # the client has the held token's id already


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_openai_client_reads_a_migrated_stream(chat: bool) -> None:
    """The official openai client streams through a migration: one id, every token once,
    the usage of what it received, finish_reason from the engine that finished."""
    import openai

    reference = await _unbroken(["openai client"], chat)
    expected = ph.completion_text(reference["openai client"].events)
    async with ph.engines("c0", "c1", "c2", output_tokens=TOKENS) as e:
        t = ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in e])
        async with ph.running_proxy(t, eject_after=100) as rp:
            for engine in e.values():
                engine.faults = Faults(close_after_chunks=5, times=1)
            client = openai.AsyncOpenAI(base_url=rp.url + "/v1", api_key="unused")
            options: dict[str, Any] = {"include_usage": True}
            if chat:
                messages: Any = [{"role": "system", "content": "openai client"},
                                 {"role": "user", "content": "hi"}]
                stream: Any = await client.chat.completions.create(
                    model="fake", messages=messages, stream=True, stream_options=options)
            else:
                stream = await client.completions.create(
                    model="fake", prompt="openai client", stream=True, stream_options=options)
            ids, texts, finishes, usage = set(), [], [], None
            async for chunk in stream:
                ids.add(chunk.id)
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    texts.append((choice.delta.content if chat else choice.text) or "")
                    if choice.finish_reason:
                        finishes.append(choice.finish_reason)
            await client.close()
    assert len(ids) == 1 and "".join(texts) == expected and finishes == ["length"]
    assert usage is not None and usage.completion_tokens == TOKENS
    assert sum(len(engine.seen()) for engine in e.values()) == 3  # 5 + 5 + 2 tokens


async def test_one_engine_of_its_role_asks_no_token_ids() -> None:
    """A stream that has nowhere to move (the only engine of its role and generation; the
    other one is another generation) asks its engine for no token ids: migration costs
    nothing there. With a second engine of its generation it asks for them."""
    async with ph.engines("c0", "c1", output_tokens=TOKENS) as e:
        alone = ph.table("colocated", [ph.backend("c0", "colocated", e["c0"]),
                                       ph.backend("c1", "colocated", e["c1"],
                                                  gen="other@2")])
        async with ph.running_proxy(alone) as rp:
            await ph.stream_completion(rp.session, rp.url, "alone", max_tokens=TOKENS)
        asked = [r.body.get("return_token_ids") for n in ("c0", "c1") for r in e[n].seen()
                 if r.body is not None and r.path.startswith("/v1/")]
        assert asked == [None], asked
        pair = ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in ("c0", "c1")])
        async with ph.running_proxy(pair) as rp:
            await ph.stream_completion(rp.session, rp.url, "paired", max_tokens=TOKENS)
        asked = [r.body.get("return_token_ids") for n in ("c0", "c1") for r in e[n].seen()
                 if r.body is not None and r.path.startswith("/v1/")]
        assert asked == [None, True], asked
