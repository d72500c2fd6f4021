"""Token and KV-path check of one seed KV mode on the GPU (issue 35), run by gpu/run_gpu.sh.

    python gpu/seeds_check.py --inventory inventory/h200x1-seed-nixl-2p2d \
        --yardstick http://127.0.0.1:8310 --output DIR/nixl-2p2d-check.json

Sends PROMPTS (fixed token-id prompts) twice each through the mode's proxy, one at a time, at
temperature 0 with 64 tokens and ``ignore_eos``: the first send is cold, the second finds the
prompt in the mode's caches (GPU prefix cache, the LMCache L1, the native tier). The
yardstick is one colocated engine of the same model (``--yardstick``, sent the same prompts
the same way, cold then warm). A mode's tokens match when every answer's first 64 token ids
equal the yardstick's cold answer; where they do not, the JSON keeps the first index that
differs, and the yardstick's own warm answer (a prefix-cache hit, whose last prompt token is
computed alone as a P/D decoder computes it) says whether such a difference is numerical noise
of the random-weight model or a wrong KV.

Every engine's ``/metrics`` (and each LMCache server's API ``/metrics``) is read before and
after: the deltas of the counters that show which path moved KV (vLLM's prompt tokens by
source, external prefix-cache hits, NIXL transfers and bytes, the native tier's offload
counters, LMCache's stores and hits) go into the JSON per service.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pdstack.bench.promscrape import delta, parse_samples  # noqa: E402
from pdstack.commands import load_or_exit  # noqa: E402
from pdstack.launch.prepare import LMCACHE_API_SOCKET  # noqa: E402
from pdstack.plan import make_plan  # noqa: E402

PROMPT_LENS = (700, 2600, 5200)
MAX_TOKENS = 64
# counters that show a KV path at work (substrings of the metric name)
PATH_COUNTERS = ("prompt_tokens_by_source", "external_prefix_cache", "prefix_cache_hits",
                 "nixl", "kv_offload", "lmcache", "num_preemptions", "request_success",
                 "prompt_tokens_total", "generation_tokens_total")


def prompts() -> list[list[int]]:
    """Fixed prompts: token ids drawn with a seed per prompt, the same on every run."""
    return [random.Random(n).choices(range(1000, 100000), k=n) for n in PROMPT_LENS]


def complete(base: str, model: str, prompt: list[int], timeout: float = 120.0) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
    except Exception as e:  # the JSON says what failed; the verdict counts it
        detail = getattr(e, "read", lambda: b"")()[:400].decode(errors="replace")
        return {"error": f"{type(e).__name__}: {e} {detail}".strip(),
                "s": round(time.perf_counter() - t, 3)}
    s = round(time.perf_counter() - t, 3)
    choice = out["choices"][0]
    ids = choice.get("token_ids")
    if ids is None:
        return {"error": f"no token ids in the answer: {json.dumps(out)[:300]}", "s": s}
    return {"ids": ids[:MAX_TOKENS], "usage": out.get("usage"), "s": s}


def _get_unix(path: str, target: str = "/metrics") -> str:
    """GET over a unix socket (LMCache's API under ``pdstack launch``)."""
    import http.client
    import socket

    class Conn(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(10)
            self.sock.connect(path)

    conn = Conn("lmcache")
    conn.request("GET", target)
    return conn.getresponse().read().decode()


def metrics(url: str) -> dict[Any, float] | str:
    try:
        if url.startswith("unix:"):
            return parse_samples(_get_unix(url.removeprefix("unix:")))
        with urllib.request.urlopen(url, timeout=10) as r:
            return parse_samples(r.read().decode())
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def path_deltas(before: dict[Any, float] | str, after: dict[Any, float] | str) -> Any:
    if isinstance(before, str) or isinstance(after, str):
        return {"error": before if isinstance(before, str) else after}
    out: dict[str, float] = {}
    for (name, labels), value in delta(before, after).items():
        if not name.endswith(("_total", "_count", "_sum")) or value == 0:
            continue
        if any(k in name for k in PATH_COUNTERS):
            lab = ",".join(f"{k}={v}" for k, v in labels if k not in ("engine", "model_name"))
            key = f"{name}{{{lab}}}" if lab else name
            out[key] = out.get(key, 0.0) + value
    return dict(sorted(out.items()))


def endpoints(inventory: str, log_dirs: dict[str, str]) -> tuple[str, str, dict[str, str]]:
    """(proxy URL, served model name, {service: metrics URL}) from the inventory's plan;
    LMCache's API is a unix socket in its node's launch log folder (``log_dirs``: node ->
    folder; a node without one is not read)."""
    plan = make_plan(load_or_exit(inventory))
    proxy, urls = "", {}
    for node in plan.nodes.values():
        for s in node.services:
            host = s.bind_address
            if s.kind == "proxy":
                proxy = f"http://{host}:{s.ports['http']}"
            elif s.kind == "engine":
                urls[f"{node.name}/{s.name}"] = f"http://{host}:{s.ports['http']}/metrics"
            elif s.kind == "lmcache" and node.name in log_dirs:
                urls[f"{node.name}/lmcache"] = f"unix:{log_dirs[node.name]}/{LMCACHE_API_SOCKET}"
    return proxy, plan.backend_table.served_model_name, urls


def run(base: str, model: str) -> list[dict[str, Any]]:
    """Each prompt cold, then warm."""
    out = []
    for i, p in enumerate(prompts()):
        for send in ("cold", "warm"):
            out.append({"prompt": i, "prompt_tokens": len(p), "send": send,
                        **complete(base, model, p)})
    return out


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(answers: list[dict[str, Any]], yard: dict[int, list[int]]) -> dict[str, Any]:
    rows, ok = [], True
    for a in answers:
        if "ids" not in a:
            ok = False
            rows.append({"prompt": a["prompt"], "send": a["send"], "error": a.get("error")})
            continue
        d = first_diff(a["ids"], yard[a["prompt"]])
        ok = ok and d is None
        rows.append({"prompt": a["prompt"], "send": a["send"], "match": d is None,
                     "first_diff": d})
    return {"tokens_match": ok, "answers": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inventory", required=True)
    ap.add_argument("--yardstick", help="the colocated engine's base URL")
    ap.add_argument("--output")
    ap.add_argument("--log-dir", action="append", default=[], metavar="NODE=DIR",
                    help="a node's `pdstack launch` log folder (LMCache's API socket is there)")
    ap.add_argument("--urls", action="store_true",
                    help="print the proxy's URL and every --metrics-url flag for pdstack bench")
    args = ap.parse_args()
    proxy, model, urls = endpoints(args.inventory, dict(d.split("=", 1) for d in args.log_dir))
    if args.urls:  # pdstack bench reads HTTP endpoints only
        print(proxy, *(f"--metrics-url {u}" for u in [f"{proxy}/metrics", *urls.values()]
                       if u.startswith("http")))
        return 0
    if not (args.yardstick and args.output):
        ap.error("--yardstick and --output are needed for a check")
    yard_answers = run(args.yardstick, model)
    yard = {a["prompt"]: a["ids"] for a in yard_answers if a["send"] == "cold" and "ids" in a}
    before = {k: metrics(u) for k, u in urls.items()}
    answers = run(proxy, model)
    after = {k: metrics(u) for k, u in urls.items()}
    result = {
        "inventory": args.inventory, "proxy": proxy, "model": model,
        "yardstick": args.yardstick, "max_tokens": MAX_TOKENS,
        **compare(answers, yard),
        "yardstick_warm_vs_cold": compare(yard_answers, yard),
        "answers_detail": answers,
        "counters": {k: path_deltas(before[k], after[k]) for k in urls},
    }
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    failed = sum(1 for a in answers if "ids" not in a)
    print(f"{args.inventory}: tokens_match={result['tokens_match']} failed={failed} "
          f"yardstick warm==cold {result['yardstick_warm_vs_cold']['tokens_match']}")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
