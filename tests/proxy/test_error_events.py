"""An engine's error event inside a 200 stream (vLLM's failed generation, e.g. a NIXL KV
pull): before the first token a failure before the first byte (re-routed, or the client's
fault passed back), after tokens passed on; always in the proxy's error vocabulary. The
engines are FakeEngine test doubles (``Faults.error_event_after_chunks``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdstack.proxy.errors import OPENAI_TYPES, error_event_status
from pdstack.proxy.sse import ErrorEvents, leading_error
from pdstack.testing import proxy_harness as ph
from pdstack.testing.fake_engine import FakeEngine, Faults

from .test_hardening import assert_openai_error

TOKENS = 5


def _table(e: dict[str, FakeEngine], route: str, decoders: list[str]) -> dict[str, Any]:
    """P/D (prefiller p0, then ``decoders``) or colocated (``decoders`` as engines)."""
    if route == "pd":
        return ph.pd_table(e, ["p0"], decoders)
    return ph.table("colocated", [ph.backend(n, "colocated", e[n]) for n in decoders])


def _role_events(res: ph.StreamResult) -> int:
    return sum('"role"' in event for event in res.events)


def _no_engine_type(res: ph.StreamResult) -> None:
    """No vLLM class name reaches the client, only OpenAI's types."""
    assert "InternalServerError" not in res.text and "BadRequestError" not in res.text
    for err in res.error_events:
        assert err["type"] in OPENAI_TYPES, err


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("route", ["pd", "colocated"])
async def test_error_event_before_first_token_rerouted(route: str, chat: bool) -> None:
    """(a) The first decoder tried streams vLLM's error event with no token (a chat stream:
    after its role event): the client gets the other decoder's whole answer, once; the
    failed one, whose /health passes, is not counted against (no request can eject it)."""
    async with (
        ph.engines("p0", "d0", "d1", output_tokens=TOKENS) as e,
        ph.running_proxy(_table(e, route, ["d0", "d1"]), eject_after=1) as rp,
    ):
        reference = await ph.stream_completion(rp.session, rp.url, "hello", chat=chat)
        for name in ("d0", "d1"):
            e[name].requests.clear()
        # one Faults object on both: whichever decoder is tried first fails, once
        fault = Faults(error_event_after_chunks=0, times=1)
        e["d0"].faults = e["d1"].faults = fault
        res = await ph.stream_completion(rp.session, rp.url, "hello", chat=chat)
        text = await rp.metrics()
        backends = [rp.registry.backends[n] for n in ("d0", "d1")]
    assert res.status == 200, res.text
    assert res.events[-1] == "[DONE]" and not res.error_events, res.text
    assert ph.completion_text(res.events) == ph.completion_text(reference.events)
    assert len(ph.completion_text(res.events).split()) == TOKENS
    assert _role_events(res) == (1 if chat else 0)  # the failed leg's role event held back
    assert len(e["d0"].seen()) == len(e["d1"].seen()) == 1
    assert ph.metric_value(text, "pdstack_proxy_retries_total", leg="decode") == 1
    assert ph.metric_value(text, "pdstack_proxy_requests_total", outcome="ok") == 2
    assert all(b.healthy and b.consecutive_failures == 0 for b in backends)
    assert ph.metric_value(text, "pdstack_proxy_ejections_total") == 0


