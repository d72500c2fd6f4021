"""Issue 35's per-mode JSONs and table from gpu/run_seeds.sh's runs (results/h200x1-seeds).

    python gpu/summarize_seeds.py results/h200x1-seeds

Reads runN/<mode>-check.json (tokens, KV-path counters) and runN/<mode>-bench.json (the
many-tenants sweep) as listed in SOURCES, writes <mode>.json per mode (verdict, counters, the
sweep's rows) and prints the markdown table of results/h200x1-seeds/README.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# mode -> (inventory, engines, check file, bench file): which run measured what
SOURCES: dict[str, tuple[str, str, str, str]] = {
    "colocated": ("h200x1-seed-colocated", "1 colocated (the yardstick)",
                  "run2/colocated-check.json", "run1/colocated-bench.json"),
    "lmcache-pd": ("h200x1-seed-lmcache-pd", "1P1D, 4 GiB receive buffer",
                   "run3/lmcache-pd-check.json", "run3/lmcache-pd-bench.json"),
    "lmcache-pd-1g": ("h200x1-seed-lmcache-pd", "1P1D, 1 GiB receive buffer (inventory's)",
                      "run2/lmcache-pd-check.json", "run2/lmcache-pd-bench.json"),
    "nixl-2p2d": ("h200x1-seed-nixl-2p2d", "2P2D (+ native tier on P)",
                  "run2/nixl-2p2d-check.json", "run1/nixl-2p2d-bench.json"),
    "shared-l1-1p2d": ("h200x1-seed-shared-l1-1p2d", "1P2D on one LMCache L1",
                       "run2/shared-l1-1p2d-check.json", "run1/shared-l1-1p2d-bench.json"),
    "shared-l1-nixl": ("h200x1-seed-shared-l1-nixl", "node a 1P1D + node b 1D",
                       "run4/shared-l1-nixl-check.json", "run4/shared-l1-nixl-bench.json"),
    "nixl-l1": ("h200x1-seed-nixl-l1", "1P1D (+ LMCache L1 on P)",
                "run2/nixl-l1-check.json", "run1/nixl-l1-bench.json"),
    "colocated-l1": ("h200x1-seed-colocated-l1", "1 colocated + LMCache L1",
                     "run2/colocated-l1-check.json", "run1/colocated-l1-bench.json"),
    # run 4 (a later session, fresh machine): the same modes again
    "lmcache-pd-run4": ("h200x1-seed-lmcache-pd", "1P1D, 4 GiB receive buffer (repeat)",
                        "run4/lmcache-pd-check.json", "run4/lmcache-pd-bench.json"),
    "nixl-2p2d-run4": ("h200x1-seed-nixl-2p2d", "2P2D (+ native tier on P) (repeat)",
                       "run4/nixl-2p2d-check.json", "run4/nixl-2p2d-bench.json"),
}


def kv_moved(counters: dict[str, Any]) -> dict[str, float]:
    """Per service, the counters that show the KV path: tokens from external KV (NIXL, the
    LMCache store, the push), NIXL bytes, LMCache chunks read/written, native-tier stores."""
    keys = ("source=external_kv_transfer", "nixl_bytes_transferred_sum",
            "lmcache_mp_l1_read_chunks_total", "lmcache_mp_l1_write_chunks_total",
            "kv_offload_store_bytes_total", "source=local_compute")
    out: dict[str, float] = {}
    for svc, c in counters.items():
        if not isinstance(c, dict):
            continue
        for name, value in c.items():
            for k in keys:
                if k in name:
                    short = k.removeprefix("source=")
                    out[f"{svc} {short}"] = out.get(f"{svc} {short}", 0.0) + value
    return out


def sweep_rows(bench: dict[str, Any], root: Path) -> list[dict[str, Any]]:
    rows = []
    for r in bench["results"]:
        total = r["prometheus"].get("total", {}) if isinstance(r.get("prometheus"), dict) else {}
        rows.append({
            "rate": r["request_rate"], "served_rate": r["served_rate"],
            "completed": r["completed"], "failed": r["failed"], "errors": r["errors"],
            "ttft_p50_ms": r["p50_ttft_ms"], "ttft_p99_ms": r["p99_ttft_ms"],
            "meets_ttft_slo": r["meets_ttft_slo"],
            "prompt_tokens_by_source": total.get("prompt_tokens_by_source"),
            # per engine: which path its prompt tokens came by (a remote decoder's NIXL leg)
            "by_endpoint": {
                url: e.get("prompt_tokens_by_source")
                for url, e in r["prometheus"].get("endpoints", {}).items()
                if isinstance(e, dict) and e.get("prompt_tokens_by_source")
            },
        })
    return rows


def main(root: Path) -> None:
    print("| mode | inventory | engines | tokens match | KV moved (check, 6 requests) | "
          "8 req/s: served, TTFT P50 / P99 ms | 16 req/s: served, TTFT P50 / P99 ms | "
          "failed |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, (inv, engines, check_f, bench_f) in SOURCES.items():
        check = json.loads((root / check_f).read_text())
        bench = json.loads((root / bench_f).read_text())
        rows = sweep_rows(bench, root)
        moved = kv_moved(check["counters"])
        failed = sum(r["failed"] for r in rows)
        out = {
            "mode": mode, "inventory": f"inventory/{inv}", "engines": engines,
            "model": "deepseek-v2-mini (gpu/models: V2-Lite's MLA + MoE, 4 layers, 16 experts, "
                     "dummy weights, --enforce-eager): proves KV paths, not performance",
            "check": check_f, "bench": bench_f,
            "tokens_match": check["tokens_match"],
            "yardstick_warm_matches_cold": check["yardstick_warm_vs_cold"]["tokens_match"],
            "kv_moved": moved, "sweep": rows, "failed_requests": failed,
        }
        (root / f"{mode}.json").write_text(json.dumps(out, indent=1) + "\n")
        moved_s = "; ".join(f"{k} {v:,.0f}" for k, v in moved.items()
                            if not k.endswith("local_compute") and v)
        cells = [f"{r['served_rate']:.1f} / {r['rate']:.0f}, {r['ttft_p50_ms']:.0f} / "
                 f"{r['ttft_p99_ms']:.0f}" for r in rows]
        print(f"| [{mode}]({mode}.json) | `{inv}` | {engines} | "
              f"{'yes' if check['tokens_match'] else 'NO'} | {moved_s} | "
              f"{' | '.join(cells)} | {failed} |")


def fault(root: Path) -> None:
    """nixl-2p2d-fault.json: the prefiller killed under load (run 2), from its bench JSONs and
    the launcher's lines."""
    during = json.loads((root / "run2/nixl-2p2d-fault-bench.json").read_text())["results"][0]
    after = json.loads((root / "run2/nixl-2p2d-after-bench.json").read_text())["results"][0]
    text = (root / "run2/nixl-2p2d-fault-restart.txt").read_text()
    back_s = float(text.split("healthy again ")[1].split(" s")[0])
    served_after = [float(line.rsplit(" ", 1)[1]) for line in text.split("--")[1].splitlines()
                    if 'finished_reason="length"' in line]
    out = {
        "inventory": "inventory/h200x1-seed-nixl-2p2d", "killed": "prefill-0 (SIGKILL, +12 s)",
        "during": {k: during[k] for k in ("request_rate", "completed", "failed", "errors",
                                           "p50_ttft_ms", "p99_ttft_ms", "max_ttft_ms")},
        "healthy_again_s": back_s,
        "after": {k: after[k] for k in ("request_rate", "completed", "failed", "p99_ttft_ms")},
        "killed_prefiller_requests_after_restart": served_after[0] if served_after else None,
        "sources": ["run2/nixl-2p2d-fault-bench.json", "run2/nixl-2p2d-after-bench.json",
                    "run2/nixl-2p2d-fault-restart.txt"],
    }
    (root / "nixl-2p2d-fault.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    fault(Path(sys.argv[1]))
