"""gpu/'s one summarizer: the tables and acceptance of gpu/run_ceiling.sh's sweeps.

    python gpu/summarize_ceiling.py DIR [--json OUT]

Goodput is the highest asked rate whose TTFT meets the SLO (P50 and P99, the bench's
``meets_ttft_slo``). The acceptance (issue 36):
- many-tenants: pdstack's goodput >= 1.6x vLLM-with-defaults' and >= 1.25x the native tier's;
  at every rate where the native tier alone meets the SLO, pdstack's TTFT P99 <= 1.1x its;
- multi-turn: at every rate where vLLM with its defaults meets the SLO, pdstack's TTFT P50 and
  P99 within 10 % of vLLM's or within 10 ms (whichever is larger), served within 3 %.
Issue 37 (chat-/over-/flood-STACK.json beside NAME-batch.json, batch-STACK.json): chat's TTFT,
ITL P90 and queue wait, the batch tenant's served rate and 429 / 5xx, the proxy's holds; against
chat alone and the batch tenant alone on the same engine: ``flood-``: chat P99 <= 3x alone,
P50 <= 2x, every chat request served, batch >= 50 % of alone, no 5xx; ``over-``: P99 <= 2x.
Issue 56 (``rt-*`` / ``turn-rt-*``: three engines of one model, the same engines behind one
front at a time): per rate served, SLO %, TTFT, output tok/s and each engine's prefix-cache hit
ratio; goodput counts a rate only with 0 failed. The acceptance (many-tenants): pdstack >= 1.5x
round robin's goodput, >= 1.15x cache_aware's, >= kv_aware's with TTFT P99 <= 1.1x its at every
rate both meet, >= its own hash ring's; multi-turn: P50 and P99 within 10 % of kv_aware's.
A folder's sections are those of the sweeps it holds (a routing folder: only issue 56's).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from statistics import mean
from typing import Any

# sweep name -> what ran (one engine each, 10 GiB KV, GPU 0; same seed and rates)
STACKS = {
    "vllm-default": "`vllm serve`, its own defaults (no proxy)",
    "vllm-native": "vLLM + `--kv-offloading-size 32` (its native tier, no proxy)",
    "pdstack-default": "**pdstack default** (`inventory/h200x1`: native tier 32 GiB + the gate)",
    "pdstack-default-before": "pdstack default behind an older proxy (`OLD_REV`: machine.txt)",
    "pdstack-engine": "pdstack's default engine straight (no proxy)",
    "pdstack-gate-off": "pdstack default with `--admission off` (the relay alone)",
    "pdstack-kv97": "pdstack default with `--admission-kv-high 0.97` (the gate's mark)",
    "pdstack-caution0": "pdstack default with `--admission-preempt-caution 0`",
    "pdstack-nomigr": "pdstack default with `--max-migrations 0` (no `return_token_ids`)",
}
WORKLOADS = {"": "many-tenants", "turn-": "multi-turn", "seed-": "seed", "long-": "long-input"}
# issue 56's fronts (rt-*), on the engines of RT_ENGINES (gpu/run_ceiling.sh)
FRONTS = {
    "rt-pdstack": "**pdstack** (KV-event routing, its admission)",
    "rt-ring": "pdstack, `--kv-events off` (its hash ring + session affinity)",
    "rt-rr": "vllm-router `round_robin`",
    "rt-ca": "vllm-router `cache_aware`",
    "rt-kv": "vllm-router `kv_aware` (the engines' KV events)",
    "rt-pd-w1": "pdstack, `--kv-miss-weight 1` (a miss weighs what a queued token does)",
    "rt-pd-63": "pdstack, stop 63's cost (`--kv-miss-weight 1 --kv-pending-s 0`)",
    "rt-pd-open": "pdstack's routing, its admission off (`--admission off`)",
    "rt-pd-kv12": "pdstack, its gate's watermark at 1.2 of the KV (`--admission-kv-high 1.2`)",
    "rt-pd-learn": "pdstack, its watermark learned per engine from its first bytes, 0.97 to 1.5 "
    "(`--admission-kv-learn-max 1.5`)",
    "rt-pd-cost": "pdstack, a prompt no engine holds to the least queued "
    "(`--kv-unheld cost`)",
    "rt-pd-w8": "pdstack, a miss weighs 8 queued tokens (`--kv-miss-weight 8`)",
    "rt-pd-w2": "pdstack, a miss weighs 2 queued tokens (`--kv-miss-weight 2`, the default "
    "until routing run 4)",
    "rt-pd-w16": "pdstack, a miss weighs 16 queued tokens (`--kv-miss-weight 16`)",
}
ENGINE_PORTS = ("8290", "8291", "8292")


def rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"rate": r["request_rate"], "served": r["served_rate"], "p50": r["p50_ttft_ms"],
             "p99": r["p99_ttft_ms"], "preempt": r.get("preemptions"),
             "itl": r.get("p50_itl_ms"), "out": r.get("output_throughput")}
            for r in run["results"]]


def fmt(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def goodput(results: list[dict[str, Any]], no_failed: bool = False) -> float:
    """The highest asked rate that met the TTFT SLO (with ``no_failed``: and failed none)."""
    ok = [r["request_rate"] for r in results
          if r.get("meets_ttft_slo") and not (no_failed and r.get("failed"))]
    return max(ok, default=0.0)


def table(runs: dict[str, dict[str, Any]], prefix: str) -> str:
    # ITL and output tok/s beside served: run 2's cap was the engine's step at the same
    # batch (results/h200x1-ceiling/run2), not what the gate let in
    lines = ["| stack | asked req/s | served req/s | TTFT P50 ms | TTFT P99 ms | preemptions "
             "| ITL P50 ms | output tok/s | goodput req/s | JSON |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    named = [(name, what + label) for key, what in STACKS.items()
             for name, label in repeats(runs, prefix + key)]
    for name, what in named:
        rs = rows(runs[name])

        def j(f: str, s: str = ".0f", rs: list[dict[str, Any]] = rs) -> str:
            return " / ".join(fmt(r[f], s) for r in rs)
        lines.append(f"| {what} | {j('rate')} | {j('served', '.1f')} | {j('p50')} | {j('p99')} "
                     f"| {j('preempt')} | {j('itl', '.1f')} | {j('out')} "
                     f"| {goodput(runs[name]['results']):.0f} | `{name}.json` |")
    return "\n".join(lines)


def repeats(runs: dict[str, dict[str, Any]], name: str) -> list[tuple[str, str]]:
    """``name`` and its repeats ``name-rN`` (gpu/run_ceiling.sh), those that ran, in order,
    each with its table label ("" for the first, " (repeat N)")."""
    out = [(name, "")] if name in runs else []
    nums = sorted(int(k.rsplit("-r", 1)[1]) for k in runs
                  if k.startswith(name + "-r") and k.rsplit("-r", 1)[1].isdigit())
    return out + [(f"{name}-r{n}", f" (repeat {n})") for n in nums]


def merge_extensions(runs: dict[str, dict[str, Any]]) -> None:
    """A sweep's extension to higher rates (``NAME-toN``, gpu/run_ceiling.sh) joins NAME's
    results, by rate (goodput is over the whole grid)."""
    for key in [k for k in runs if re.fullmatch(r".+-to\d+", k)]:
        base = key.rsplit("-to", 1)[0]
        if base in runs:
            ext = runs.pop(key)["results"]
            runs[base]["results"] = sorted(runs[base]["results"] + ext,
                                           key=lambda r: r["request_rate"])


def many_tenants(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The many-tenants acceptance; a stack that did not run counts as a miss (goodput 0)."""
    empty: dict[str, Any] = {"results": []}
    pd, base, nat = (runs.get(k, empty) for k in ("pdstack-default", "vllm-default",
                                                  "vllm-native"))
    g = {k: goodput(runs.get(k, empty)["results"]) for k in ("pdstack-default", "vllm-default",
                                                              "vllm-native")}
    native_ok = {r["request_rate"]: r for r in nat["results"] if r.get("meets_ttft_slo")}
    p99 = [{"rate": rate, "native_p99_ms": r["p99_ttft_ms"], "pdstack_p99_ms": p["p99_ttft_ms"],
            "ratio": p["p99_ttft_ms"] / r["p99_ttft_ms"],
            "ok": p["p99_ttft_ms"] <= 1.1 * r["p99_ttft_ms"]}
           for p in pd["results"] if (rate := p["request_rate"]) in native_ok
           for r in [native_ok[rate]]]
    vs_vllm = g["pdstack-default"] / g["vllm-default"] if g["vllm-default"] else None
    vs_native = g["pdstack-default"] / g["vllm-native"] if g["vllm-native"] else None
    return {
        "goodput_req_s": g, "vs_vllm_default": vs_vllm, "vs_native": vs_native,
        "goodput_ok": bool(vs_vllm and vs_vllm >= 1.6 and vs_native and vs_native >= 1.25),
        "p99_where_native_meets_slo": p99, "p99_ok": bool(p99) and all(x["ok"] for x in p99),
        "vllm_default_served": [r["served_rate"] for r in base["results"]],
    }