async def test_error_event_from_a_sick_decoder_ejects_it() -> None:
    """(a) As a 5xx before the first byte: when the decoder's /health fails too, it is
    ejected (counted), and the request is served by the other decoder."""
    async with ph.engines("p0", "d0", "d1", output_tokens=TOKENS) as e:
        cfg = {"eject_after": 100, "health_interval_s": 60}  # only the confirmation ejects
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0", "d1"]), **cfg) as rp:
            e["d0"].faults = Faults(error_event_after_chunks=0, health_status=503)
            sent = 0
            while not e["d0"].seen() and sent < 64:  # p2c: until d0 was tried once
                res = await ph.stream_completion(rp.session, rp.url, f"q{sent}")
                assert res.status == 200 and not res.error_events, res.text
                assert len(ph.completion_text(res.events).split()) == TOKENS
                sent += 1
            text = await rp.metrics()
            d0 = rp.registry.backends["d0"]
    assert len(e["d0"].seen()) == 1, f"d0 tried {len(e['d0'].seen())} times in {sent}"
    assert not d0.healthy and d0.consecutive_failures == 1
    assert ph.metric_value(text, "pdstack_proxy_ejections_total", backend="d0") == 1
    assert ph.metric_value(text, "pdstack_proxy_retries_total", leg="decode") == 1


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_error_event_with_no_other_decoder(chat: bool) -> None:
    """(b) The only decoder streams the error event before a token: the client gets the
    proxy's OpenAI error JSON (502, server_error), after one try; the decoder stays in."""
    async with (
        ph.engines("p0", "d0", output_tokens=TOKENS) as e,
        # without the decode fallback (which serves it whole: test_decode_first_byte.py)
        ph.running_proxy(
            ph.pd_table(e, ["p0"], ["d0"]), eject_after=1, decode_fallback=False
        ) as rp,
    ):
        e["d0"].faults = Faults(error_event_after_chunks=0)
        res = await ph.stream_completion(rp.session, rp.url, "hello", chat=chat)
        text = await rp.metrics()
        d0 = rp.registry.backends["d0"]
    assert res.status == 502, res.text
    assert res.headers["Content-Type"].startswith("application/json")
    err = assert_openai_error(res.text, 502)
    assert err["type"] == "server_error", err
    assert "d0" in err["message"] and "Internal server error" in err["message"], err
    assert len(e["d0"].seen()) == 1
    assert d0.healthy and d0.consecutive_failures == 0
    assert ph.metric_value(text, "pdstack_proxy_requests_total", outcome="upstream_error") == 1


async def test_error_events_within_the_retry_budget() -> None:
    """(b) Every decoder streams the error event: max_retries + 1 tries, as for any other
    failure before the first byte, then the proxy's 502."""
    async with (
        ph.engines("p0", "d0", "d1", "d2", output_tokens=TOKENS) as e,
        ph.running_proxy(
            ph.pd_table(e, ["p0"], ["d0", "d1", "d2"]), max_retries=1, decode_fallback=False
        ) as rp,
    ):
        for name in ("d0", "d1", "d2"):
            e[name].faults = Faults(error_event_after_chunks=0)
        res = await ph.stream_completion(rp.session, rp.url, "hello")
        healthy = all(b.healthy for b in rp.registry.backends.values())
    assert res.status == 502, res.text
    assert assert_openai_error(res.text, 502)["type"] == "server_error"
    assert sum(len(e[n].seen()) for n in ("d0", "d1", "d2")) == 2
    assert healthy


