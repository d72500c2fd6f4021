"""A real vLLM (CPU) engine publishing its KV events to the proxy (issue 56).

The engine runs as the planner starts it (``--kv-events-config`` with its PUB connecting to
the proxy's SUB, a replay ROUTER on its own address, ``PYTHONHASHSEED=0``). The proxy's
prediction of a request's cached tokens (its index lookup of the request's block hashes,
computed from token ids it was given or got from the engine's ``/tokenize``) must equal
what the engine then reports (``usage.prompt_tokens_details.cached_tokens``) within one
block: for completions with token ids, and chat through the template with ``cache_salt``.

A second backend names the same engine with a replay endpoint nobody answers (its
publisher down): a request whose ring home it is goes there by hash, and the metrics say
so. No timing assertions: a starved engine only makes it slower.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from pdstack.proxy.kv_events_route import KvEventsConfig
from pdstack.proxy.routing import prompt_text, stable_hash
from pdstack.testing import proxy_harness as ph
from pdstack.testing import vllm_engines as ve
from pdstack.testing.heavy import heavy_lock
from pdstack.testing.ports import free_port

pytestmark = pytest.mark.vllm

NAMES = ("n1/engine-0", "n1/engine-1")


@pytest.fixture(scope="module")
def kv_engine() -> Iterator[tuple[ve.Proc, int, int]]:
    ve.require_venv()
    with heavy_lock():
        sub_port, replay_port = free_port(), free_port()
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{sub_port}",  # connects: the proxy binds
            "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
            "topic": NAMES[0],
        }
        proc = ve.start_engine(
            "kv-events", ve.free_port(), "1", None, {"PYTHONHASHSEED": "0"},
            ["--enable-prompt-tokens-details", "--kv-events-config", json.dumps(config)],
        )
        try:
            ve.wait_ready([proc])
            yield proc, sub_port, replay_port
        finally:
            proc.stop()


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] == name and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_predicted_cached_tokens_are_the_engines(kv_engine: Any) -> None:
    proc, sub_port, replay_port = kv_engine
    backends = [{"name": n, "role": "colocated", "node": "n1", "url": proc.url,
                 "generation": "g"} for n in NAMES]
    table = ph.table("colocated", backends, served_model_name=ve.SERVED_NAME)
    kv = KvEventsConfig(
        host="127.0.0.1", port=sub_port, heartbeat_s=1.0, stale_after_s=120.0,
        sources={NAMES[0]: f"tcp://127.0.0.1:{replay_port}",
                 NAMES[1]: f"tcp://127.0.0.1:{free_port()}"},  # its publisher is down
    )
    async with ph.running_proxy(table, kv_events=kv) as rp:
        await ph.until(lambda: all(rp.registry.backends[n].usable for n in NAMES), "up", 60)
        routing = rp.proxy.kv_routing
        ring = rp.proxy._ring_for("colocated")

        def home(body: dict[str, Any]) -> str:
            return next(ring.walk(stable_hash(prompt_text(body)[:1024])))

        def first_with_home(make: Any, name: str) -> dict[str, Any]:
            return next(b for b in (make(i) for i in range(200)) if home(b) == name)

        async def send(path: str, body: dict[str, Any]) -> tuple[int, str, int]:
            """(cached tokens the engine reported, the decision, its prediction)."""
            async with rp.session.post(rp.url + path, json=body) as resp:
                answer = await resp.json()
                assert resp.status == 200, answer
                request_id = resp.headers["X-Request-Id"]
            decision = next(d for d in routing.recent if d.request_id == request_id)
            details = answer["usage"].get("prompt_tokens_details") or {}
            return int(details.get("cached_tokens") or 0), decision.decision, \
                decision.predicted_cached_tokens

        # ---- completions with token ids: a warm-up, then a longer prompt sharing it
        def ids(i: int) -> dict[str, Any]:
            return {"model": ve.SERVED_NAME, "max_tokens": 1, "temperature": 0,
                    "prompt": [100 + (i * 37 + t * 11) % 3900 for t in range(300)]}

        warm = first_with_home(ids, NAMES[0])
        await send("/v1/completions", warm)
        await ph.until(lambda: routing.state(NAMES[0]) == "fresh", "engine-0 verified", 30)
        block = routing.index.engine(NAMES[0]).block_size
        assert block > 0
        longer = {**warm, "prompt": warm["prompt"] + [7, 8, 9] * 40}
        cached, decision, predicted = await send("/v1/completions", longer)
        print(f"token ids: block {block}, engine cached {cached}, proxy predicted {predicted}")
        assert decision == "cost"
        assert predicted >= block and abs(cached - predicted) <= block, (cached, predicted)

        # ---- chat through the template, with a cache_salt (tokens from /tokenize)
        def chat(i: int, salt: str = "tenant-a") -> dict[str, Any]:
            return {"model": ve.SERVED_NAME, "max_tokens": 1, "temperature": 0,
                    "cache_salt": salt, "messages": [
                        {"role": "system", "content": ve.prompt_of(220, seed=i)},
                        {"role": "user", "content": "What now?"}]}

        first = first_with_home(chat, NAMES[0])
        cached0, _, _ = await send("/v1/chat/completions", first)
        assert cached0 == 0
        await ph.until(lambda: routing.index.engine(NAMES[0]).salt_known, "salted block seen", 30)
        again = {**first, "messages": [*first["messages"], {"role": "assistant", "content": "x"},
                                       {"role": "user", "content": "And then?"}]}
        cached, decision, predicted = await send("/v1/chat/completions", again)
        print(f"chat + cache_salt: engine cached {cached}, proxy predicted {predicted}")
        assert decision == "cost"
        assert predicted >= block and abs(cached - predicted) <= block, (cached, predicted)
        # another salt: nothing is shared, by the engine's count and the proxy's
        other = {**again, "cache_salt": "tenant-b"}
        cached, decision, predicted = await send("/v1/chat/completions", other)
        assert (cached, predicted) == (0, 0)

        # ---- engine-1's publisher is down: its requests go by hash, and the metrics say so
        down = first_with_home(lambda i: ids(1000 + i), NAMES[1])
        _, decision, predicted = await send("/v1/completions", down)
        assert (decision, predicted) == ("hash_missing", 0)
        text = await rp.metrics()
        assert _metric(text, "pdstack_proxy_kv_route_total", decision="hash_missing") >= 1
        assert _metric(text, "pdstack_proxy_kv_events_state",
                       backend=NAMES[1], state="missing") == 1
        assert _metric(text, "pdstack_proxy_kv_events_state",
                       backend=NAMES[0], state="fresh") == 1
        count = _metric(text, "pdstack_proxy_kv_tokenize_seconds_count")
        total = _metric(text, "pdstack_proxy_kv_tokenize_seconds_sum")
        assert count >= 2  # the chat requests were tokenized by the engine
        print(f"/tokenize: {count:.0f} calls, mean {1000 * total / count:.1f} ms")
