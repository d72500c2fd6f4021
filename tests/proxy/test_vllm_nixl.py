"""Real vLLM (CPU) prefiller + decoder with NIXL (kv_buffer_device cpu) behind the proxy.

Asserts from the engines' own /metrics that the KV really moved (the decoder's prompt
tokens come from `external_kv_transfer`, NIXL bytes were transferred) and that greedy
tokens through the proxy equal a non-disaggregated run of the same engine build.
The engines run as the stacks do: with ``VLLM_API_KEY`` in their environment (they
refuse requests without it; the proxy sends it on both legs) and
``--enable-prompt-tokens-details`` (the proxy reports the prefill leg's cached tokens).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from pdstack.testing import proxy_harness as ph
from pdstack.testing import vllm_engines as ve
from pdstack.testing.heavy import heavy_lock

pytestmark = pytest.mark.vllm

EXT = {"source": "external_kv_transfer"}
LOCAL = {"source": "local_compute"}
SOURCE = "vllm:prompt_tokens_by_source_total"
ENGINE_KEY = "nixl-test-engine-key"
KEYED = {"Authorization": f"Bearer {ENGINE_KEY}"}


@pytest.fixture(scope="module")
def nixl_engines() -> Iterator[tuple[ve.Proc, ve.Proc]]:
    ve.require_venv()
    with heavy_lock():
        procs: list[ve.Proc] = []
        try:
            for name, role, cpu in (
                ("nixl-prefill", "kv_producer", "0"),
                ("nixl-decode", "kv_consumer", "1"),
            ):
                side = {
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ve.free_port()),
                    "VLLM_API_KEY": ENGINE_KEY,
                }
                config = {
                    "kv_connector": "NixlConnector",
                    "kv_role": role,
                    "kv_buffer_device": "cpu",
                }
                procs.append(
                    ve.start_engine(
                        name, ve.free_port(), cpu, config, side, ["--enable-prompt-tokens-details"]
                    )
                )
            ve.wait_ready(procs)
            yield procs[0], procs[1]
        finally:
            for proc in procs:
                proc.stop()


def pd_table(prefill: ve.Proc, decode: ve.Proc) -> dict:
    return ph.table(
        "nixl",
        [
            {
                "name": "n1/prefill-0",
                "role": "prefill",
                "node": "n1",
                "url": prefill.url,
                "generation": "tiny-s1@cpu",
            },
            {
                "name": "n2/decode-0",
                "role": "decode",
                "node": "n2",
                "url": decode.url,
                "generation": "tiny-s1@cpu",
            },
        ],
        served_model_name="tiny",
    )


def usage_of(events: list[str]) -> dict:
    for event in reversed(events):
        if event.startswith("{") and '"usage"' in event:
            usage = json.loads(event).get("usage")
            if usage:
                return usage
    raise AssertionError("no usage event")


async def test_nixl_kv_moves_and_tokens_match_single_engine(
    nixl_engines: tuple[ve.Proc, ve.Proc],
) -> None:
    prefill, decode = nixl_engines
    prompt = ve.prompt_of(450, seed=1)
    sampling = {"model": "tiny", "max_tokens": 16, "temperature": 0}
    async with ph.running_proxy(pd_table(prefill, decode), engine_api_key=ENGINE_KEY) as rp:
        before = ve.scrape(decode.url)
        res = await ph.stream_completion(
            rp.session,
            rp.url,
            prompt,
            headers={"X-Request-Id": "nixl-it-1"},
            stream_options={"include_usage": True},
            **sampling,
        )
        after = ve.scrape(decode.url)
        assert res.status == 200, res.text
        assert res.headers["X-Request-Id"] == "nixl-it-1"
        assert not res.error_events and res.events[-1] == "[DONE]"
        # non-disaggregated reference: the same request straight to one engine, no KV params
        async with rp.session.post(
            f"{prefill.url}/v1/completions", json={**sampling, "prompt": prompt}, headers=KEYED
        ) as resp:
            reference = (await resp.json())["choices"][0]["text"]
        # the non-streaming path through the proxy too
        async with rp.session.post(
            f"{rp.url}/v1/completions", json={**sampling, "prompt": prompt}
        ) as resp:
            assert resp.status == 200
            non_stream = (await resp.json())["choices"][0]["text"]
        proxy_metrics = await rp.metrics()

    prompt_tokens = usage_of(res.events)["prompt_tokens"]
    streamed = ph.completion_text(res.events)
    ext = ph.metric_value(after, SOURCE, **EXT) - ph.metric_value(before, SOURCE, **EXT)
    local = ph.metric_value(after, SOURCE, **LOCAL) - ph.metric_value(before, SOURCE, **LOCAL)
    nixl_lines = [ln for ln in after.splitlines() if ln.startswith("vllm:nixl")]
    print(
        f"\nprompt_tokens={prompt_tokens} decoder external_kv_transfer=+{ext:g} "
        f"local_compute=+{local:g}\n" + "\n".join(nixl_lines[:12])
    )
    print(f"streamed={streamed!r}\nreference={reference!r}")
    assert prompt_tokens > 300
    assert ext >= 0.9 * prompt_tokens, "the decoder did not receive the prompt's KV over NIXL"
    assert local <= 0.1 * prompt_tokens
    assert ph.metric_value(after, "vllm:nixl_bytes_transferred_sum") > ph.metric_value(
        before, "vllm:nixl_bytes_transferred_sum"
    )
    assert streamed == reference
    assert non_stream == reference
    assert ph.metric_value(proxy_metrics, "pdstack_proxy_requests_total", outcome="ok") == 2


async def test_nixl_chat_through_proxy(nixl_engines: tuple[ve.Proc, ve.Proc]) -> None:
    prefill, decode = nixl_engines
    system = ve.prompt_of(300, seed=2)
    async with ph.running_proxy(pd_table(prefill, decode), engine_api_key=ENGINE_KEY) as rp:
        before = ve.scrape(decode.url)
        res = await ph.stream_completion(
            rp.session, rp.url, system, chat=True, model="tiny", max_tokens=8, temperature=0
        )
        after = ve.scrape(decode.url)
    assert res.status == 200 and not res.error_events, res.text
    assert ph.completion_text(res.events)
    assert ph.metric_value(after, SOURCE, **EXT) - ph.metric_value(before, SOURCE, **EXT) > 200


async def test_engine_key_refused_without_served_with_and_cached_tokens(
    nixl_engines: tuple[ve.Proc, ve.Proc],
) -> None:
    """An engine started with VLLM_API_KEY refuses a request without it (the private
    network alone does not reach it); a proxy without the key gets that 401 back to the
    client as is (no retry, no ejection); the proxy with the key is served, and tells
    the client the prefill leg's cached tokens (0, then the prompt's cached blocks)."""
    prefill, decode = nixl_engines
    prompt = ve.prompt_of(200, seed=14)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    async with ph.running_proxy(pd_table(prefill, decode)) as unkeyed:
        backends = list(unkeyed.registry.backends.values())
        # the first health round settles first (0.5 s probe budget: a loaded CI machine)
        await ph.until(lambda: all(b.healthy for b in backends), "both engines healthy", 20)
        for engine in (prefill, decode):
            async with unkeyed.session.post(f"{engine.url}/v1/completions", json=body) as resp:
                assert resp.status == 401, await resp.text()
        async with unkeyed.session.post(f"{unkeyed.url}/v1/completions", json=body) as resp:
            assert resp.status == 401  # the engine's answer, passed through
        text = await unkeyed.metrics()
        # the client's 401 took no engine out of service (a health flap under load may come
        # and go; an ejection for the 401 would show here)
        assert ph.metric_value(text, "pdstack_proxy_ejections_total") == 0, text
        await ph.until(lambda: all(b.healthy for b in backends), "both engines still healthy", 20)
        assert ph.metric_value(text, "pdstack_proxy_retries_total") == 0
    async with ph.running_proxy(pd_table(prefill, decode), engine_api_key=ENGINE_KEY) as rp:
        usages = []
        for _ in range(2):
            res = await ph.stream_completion(
                rp.session,
                rp.url,
                prompt,
                model="tiny",
                max_tokens=4,
                temperature=0,
                stream_options={"include_usage": True},
            )
            assert res.status == 200 and not res.error_events, res.text
            usages.append(usage_of(res.events))
        async with rp.session.post(f"{rp.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            unary = (await resp.json())["usage"]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    print(f"\nprompt_tokens={usages[0]['prompt_tokens']} cached={cached} unary={unary}")
    assert cached[0] == 0  # a new prompt: nothing in the prefiller's cache
    assert 16 <= cached[1] <= usages[1]["prompt_tokens"]  # its blocks, the second time
    assert unary["prompt_tokens_details"]["cached_tokens"] == cached[1]
