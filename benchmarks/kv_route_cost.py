"""What routing by KV events costs the proxy per request, in process (issue 56): the
engine's block hashes of a prompt (sha256 over pickle, one per block) plus the index lookups
and the cost pick over the engines, against today's ring pick alone. No network: the
``/tokenize`` round trip (chat, or text prompts) is measured against a real engine by
``tests/proxy/test_vllm_kv_events.py`` (``pdstack_proxy_kv_tokenize_seconds``).

    .venv/bin/python benchmarks/kv_route_cost.py [--engines 3] [--tokens 512 2048 8192]
"""

from __future__ import annotations

import argparse
import statistics
import time

from prometheus_client import CollectorRegistry

from pdstack.proxy.backends import BackendState
from pdstack.proxy.kv_events_route import KvEventsConfig, KvRouting, RequestBlocks
from pdstack.proxy.kv_index import HashScheme, block_hashes
from pdstack.proxy.routing import HashRing, pick_bounded_load, pick_by_cost


class _Stored:
    def __init__(self, hashes: list[int], tokens: list[int], block: int) -> None:
        self.block_hashes, self.parent_block_hash, self.token_ids = hashes, None, tokens
        self.block_size, self.medium, self.extra_keys = block, "GPU", None


_Stored.__name__ = "BlockStored"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--index-blocks", type=int, default=200_000, help="per engine")
    args = ap.parse_args()
    names = [f"n/engine-{i}" for i in range(args.engines)]
    routing = KvRouting(KvEventsConfig(enabled=False), lambda: None, dict, CollectorRegistry())
    scheme = HashScheme("0")
    for i, name in enumerate(names):  # a full index: other prompts' blocks
        fill = list(range(i * 10**9, i * 10**9 + args.index_blocks))
        routing.index.apply(name, _Stored(fill, [], args.block))
        routing.index.engine(name).scheme = scheme
    backends = {n: BackendState(name=n, role="colocated", node="n", url="", healthy=True)
                for n in names}
    ring = HashRing(names)
    for n_tokens in args.tokens:
        tokens = [(7 * t) % 32000 for t in range(n_tokens)]
        held = block_hashes(tokens, args.block, scheme)
        routing.index.apply(names[-1], _Stored(held[: len(held) // 2], tokens, args.block))
        ring_s, kv_s = [], []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            pick_bounded_load(ring, r, backends, 1.25)
            t1 = time.perf_counter()
            hashes = block_hashes(tokens, args.block, scheme)
            blocks = RequestBlocks(n_tokens, {(scheme, args.block): hashes})
            routing.subscriber = None
            now = time.monotonic()
            costed = [(b, routing.held(b.name, blocks, now=now)) for b in backends.values()]
            chosen, _ = pick_by_cost(costed, n_tokens, routing.config.cpu_hit_cost,
                                     routing.queued_tokens,
                                     miss_weight=routing.config.miss_weight)
            routing.index.route(chosen.name, hashes, now, routing.config.pending_s)
            t2 = time.perf_counter()
            ring_s.append(t1 - t0)
            kv_s.append(t2 - t1)
        print(f"{n_tokens:6d} tokens, {args.engines} engines: ring P50 "
              f"{1e6 * statistics.median(ring_s):.1f} us; hashes + lookups + cost P50 "
              f"{1e6 * statistics.median(kv_s):.1f} us, P99 {1e6 * _pct(kv_s, 0.99):.1f} us")


if __name__ == "__main__":
    main()
