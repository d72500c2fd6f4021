"""The routes the proxy forwards to an engine as they are (/tokenize, /detokenize,
/v1/models/{model}) and the one error vocabulary: the engines' errors reach the client with
the proxy's own `type` values (OpenAI's), whatever the engine called them.

The engines are the fake engine (a test double that answers vLLM's shapes and vLLM's error
type names); the real vLLM engines behind the real proxy are in tests/e2e/test_first_day.py."""

from __future__ import annotations

import json

from pdstack.proxy.errors import OPENAI_TYPES, engine_error
from pdstack.testing import proxy_harness as ph


def _pd(e: dict) -> dict:
    return ph.pd_table(e, ["p0"], ["d0"], kv_mode="shared-l1")


async def test_tokenize_and_detokenize_reach_an_engine_of_the_model() -> None:
    async with ph.engines("p0", "d0") as e, ph.running_proxy(_pd(e)) as rp:
        body = {"model": "fake", "prompt": "the prefix is shared the prefix"}
        async with rp.session.post(
            rp.url + "/tokenize", json=body, headers={"X-Request-Id": "tok-1"}
        ) as r:
            assert r.status == 200, await r.text()
            assert r.headers["X-Request-Id"] == "tok-1"
            tok = await r.json()
        assert tok["count"] == 6 and tok["tokens"] == [0, 1, 2, 3, 0, 1], tok
        assert tok["max_model_len"] > 0
        async with rp.session.post(
            rp.url + "/detokenize", json={"model": "fake", "tokens": tok["tokens"]}
        ) as r:
            assert r.status == 200
            assert (await r.json())["prompt"] == body["prompt"]
        # the decoder answers (it serves the final legs); the prefiller saw nothing
        assert [s.path for s in e["d0"].requests] == ["/tokenize", "/detokenize"]
        assert e["d0"].requests[0].headers["x-request-id"] == "tok-1"
        assert not e["p0"].requests


async def test_tokenize_falls_over_to_another_engine_and_names_the_model() -> None:
    async with ph.engines("p0", "d0") as e, ph.running_proxy(_pd(e)) as rp:
        e["d0"].faults.health_status = 503
        await ph.until(lambda: not rp.registry.backends["d0"].usable, "d0 marked unhealthy")
        async with rp.session.post(rp.url + "/tokenize", json={"prompt": "a b"}) as r:
            assert r.status == 200
            assert (await r.json())["count"] == 2
        assert [s.path for s in e["p0"].requests] == ["/tokenize"]
        # a model this stack does not serve: the proxy's 404, no engine asked
        async with rp.session.post(
            rp.url + "/tokenize", json={"model": "gpt-4", "prompt": "a"}
        ) as r:
            assert r.status == 404
            err = (await r.json())["error"]
        assert err["type"] == "not_found_error" and err["param"] == "model", err
        assert "gpt-4" in err["message"]
        assert len(e["p0"].requests) == 1
        async with rp.session.post(rp.url + "/detokenize", data=b"{nope") as r:
            assert r.status == 400
            assert (await r.json())["error"]["type"] == "invalid_request_error"
        e["p0"].faults.health_status = 503
        await ph.until(lambda: not rp.registry.backends["p0"].usable, "p0 marked unhealthy")
        async with rp.session.post(rp.url + "/tokenize", json={"prompt": "a"}) as r:
            assert r.status == 503
            assert (await r.json())["error"]["type"] == "server_error"


async def test_models_list_and_retrieve() -> None:
    async with ph.engines("p0", "d0") as e, ph.running_proxy(_pd(e)) as rp:
        async with rp.session.get(rp.url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["fake"]
        async with rp.session.get(rp.url + "/v1/models/fake") as r:
            assert r.status == 200
            model = await r.json()
        assert model["id"] == "fake" and model["object"] == "model"
        async with rp.session.get(rp.url + "/v1/models/other") as r:
            assert r.status == 404
            err = (await r.json())["error"]
        assert err["type"] == "not_found_error" and err["param"] == "model"


async def test_engine_errors_use_the_proxy_vocabulary() -> None:
    """The same cause, the same `type`: the proxy's own 404 for an unknown model, and the
    engine's 400 for max_tokens past its context (vLLM says BadRequestError), streamed
    and not, P/D and colocated."""
    async with ph.engines("p0", "d0", "c0", max_model_len=64) as e:
        pd = _pd(e)
        colocated = ph.table("colocated", [ph.backend("c0", "colocated", e["c0"])])
        for t in (pd, colocated):
            async with ph.running_proxy(t) as rp:
                for stream in (True, False):
                    body = {"model": "fake", "prompt": "one two three", "max_tokens": 500,
                            "stream": stream}
                    async with rp.session.post(rp.url + "/v1/completions", json=body) as r:
                        assert r.status == 400
                        assert r.headers["Content-Type"].startswith("application/json")
                        err = (await r.json())["error"]
                    assert err["type"] == "invalid_request_error", err
                    assert "max_tokens" in err["message"] and err["code"] == 400, err
                    assert set(err) == {"message", "type", "param", "code"}
                body = {"model": "nope", "prompt": "x", "max_tokens": 4}
                async with rp.session.post(rp.url + "/v1/completions", json=body) as r:
                    assert r.status == 404
                    err = (await r.json())["error"]
                assert err["type"] == "not_found_error" and err["param"] == "model", err
        # an engine's 5xx whose /health passes goes back as is: as server_error
        e["c0"].faults.poison = "boom"
        async with ph.running_proxy(colocated) as rp:
            body = {"model": "fake", "prompt": "boom", "max_tokens": 4}
            async with rp.session.post(rp.url + "/v1/completions", json=body) as r:
                assert r.status == 500
                err = (await r.json())["error"]
        assert err["type"] == "server_error" and "poisoned" in err["message"], err


def test_engine_error_bodies_of_every_shape() -> None:
    cases = [
        # vLLM 0.32: {"error": {...}} with its class names
        (404, {"error": {"message": "no such model", "type": "NotFoundError", "param": "model",
                         "code": 404}}, "not_found_error", "no such model", "model"),
        # older vLLM: flat, "object": "error"
        (400, {"object": "error", "message": "too long", "type": "BadRequestError",
               "param": None, "code": 400}, "invalid_request_error", "too long", None),
        # vLLM's --api-key middleware
        (401, {"error": "Unauthorized"}, "authentication_error", "Unauthorized", None),
        (503, {"error": {"message": "overloaded", "type": "ServiceUnavailableError"}},
         "server_error", "overloaded", None),
    ]
    for status, doc, want_type, want_message, want_param in cases:
        err = json.loads(engine_error(status, json.dumps(doc).encode()))["error"]
        assert err == {"message": want_message, "type": want_type, "param": want_param,
                       "code": status}, (status, doc, err)
        assert err["type"] in OPENAI_TYPES
    plain = json.loads(engine_error(500, b"Internal Server Error"))["error"]
    assert plain["message"] == "Internal Server Error" and plain["type"] == "server_error"
    empty = json.loads(engine_error(502, b""))["error"]
    assert empty["message"] == "engine answered 502" and empty["code"] == 502
