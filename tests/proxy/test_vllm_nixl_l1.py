"""Real vLLM (CPU) 1P1D in kv_mode ``nixl+l1`` behind the proxy, with a real LMCache MP
server as the prefiller's reuse tier.

Every engine setting that matters comes from the planner: a tmp inventory (profile cpu,
kv_mode nixl+l1) goes through ``load_topology`` + ``make_plan``, and each engine gets its
service's ``--kv-transfer-config`` and NIXL side-channel env as planned (the prefiller:
``MultiConnector[NixlConnector kv_producer, LMCacheMPConnector kv_both]``; the decoder:
``NixlConnector kv_consumer`` only; both ``kv_load_failure_policy: fail``).

Asserts, from the engines' own /metrics: the decoder's prompt KV arrived over NIXL
(``external_kv_transfer``); after the prefiller's GPU prefix cache is reset, a second
request with the same long prefix is served from the prefiller's LMCache tier (its
``external_prefix_cache_hits`` rise); and the greedy tokens equal a colocated run (one
engine computing the whole prompt itself, same build and seed).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdstack.plan import Plan, Service, make_plan
from pdstack.testing import proxy_harness as ph
from pdstack.testing import vllm_engines as ve
from pdstack.testing.heavy import heavy_lock
from pdstack.topology import load_topology

pytestmark = pytest.mark.vllm

SOURCE = "vllm:prompt_tokens_by_source_total"
EXT = {"source": "external_kv_transfer"}
HITS = "vllm:external_prefix_cache_hits_total"
SAMPLING: dict[str, Any] = {"model": "tiny", "max_tokens": 16, "temperature": 0}


def _free_pair() -> int:
    """A port p with p and p + 1 free (the planner numbers engine i at base + i)."""
    for _ in range(50):
        base = ve.free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise RuntimeError("no two adjacent free ports")


def nixl_l1_plan(tmp: Path) -> Plan:
    """The planner's view of one CPU node: proxy + LMCache server + 1 prefiller + 1 decoder."""
    inv = tmp / "nixl-l1-cpu"
    (inv / "group_vars").mkdir(parents=True)
    ports = {
        "lmcache_zmq": ve.free_port(),
        "lmcache_http": ve.free_port(),
        "engine_http_base": _free_pair(),
        "nixl_side_channel_base": _free_pair(),
        "proxy": ve.free_port(),
    }
    gv = {
        "pdstack_deployment_name": "nixl-l1-cpu",
        "pdstack_profile": "cpu",
        "pdstack_kv_mode": "nixl+l1",
        "pdstack_engine_image": "pdstack/engine-cpu:dev",
        "pdstack_model": {"name": "/models/tiny", "served_name": "tiny", "max_model_len": 2048},
        "pdstack_lmcache": {"l1_size_gb": 1, "chunk_size": 256},
        "pdstack_ports": ports,
    }
    (inv / "group_vars" / "all.yml").write_text(yaml.safe_dump(gv))
    hosts = {
        "local": {
            "ansible_connection": "local",
            "pdstack_private_address": "127.0.0.1",
            "pdstack_gpu_count": 0,
            "pdstack_proxy": True,
            "pdstack_engines": [
                {"role": "prefill", "cpu_threads_bind": "0", "kv_cache_bytes": 268435456},
                {"role": "decode", "cpu_threads_bind": "1", "kv_cache_bytes": 268435456},
            ],
        }
    }
    doc = {"all": {"children": {"pdstack_nodes": {"hosts": hosts}}}}
    (inv / "hosts.yml").write_text(yaml.safe_dump(doc))
    return make_plan(load_topology(inv))


@dataclass
class Stack:
    plan: Plan
    lmcache: ve.Proc
    prefill: ve.Proc
    decode: ve.Proc


def _engine(plan: Plan, name: str) -> Service:
    return plan.nodes["local"].service(name)


def _start_planned(svc: Service) -> ve.Proc:
    env = {k: v for k, v in svc.env.items() if k.startswith(("VLLM_NIXL", "NIXL_"))}
    env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache (this test only)
    return ve.start_engine(
        f"nixl-l1-{svc.name}",
        svc.ports["http"],
        svc.env["VLLM_CPU_OMP_THREADS_BIND"],
        svc.kv_transfer_config,
        env,
    )


@pytest.fixture(scope="module")
def nixl_l1_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    ve.require_venv()
    with heavy_lock():
        # planned once the lock is ours: its free ports are picked just before use
        plan = nixl_l1_plan(tmp_path_factory.mktemp("inv"))
        lm = plan.nodes["local"].service("lmcache")
        procs: list[ve.Proc] = []
        try:
            lmcache = ve.start_lmcache(lm.ports["zmq"], lm.ports["metrics"])
            procs.append(lmcache)
            ve.wait_port(lmcache, lm.ports["zmq"])
            prefill = _start_planned(_engine(plan, "prefill-0"))
            decode = _start_planned(_engine(plan, "decode-0"))
            procs += [prefill, decode]
            ve.wait_ready([prefill, decode])
            yield Stack(plan, lmcache, prefill, decode)
        finally:
            for proc in reversed(procs):
                proc.stop()


