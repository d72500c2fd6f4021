"""Real vLLM (CPU) prefiller + decoder sharing one real LMCache MP server (shared-l1).

The prefill leg stores the prompt's KV in the node's LMCache store; the decoder reads it
from there (no kv_transfer_params). Also skip-prefill: a prompt whose prefix the proxy
knows is in the store goes straight to the decoder.
"""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest

from pdstack.testing import proxy_harness as ph
from pdstack.testing import vllm_engines as ve
from pdstack.testing.heavy import heavy_lock

pytestmark = pytest.mark.vllm

SOURCE = "vllm:prompt_tokens_by_source_total"
SAMPLING = {"model": "tiny", "max_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def l1_stack() -> Iterator[tuple[ve.Proc, ve.Proc, ve.Proc]]:
    ve.require_venv()
    with heavy_lock():
        procs: list[ve.Proc] = []
        try:
            zmq_port, http_port = ve.free_port(), ve.free_port()
            lmcache = ve.start_lmcache(zmq_port, http_port)
            procs.append(lmcache)
            ve.wait_port(lmcache, zmq_port)
            config = {
                "kv_connector": "LMCacheMPConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "lmcache.mp.host": "tcp://127.0.0.1",
                    "lmcache.mp.port": zmq_port,
                },
            }
            prefill = ve.start_engine("l1-prefill", ve.free_port(), "0", config)
            decode = ve.start_engine("l1-decode", ve.free_port(), "1", config)
            procs += [prefill, decode]
            ve.wait_ready([prefill, decode])
            yield lmcache, prefill, decode
        finally:
            for proc in reversed(procs):
                proc.stop()


def l1_table(prefill: ve.Proc, decode: ve.Proc, threshold: int = 0) -> dict:
    return ph.table(
        "shared-l1",
        [
            {
                "name": "n1/prefill-0",
                "role": "prefill",
                "node": "n1",
                "url": prefill.url,
                "generation": "tiny-s1@cpu",
            },
            {
                "name": "n1/decode-0",
                "role": "decode",
                "node": "n1",
                "url": decode.url,
                "generation": "tiny-s1@cpu",
            },
        ],
        threshold=threshold,
        served_model_name="tiny",
    )


def source_delta(before: str, after: str, source: str) -> float:
    return ph.metric_value(after, SOURCE, source=source) - ph.metric_value(
        before, SOURCE, source=source
    )


async def direct(session: aiohttp.ClientSession, engine: ve.Proc, prompt: str) -> tuple[str, int]:
    async with session.post(
        f"{engine.url}/v1/completions", json={**SAMPLING, "prompt": prompt}
    ) as resp:
        data = await resp.json()
    return data["choices"][0]["text"], data["usage"]["prompt_tokens"]


async def test_shared_l1_decoder_reads_prefill_kv_from_store(
    l1_stack: tuple[ve.Proc, ve.Proc, ve.Proc],
) -> None:
    _, prefill, decode = l1_stack
    prompt = ve.prompt_of(900, seed=11)
    async with ph.running_proxy(l1_table(prefill, decode)) as rp:
        # non-disaggregated reference first: computed from scratch on one engine
        reference, prompt_tokens = await direct(rp.session, prefill, prompt)
        before = ve.scrape(decode.url)
        res = await ph.stream_completion(rp.session, rp.url, prompt, **SAMPLING)
        after = ve.scrape(decode.url)
    ext = source_delta(before, after, "external_kv_transfer")
    local = source_delta(before, after, "local_compute")
    print(
        f"\nshared-l1: prompt_tokens={prompt_tokens} decoder external_kv_transfer=+{ext:g} "
        f"local_compute=+{local:g}"
    )
    assert res.status == 200 and not res.error_events, res.text
    assert prompt_tokens >= 768
    # LMCache works in 256-token chunks: every full chunk must come from the store
    assert ext >= (prompt_tokens // 256) * 256 - 256
    assert ext >= 512
    assert local <= prompt_tokens - ext
    assert ph.completion_text(res.events) == reference


async def test_skip_prefill_goes_straight_to_decoder(
    l1_stack: tuple[ve.Proc, ve.Proc, ve.Proc],
) -> None:
    _, prefill, decode = l1_stack
    shared = ve.prompt_of(900, seed=23)
    async with ph.running_proxy(l1_table(prefill, decode, threshold=200)) as rp:
        first = await ph.stream_completion(
            rp.session, rp.url, shared + " first question", **SAMPLING
        )
        assert first.status == 200 and not first.error_events, first.text
        p_before, d_before = ve.scrape(prefill.url), ve.scrape(decode.url)
        second_prompt = shared + " second question about the cache"
        second = await ph.stream_completion(rp.session, rp.url, second_prompt, **SAMPLING)
        p_after, d_after = ve.scrape(prefill.url), ve.scrape(decode.url)
        proxy_metrics = await rp.metrics()
        reference, prompt_tokens = await direct(rp.session, prefill, second_prompt)
    assert second.status == 200 and not second.error_events, second.text
    assert ph.metric_value(proxy_metrics, "pdstack_proxy_skip_prefill_total") == 1
    assert ph.metric_value(proxy_metrics, "pdstack_proxy_prefix_index_hit_ratio") > 0
    # the prefiller saw nothing; the decoder reused the prefix instead of computing it
    assert ph.metric_value(p_after, "vllm:prompt_tokens_total") == ph.metric_value(
        p_before, "vllm:prompt_tokens_total"
    )
    local = source_delta(d_before, d_after, "local_compute")
    print(
        f"\nskip-prefill: prompt_tokens={prompt_tokens} decoder local_compute=+{local:g} "
        f"external=+{source_delta(d_before, d_after, 'external_kv_transfer'):g} "
        f"local_cache_hit=+{source_delta(d_before, d_after, 'local_cache_hit'):g}"
    )
    assert local <= 0.3 * prompt_tokens
    assert ph.completion_text(second.events) == reference