def within(a: float, b: float) -> bool:
    """pdstack's ``b`` within 10 % or 10 ms (the larger) of vLLM's ``a``."""
    return b <= a + max(0.1 * a, 10.0)


def pooled(runs: dict[str, dict[str, Any]], name: str) -> dict[float, dict[str, float]]:
    """Per asked rate, the mean of ``name``'s and its repeats' P50, P99 and served (a run
    that missed the SLO at a rate makes that rate miss)."""
    by_rate: dict[float, list[dict[str, Any]]] = {}
    for n, _ in repeats(runs, name):
        for r in runs[n]["results"]:
            by_rate.setdefault(r["request_rate"], []).append(r)
    return {rate: {"p50": mean(r["p50_ttft_ms"] for r in rs),
                   "p99": mean(r["p99_ttft_ms"] for r in rs),
                   "served": mean(r["served_rate"] for r in rs),
                   "meets": all(r.get("meets_ttft_slo") for r in rs), "runs": len(rs)}
            for rate, rs in by_rate.items()}


def multi_turn(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """At each rate where vLLM meets the SLO: pdstack against it, each the mean over its
    repeats (``-rN``: interleaved runs of the same sweep)."""
    base, pd = pooled(runs, "turn-vllm-default"), pooled(runs, "turn-pdstack-default")
    out = []
    for rate in sorted(set(base) & set(pd)):
        b, p = base[rate], pd[rate]
        if not b["meets"]:
            continue
        out.append({
            "rate": rate, "runs": [b["runs"], p["runs"]],
            "p50_ms": [b["p50"], p["p50"]],
            "p99_ms": [b["p99"], p["p99"]],
            "served": [b["served"], p["served"]],
            "p50_ok": within(b["p50"], p["p50"]),
            "p99_ok": within(b["p99"], p["p99"]),
            "served_ok": p["served"] >= 0.97 * b["served"],
        })
    return out


def judged(runs: dict[str, dict[str, Any]]) -> str:
    """Per stack and rate, what the bench judged of each request (issue 53): answers within
    the per-request TTFT SLO a second, their share of those sent, refusals by status and
    their time to refusal."""
    lines = ["| stack | asked req/s | served req/s | SLO-attained req/s | attained % of sent "
             "| refused (status: n) | refusal P99 ms | TTFT P50 / P99 ms |",
             "|---|---|---|---|---|---|---|---|"]
    for key, what in STACKS.items():
        for r in runs.get(key, {"results": []})["results"]:
            refused = ", ".join(f"{k}: {v}" for k, v in sorted(r.get("refusals", {}).items()))
            lines.append(
                f"| {what} | {r['request_rate']:g} | {fmt(r.get('served_rate'), '.1f')} "
                f"| {fmt(r.get('slo_goodput_rps'), '.1f')} "
                f"| {fmt(r.get('slo_attainment_pct'), '.0f')} | {refused or '-'} "
                f"| {fmt(r.get('p99_refusal_ms'), '.0f')} "
                f"| {fmt(r.get('median_ttft_ms'), '.0f')} / {fmt(r.get('p99_ttft_ms'), '.0f')} |")
    return "\n".join(lines)


def overload(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 53's acceptance past the knee: pdstack's knee is its goodput (the highest rate
    meeting the SLO); at 2x and 3x it (the nearest asked rates at or above), pdstack's
    SLO-attained throughput >= 0.85x its own at the knee and >= 2x each vLLM stack's at that
    rate; its refusals' P99 within 100 ms; and below the knee its TTFT P50 and P99 within
    10 % (or 10 ms) of the native tier's."""
    empty: dict[str, Any] = {"results": []}
    pd = runs.get("pdstack-default", empty)
    knee = goodput(pd["results"])
    at = {r["request_rate"]: r for r in pd["results"]}
    others = {k: {r["request_rate"]: r for r in runs.get(k, empty)["results"]}
              for k in ("vllm-native", "vllm-default")}
    base = (at.get(knee) or {}).get("slo_goodput_rps") or 0.0
    past: list[dict[str, Any]] = []
    for x in (2, 3):
        rate = min((r for r in at if r >= x * knee), default=None) if knee else None
        if rate is None:
            past.append({"x": x, "rate": None, "ok": False})
            continue
        r = at[rate]
        good = r.get("slo_goodput_rps") or 0.0
        vs = {k: (o[rate].get("slo_goodput_rps") or 0.0) if rate in o else None
              for k, o in others.items()}
        ok = (good >= 0.85 * base and all(v is not None and good >= 2 * v for v in vs.values())
              and (r.get("p99_refusal_ms") or 0.0) <= 100.0)
        past.append({"x": x, "rate": rate, "slo_goodput_rps": good, "vs_knee": good / base
                     if base else None, "vllm_slo_goodput_rps": vs,
                     "p99_refusal_ms": r.get("p99_refusal_ms"), "refusals": r.get("refusals"),
                     "ok": ok})
    below = []
    for rate, r in sorted(at.items()):
        n = others["vllm-native"].get(rate)
        if knee and rate < knee and n is not None:
            below.append({"rate": rate, "p50_ms": [n["median_ttft_ms"], r["median_ttft_ms"]],
                          "p99_ms": [n["p99_ttft_ms"], r["p99_ttft_ms"]],
                          "ok": within(n["median_ttft_ms"], r["median_ttft_ms"])
                          and within(n["p99_ttft_ms"], r["p99_ttft_ms"])})
    return {"knee_req_s": knee, "slo_goodput_at_knee": base, "past_knee": past,
            "below_knee_vs_native": below,
            "ok": bool(past) and all(p["ok"] for p in past) and all(b["ok"] for b in below)}


def top(run: dict[str, Any] | None) -> dict[str, Any] | None:
    rs = (run or {}).get("results") or []
    return max(rs, key=lambda r: r.get("request_rate") or 0) if rs else None


def tenant_row(runs: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    """Issue 37: chat's NAME.json and the batch tenant's NAME-batch.json (when it ran)."""
    chat, batch = top(runs[name]), top(runs.get(name + "-batch"))
    assert chat is not None
    pd = (chat.get("prometheus") or {}).get("total", {}).get("pdstack", {}) or {}
    waits = pd.get("pdstack_proxy_tenant_queue_wait_seconds_sum{tenant=chat}")
    waited = pd.get("pdstack_proxy_tenant_queue_wait_seconds_count{tenant=chat}")
    out: dict[str, Any] = {
        "name": name, "chat_p50_ms": chat["p50_ttft_ms"], "chat_p99_ms": chat["p99_ttft_ms"],
        "chat_served": chat["request_throughput"], "chat_failed": chat["failed"],
        "chat_itl_p90_ms": chat.get("p90_itl_ms"),
        "chat_queue_ms": (1000 * waits / waited) if waits is not None and waited else None,
        "held": {k.split("reason=")[1].rstrip("}"): v for k, v in pd.items()
                 if k.startswith("pdstack_proxy_admission_held_total") and v}}
    if batch is not None:  # its 429s and 5xx (error keys like ``http_429`` or ``429``)
        codes = [("".join(c for c in str(k) if c.isdigit()), n)
                 for k, n in (batch.get("errors") or {}).items()]
        out.update(batch_served=batch["request_throughput"],
                   batch_429=sum(n for c, n in codes if c == "429"),
                   batch_5xx=sum(n for c, n in codes if len(c) == 3 and c[0] == "5"))
    return out


def isolation(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 37's table and checks; each variant against chat alone and the batch tenant
    alone on its own engine (iso-split: the batch tenant's is iso-chunk), else on iso."""
    names = sorted(n for n in runs if re.match(r"(chat|over|flood)-", n)
                   and not n.endswith("-batch"))
    tab = [tenant_row(runs, n) for n in names]
    print("\n### an interactive tenant beside a batch one\n\n| variant | chat P50 ms "
          "| chat P99 ms | chat served/s | chat failed | chat ITL P90 ms | chat queue ms/req "
          "| batch served/s | batch 429 / 5xx | held |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in tab:
        print(f"| {r['name']} | {r['chat_p50_ms']:.0f} | {r['chat_p99_ms']:.0f} "
              f"| {r['chat_served']:.2f} | {r['chat_failed']} | {fmt(r['chat_itl_p90_ms'])} "
              f"| {fmt(r['chat_queue_ms'], '.1f')} | {fmt(r.get('batch_served'), '.2f')} "
              f"| {r.get('batch_429', '-')} / {r.get('batch_5xx', '-')} | {r['held'] or ''} |")
    by_name, checks = {r["name"]: r for r in tab}, {}
    for r in tab:
        wl, st = r["name"].split("-", 1)
        st = re.sub(r"-r\d+$", "", st)
        engine = re.sub(r"-(p1|nofirst)$", "", st)
        alone = next((by_name[n] for n in (f"chat-{st}", f"chat-{engine}",
                     f"chat-{engine.replace('-split', '')}", "chat-iso") if n in by_name), None)
        b_name = next((n for n in (f"batch-{engine.replace('-split', '-chunk')}", "batch-iso")
                       if top(runs.get(n))), None)
        if wl == "chat" or alone is None:
            continue
        c: dict[str, Any] = {"p99_x_alone": r["chat_p99_ms"] / alone["chat_p99_ms"],
                             "against": alone["name"]}
        if wl == "over":
            c["met"] = c["p99_x_alone"] <= 2
        else:
            b_alone = top(runs.get(b_name or ""))
            c.update(p50_x_alone=r["chat_p50_ms"] / alone["chat_p50_ms"],
                     chat_all_served=r["chat_failed"] == 0, batch_5xx=r.get("batch_5xx"),
                     batch_x_alone=r.get("batch_served", 0) / b_alone["request_throughput"]
                     if b_alone else None, batch_against=b_name)
            c["met"] = (c["p99_x_alone"] <= 3 and c["p50_x_alone"] <= 2 and c["chat_all_served"]
                        and not c["batch_5xx"] and (c["batch_x_alone"] or 0) >= 0.5)
        checks[r["name"]] = c
        print(f"{r['name']}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float)
                                           else f"{k} {v}" for k, v in c.items()))
    return {"rows": tab, "checks": checks}


def engine_hits(r: dict[str, Any]) -> list[float | None]:
    """Each engine's prefix-cache hit ratio in this rate's window (None: no queries)."""
    eps: dict[str, dict[str, Any]] = (r.get("prometheus") or {}).get("endpoints") or {}
    return [next((v for k, v in eps.items() if f":{port}/" in k), {})
            .get("prefix_cache_hit_ratio") for port in ENGINE_PORTS]


def routing_table(runs: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| front | asked req/s | served | SLO % | TTFT P50 / P99 ms | out tok/s | "
             "engine hit ratios (prefix cache) |", "|---|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        for r in rs:
            hits = " / ".join(fmt(h, ".2f") for h in engine_hits(r))
            lines.append(
                f"| {name} | {r['request_rate']:g} | {fmt(r.get('request_throughput'), '.1f')} | "
                f"{fmt(r.get('slo_attainment_pct'))} | {fmt(r.get('p50_ttft_ms'))} / "
                f"{fmt(r.get('p99_ttft_ms'))} | {fmt(r.get('output_throughput'))} | {hits} |")
    return "\n".join(lines)


def routing(mt: dict[str, list[dict]], turn: dict[str, list[dict]]) -> dict[str, Any]:
    """Issue 56's acceptance over each front's many-tenants (``mt``) and multi-turn rows."""
    g = {k: goodput(v, no_failed=True) for k, v in mt.items()}
    out: dict[str, Any] = {"goodput": g}
    p = g.get("rt-pdstack")
    if p is None:
        return out

    def ratio(other: str) -> float | None:
        return None if other not in g else (p / g[other] if g[other] else float("inf"))

    out["vs_rr"] = {"ratio": ratio("rt-rr"), "met": (ratio("rt-rr") or 0) >= 1.5}
    out["vs_cache_aware"] = {"ratio": ratio("rt-ca"), "met": (ratio("rt-ca") or 0) >= 1.15}
    out["vs_ring"] = {"ratio": ratio("rt-ring"), "met": (ratio("rt-ring") or 0) >= 1.0}
    if "rt-kv" in mt:
        both = [(a, b) for a in mt["rt-pdstack"] for b in mt["rt-kv"]
                if a["request_rate"] == b["request_rate"] and a.get("meets_ttft_slo")
                and b.get("meets_ttft_slo")]
        p99 = [(a["request_rate"], a["p99_ttft_ms"] / b["p99_ttft_ms"]) for a, b in both]
        out["vs_kv_aware"] = {"ratio": ratio("rt-kv"), "p99_ratio_by_rate": p99,
                              "met": (ratio("rt-kv") or 0) >= 1.0
                              and all(x <= 1.1 for _, x in p99)}
    if "rt-pdstack" in turn and "rt-kv" in turn:
        rows = []
        for a in turn["rt-pdstack"]:
            b = next((x for x in turn["rt-kv"] if x["request_rate"] == a["request_rate"]), None)
            if b and a.get("meets_ttft_slo") and b.get("meets_ttft_slo"):
                rows.append({"rate": a["request_rate"],
                             "p50": a["p50_ttft_ms"] / b["p50_ttft_ms"],
                             "p99": a["p99_ttft_ms"] / b["p99_ttft_ms"]})
        out["multi_turn_vs_kv_aware"] = {"by_rate": rows, "met": bool(rows) and all(
            r["p50"] <= 1.1 and r["p99"] <= 1.1 for r in rows)}
    return out


def routing_section(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 56's tables (the fronts in FRONTS' order, then any other) and acceptance."""
    names = [k for k in FRONTS if k in runs or f"turn-{k}" in runs]
    names += sorted({re.sub(r"^turn-", "", k) for k in runs} - set(names))
    by_rate = {k: sorted(v["results"], key=lambda r: r["request_rate"]) for k, v in runs.items()}
    mt = {k: by_rate[k] for k in names if k in by_rate}
    turn = {k: by_rate[f"turn-{k}"] for k in names if f"turn-{k}" in by_rate}
    print("\n".join(f"- `{k}`: {FRONTS.get(k, k)}" for k in names))
    print(f"\n### many-tenants, routing\n\n{routing_table(mt)}")
    if turn:
        print(f"\n### multi-turn, routing\n\n{routing_table(turn)}")
    return routing(mt, turn)


def ceiling(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issues 36, 37 and 53: the tables (printed) and the acceptance."""
    merge_extensions(runs)
    for prefix, title in WORKLOADS.items():
        if any(prefix + k in runs for k in STACKS):
            print(f"\n### {title}\n\n{table(runs, prefix)}")
    print(f"\n### many-tenants, each request judged (TTFT SLO per request)\n\n{judged(runs)}")
    mt, turn = many_tenants(runs), multi_turn(runs)
    ok = mt["goodput_ok"] and mt["p99_ok"] and all(
        r["p50_ok"] and r["p99_ok"] and r["served_ok"] for r in turn)
    acc: dict[str, Any] = {"many_tenants": mt, "multi_turn": turn, "overload": overload(runs),
                           "ok": ok}
    if any(re.match(r"(chat|over|flood)-", n) for n in runs):
        acc["isolation"] = isolation(runs)
    return acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(a.dir.glob("*.json"))}
    runs = {k: v for k, v in runs.items() if isinstance(v, dict) and "results" in v
            and not k.startswith("warmup-")}  # rt_warm's, no front's
    rt = {k: runs.pop(k) for k in list(runs) if re.match(r"(turn-)?rt-", k)}
    acc = ceiling(runs) if runs else {}
    if rt:
        acc["routing"] = routing_section(rt)
    print("\n```\n" + json.dumps(acc, indent=1) + "\n```")
    if a.json:
        a.json.write_text(json.dumps(acc, indent=1) + "\n")


if __name__ == "__main__":
    main()