def _reset_prefix_cache(engine: ve.Proc) -> None:
    """Empty the engine's GPU prefix cache. vLLM refuses while blocks are still held (a
    NIXL prefiller keeps a finished prefill's blocks until the decoder has read them):
    retry for a bounded while."""
    deadline = time.monotonic() + 30
    while True:
        req = urllib.request.Request(f"{engine.url}/reset_prefix_cache", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=30) as resp:
            if json.loads(resp.read()).get("success") is True:
                return
        assert time.monotonic() < deadline, f"{engine.name}: prefix cache reset refused for 30 s"
        time.sleep(0.2)


def _delta(before: str, after: str, name: str, **labels: str) -> float:
    return ph.metric_value(after, name, **labels) - ph.metric_value(before, name, **labels)


def test_plan_is_the_nixl_l1_recipe(tmp_path: Path) -> None:
    """What the real run below starts (light: no engines)."""
    plan = nixl_l1_plan(tmp_path)
    pre, dec = _engine(plan, "prefill-0"), _engine(plan, "decode-0")
    assert pre.kv_transfer_config is not None and dec.kv_transfer_config is not None
    assert pre.kv_transfer_config["kv_connector"] == "MultiConnector"
    subs = pre.kv_transfer_config["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in subs] == ["NixlConnector", "LMCacheMPConnector"]
    assert dec.kv_transfer_config["kv_connector"] == "NixlConnector"
    assert dec.kv_transfer_config["kv_role"] == "kv_consumer"
    assert {b.name for b in plan.backend_table.backends} == {"local/prefill-0", "local/decode-0"}


async def test_nixl_l1_handoff_and_prefiller_tier_hit(nixl_l1_stack: Stack) -> None:
    st = nixl_l1_stack
    shared = ve.prompt_of(1000, seed=41)  # about 1000 tokens
    first_prompt = shared + " first question about the engine"
    second_prompt = shared + " second question about the cache"
    # the proxy in front, with the planner's own backend table (URLs as planned)
    async with ph.running_proxy(st.plan.backend_table.model_dump(mode="json")) as rp:
        d0, p0 = ve.scrape(st.decode.url), ve.scrape(st.prefill.url)
        first = await ph.stream_completion(
            rp.session, rp.url, first_prompt, stream_options={"include_usage": True}, **SAMPLING
        )
        d1, p1 = ve.scrape(st.decode.url), ve.scrape(st.prefill.url)
        assert first.status == 200 and not first.error_events, first.text

        # the second turn: the prefiller's GPU prefix cache forgets, its LMCache tier not
        # (the decoder's forgets too, so that it again needs the whole prompt's KV)
        _reset_prefix_cache(st.prefill)
        _reset_prefix_cache(st.decode)
        d1 = ve.scrape(st.decode.url)
        second = await ph.stream_completion(rp.session, rp.url, second_prompt, **SAMPLING)
        d2, p2 = ve.scrape(st.decode.url), ve.scrape(st.prefill.url)
        assert second.status == 200 and not second.error_events, second.text
        proxy_metrics = await rp.metrics()

        # colocated reference: one engine computes the whole prompt itself (no KV params,
        # its GPU prefix cache emptied first; the decoder has no LMCache connector)
        _reset_prefix_cache(st.decode)
        refs = []
        for prompt in (first_prompt, second_prompt):
            async with rp.session.post(
                f"{st.decode.url}/v1/completions", json={**SAMPLING, "prompt": prompt}
            ) as resp:
                assert resp.status == 200, await resp.text()
                data = await resp.json()
            refs.append((data["choices"][0]["text"], data["usage"]["prompt_tokens"]))
            _reset_prefix_cache(st.decode)
        d3 = ve.scrape(st.decode.url)

    (ref1, tokens1), (ref2, tokens2) = refs
    ext1 = _delta(d0, d1, SOURCE, **EXT)
    ext2 = _delta(d1, d2, SOURCE, **EXT)
    hits_first = _delta(p0, p1, HITS)
    hits_second = _delta(p1, p2, HITS)
    pre_ext2 = _delta(p1, p2, SOURCE, **EXT)
    print(
        f"\nnixl+l1: prompt_tokens={tokens1}/{tokens2} decoder external_kv_transfer="
        f"+{ext1:g}/+{ext2:g} prefiller external_prefix_cache_hits=+{hits_first:g}/"
        f"+{hits_second:g} prefiller external_kv_transfer(2nd)=+{pre_ext2:g}"
    )
    assert tokens1 > 768 and tokens2 > 768
    # the handoff: the decoder got (nearly) every prompt token's KV over NIXL, both times
    assert ext1 >= 0.9 * tokens1, "decoder did not receive the first prompt's KV over NIXL"
    assert ext2 >= 0.9 * tokens2, "decoder did not receive the second prompt's KV over NIXL"
    assert ph.metric_value(d2, "vllm:nixl_bytes_transferred_sum") > ph.metric_value(
        d0, "vllm:nixl_bytes_transferred_sum"
    )
    # the tier: nothing to hit the first time; the shared prefix (>= 2 full 256-token
    # chunks) from the node's LMCache server the second time
    assert hits_first == 0
    assert hits_second >= 512, "the prefiller did not load the shared prefix from LMCache"
    assert pre_ext2 >= 512
    # the decoder's direct (reference) runs computed locally: no transfer counted
    assert _delta(d2, d3, SOURCE, **EXT) == 0
    # same greedy tokens as the colocated runs
    assert ph.completion_text(first.events) == ref1
    assert ph.completion_text(second.events) == ref2
    assert ph.metric_value(proxy_metrics, "pdstack_proxy_requests_total", outcome="ok") == 2
