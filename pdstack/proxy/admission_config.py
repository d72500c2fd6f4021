"""The KV-aware admission gate's settings (:mod:`pdstack.proxy.admission`): the proxy's
``--admission-*`` flags (:mod:`pdstack.proxy.admission_flags`) fill them."""

from __future__ import annotations

from dataclasses import dataclass

from pdstack.proxy.wait_budget import BURST_GROWTH, TTFT_SLO_S


@dataclass
class AdmissionConfig:
    enabled: bool = False
    # watermark on an engine's projected peak KV (0..1): prompts + the expected output of
    # each request until it ends (kv_gate.peak_growth), so decode growth is in the
    # projection and the mark can sit near the engine's limit. 0.97:
    # on one H200 (results/h200x1-ceiling/run3) 0.9 held requests the engine ran without a
    # preemption, and the held queue's bursts pushed it into a slower state (81 running at
    # 24 req/s vs 40 at 0.97; TTFT P99 1.67 vs 0.41 s); 0.97 never let it preempt either
    kv_high: float = 0.97
    # the most the watermark rises above kv_high while the engine's own first bytes stay
    # fast under the mark (pdstack.proxy.kv_mark); at kv_high or below: a fixed mark
    kv_learn_max: float = 0.0
    # after an engine's preemption counter rises, count every output at once there (no
    # credit for the requests ending first) for this long: the path was optimistic for it
    # (kv_gate.EngineLoad.cautious: one H100 near its knee, 168-453 preemptions on the path,
    # 0 counting every output at once). 0: the path always
    preempt_caution_s: float = 30.0
    # the output a request is expected to add to KV (its max_tokens when smaller)
    output_tokens: int = 512
    max_running: int = 0  # the proxy's requests active on one engine at once; 0 = no cap
    # prompt tokens in prefill at once per engine that active tenants share by weight
    # (pdstack.proxy.shares; a tenant with nothing in prefill may always send one prompt);
    # 0 = no prefill share. What another tenant's chat waits behind in the engine's queue is
    # at most this: 16,384 let a batch flood keep ~5 long prompts ahead of every chat prompt
    # (one H200: chat TTFT P50 128 -> 92 ms at 2,048, batch -2 %, isolation run 4; one vLLM
    # CPU engine: 188 -> 39 ms, benchmarks/isolation_levers.py). A tenant alone: no share
    prefill_tokens: int = 2048
    # prompt blocks the gate remembers as sent to the engines (least recently used dropped):
    # a prefix among them counts as cached for the prefill share. ~4 M characters, about one
    # engine's GPU KV and host tier (one H200: 345 k tokens on GPU + ~1 M in 32 GiB of host)
    sent_blocks: int = 16384
    scrape_interval_s: float = 0.25  # the engines' /metrics: a correction, not the gate
    # ... while an engine is far below the mark and nobody waits (.scrape_pace)
    scrape_idle_interval_s: float = 2.0
    scrape_timeout_s: float = 1.0
    # an older scrape is not used (the proxy's count alone); above the idle interval + a
    # tick, so an engine read at the idle pace keeps its correction until the next read
    stale_after_s: float = 3.0
    queue_max: int = 4096
    queue_timeout_s: float = 60.0  # the longest wait in the queue; a batch request's budget
    # the TTFT an interactive request should meet (a P99): one predicted to wait past
    # BUDGET_SHARE of it is refused at arrival (pdstack.proxy.wait_budget); 0 = no budget
    ttft_slo_s: float = TTFT_SLO_S
    # a burst is predicted to leave at most this x as fast as the concurrency served lately
    # (pdstack.proxy.wait_budget.BURST_GROWTH; a CPU engine hardly batches: 1)
    burst_growth: float = BURST_GROWTH
    fairness: bool = True  # per-tenant fair queuing + priorities (False: one FIFO)
    # a lower class's request waits while a higher class's awaits its first byte (.shares)
    interactive_first: bool = True