async def test_unary_generation_error_in_proxy_vocabulary() -> None:
    """(b) Non-streaming: vLLM answers a failed generation with its status (never a 200
    with an error body), so the engine's 500 goes back as the proxy's server_error."""
    async with (
        ph.engines("p0", "d0", output_tokens=TOKENS) as e,
        ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"])) as rp,
    ):
        e["d0"].faults = Faults(error_event_after_chunks=0)
        body = {"model": "fake", "prompt": "hello", "max_tokens": TOKENS}
        async with rp.session.post(rp.url + "/v1/completions", json=body) as r:
            status, data = r.status, await r.read()
    assert status == 500
    err = assert_openai_error(data, 500)
    assert err["type"] == "server_error" and err["message"] == "Internal server error", err


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_error_event_after_tokens_mapped_not_retried(chat: bool) -> None:
    """(c) The error event after 2 tokens reached the client: passed on as the proxy's
    error event (server_error, the engine's message), then [DONE]; never retried. (Without
    stream migration, which continues it on d1: tests/proxy/test_migration.py.)"""
    async with ph.engines("p0", "d0", "d1", output_tokens=8) as e:
        for name in ("d0", "d1"):
            e[name].faults = Faults(error_event_after_chunks=2)
        t = ph.pd_table(e, ["p0"], ["d0", "d1"])
        async with ph.running_proxy(t, eject_after=1, max_migrations=0) as rp:
            res = await ph.stream_completion(rp.session, rp.url, "hello", chat=chat)
            text = await rp.metrics()
            healthy = all(b.healthy for b in rp.registry.backends.values())
    assert res.status == 200, res.text
    assert len(ph.completion_text(res.events[:-2]).split()) == 2  # two tokens got through
    (err,) = res.error_events
    assert err == {"message": "Internal server error", "type": "server_error", "param": None,
                   "code": 500}, err
    assert res.events[-1] == "[DONE]" and res.events[-2].startswith('{"error"')
    _no_engine_type(res)
    assert len(e["d0"].seen()) + len(e["d1"].seen()) == 1  # never retried
    assert ph.metric_value(text, "pdstack_proxy_requests_total", outcome="stream_error") == 1
    assert ph.metric_value(text, "pdstack_proxy_retries_total") == 0
    assert healthy  # /health passes: not counted


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("route", ["pd", "colocated"])
async def test_client_error_event_passed_through_uncounted(route: str, chat: bool) -> None:
    """(d) A 400 error event (vLLM's BadRequestError) before the first token: the request's
    fault, back to the client as the proxy's 400 invalid_request_error, never retried, the
    backend never counted against (eject_after=1)."""
    async with ph.engines("p0", "d0", "d1", output_tokens=TOKENS) as e:
        for name in ("d0", "d1"):
            e[name].faults = Faults(error_event_after_chunks=0, error_event_status=400)
        async with ph.running_proxy(_table(e, route, ["d0", "d1"]), eject_after=1) as rp:
            results = [await ph.stream_completion(rp.session, rp.url, f"bad {i}", chat=chat)
                       for i in range(4)]
            text = await rp.metrics()
            backends = [rp.registry.backends[n] for n in ("d0", "d1")]
    for res in results:
        assert res.status == 400, res.text
        err = assert_openai_error(res.text, 400)
        assert err["type"] == "invalid_request_error" and "bad request at d" in err["message"]
    assert len(e["d0"].seen()) + len(e["d1"].seen()) == 4  # each tried once
    assert ph.metric_value(text, "pdstack_proxy_retries_total") == 0
    assert ph.metric_value(text, "pdstack_proxy_requests_total", outcome="client_error") == 4
    assert all(b.healthy and b.consecutive_failures == 0 for b in backends)


def test_error_event_shapes() -> None:
    """What counts as an engine's error event, and the status it stands for."""
    nested = {"error": {"message": "Internal server error", "type": "InternalServerError",
                        "param": None, "code": 500}}
    cases: list[tuple[Any, int | None]] = [
        (nested, 500),
        ({"error": {"message": "m", "type": "ServiceUnavailableError", "code": 503}}, 503),
        ({"error": {"message": "m", "type": "BadRequestError"}}, 400),  # no code: its type's
        ({"error": {"message": "m", "type": "SomethingElse"}}, 500),
        ({"object": "error", "message": "too long", "type": "BadRequestError", "code": 400},
         400),  # older vLLM, flat
        ({"error": "Unauthorized"}, 500),
        ({"id": "cmpl-1", "choices": [{"text": " error"}]}, None),
        ({"choices": [{"finish_reason": "error"}]}, None),
        ([1, 2], None),
    ]
    for doc, want in cases:
        assert error_event_status(json.dumps(doc).encode()) == want, doc
    assert error_event_status(b"[DONE]") is None

    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    token = b'data: {"choices":[{"index":0,"text":" t1"}]}\n\n'
    error = b"data: " + json.dumps(nested).encode() + b"\n\n"
    assert leading_error(error + b"data: [DONE]\n\n") == json.dumps(nested).encode()
    assert leading_error(role + error) == json.dumps(nested).encode()
    assert leading_error(token + error) is None  # a token first: mid-stream
    assert leading_error(token) is None and leading_error(role) is None

    rewrite = ErrorEvents()
    assert rewrite(token) == token and rewrite.status is None
    out = rewrite(token + error + b"data: [DONE]\n\n")
    assert out.startswith(token) and out.endswith(b"\n\ndata: [DONE]\n\n")
    mapped = json.loads(out.split(b"\n\n")[1][6:])
    assert mapped == {"error": {"message": "Internal server error", "type": "server_error",
                                "param": None, "code": 500}}
    assert rewrite.status == 500 and "Internal server error" in rewrite.text
