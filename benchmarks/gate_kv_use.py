#!/usr/bin/env python3
"""How much of an engine's KV does the KV gate let it use before it holds? (issue 36, run 2)

On the H200 the new gate held a queue at 24-32 req/s while the engine's KV stayed at 0.78 mean /
0.85 peak, and pdstack served 23.1 req/s at 32 where the gate before it had served 32+. This
puts one real vLLM CPU engine (the tiny llama of the ``vllm`` tests, KV cut to ``--kv-tokens``)
behind three proxies at once -- ``--admission off``, ``kv`` (its 0.9 mark) and ``kv`` with
``--admission-kv-high 0.97`` -- and sends each the same prefix-heavy token-id traffic, more
than the KV holds, in alternating blocks (a new cache salt each): served, TTFT, preemptions,
the engine's KV usage and running requests (sampled every second by the bench) and the
gate's holds, per variant.

  .venv/bin/python benchmarks/gate_kv_use.py      # takes the heavy lock itself
  # results: benchmarks/results/gate_kv_use.json (+ .txt with the printed table)
  .venv/bin/python benchmarks/gate_kv_use.py --before-rev REV --label gate_kv_use_dedup
  # adds the variant ``kv-before``: the proxy of git revision REV (a throw-away worktree;
  # --before-variants kv-path,off: REV's proxy with those variants' flags, NAME-before),
  # in the same run (a before/after of the gate on the same engine)
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdstack.testing import vllm_engines as ve  # noqa: E402
from pdstack.testing.bench_results import save  # noqa: E402
from pdstack.testing.heavy import heavy_lock  # noqa: E402

RESULTS = Path(__file__).parent / "results"
BYTES_PER_TOKEN = 2048  # the tiny llama: 2 layers x K,V x 4 heads x 64 x bf16
# name -> the proxy's admission flags
VARIANTS = {
    "off": ["--admission", "off"],
    "kv": ["--admission", "kv"],
    "kv97": ["--admission", "kv", "--admission-kv-high", "0.97"],
    "kv90": ["--admission", "kv", "--admission-kv-high", "0.9"],
    # the output path alone: no correction from the engine's preemption counter
    "kv-path": ["--admission", "kv", "--admission-preempt-caution", "0"],
}
HELD = "pdstack_proxy_admission_held_total"


def row(out: Path, variant: str, rnd: int) -> dict[str, Any]:
    r = json.loads(out.read_text())["results"][0]
    tot = r["prometheus"]["total"]
    g = tot.get("gauges", {})
    pd: dict[str, float] = next((v.get("pdstack", {}) for v in r["prometheus"]["endpoints"].values()
               if v.get("pdstack")), {})
    held = sum(v for k, v in pd.items() if k.startswith(HELD))
    return {
        "variant": variant, "round": rnd, "sent": r["sent_rate"], "served": r["served_rate"],
        "failed": r["failed"], "ttft_p50_ms": r["p50_ttft_ms"], "ttft_p99_ms": r["p99_ttft_ms"],
        "e2e_p50_ms": r["p50_e2el_ms"], "preemptions": r.get("preemptions"),
        "kv_peak": g.get("kv_cache_usage", {}).get("peak"),
        "kv_mean": g.get("kv_cache_usage", {}).get("mean"),
        "running_mean": g.get("num_requests_running", {}).get("mean"),
        "waiting_mean": g.get("num_requests_waiting", {}).get("mean"),
        "held": held,
        "held_kv_full": pd.get(HELD + "{reason=kv_full}", 0.0),
        "held_preempting": pd.get(HELD + "{reason=kv_preempting}", 0.0),
        "wait_s": pd.get("pdstack_proxy_admission_wait_seconds_total", 0.0),
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = ("variant   round  sent  served fail  TTFT p50    p99   E2E p50  preempt  KV peak  mean"
            "  running  waiting  held (kv_full, kv_preempting)  wait s")
    lines = [head, "-" * len(head)]

    def f(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)
    for r in rows:
        lines.append(
            f"{r['variant']:9} {r['round']:5} {r['sent']:5.1f} {r['served']:7.1f} {r['failed']:4} "
            f"{f(r['ttft_p50_ms'], '9.0f')} {f(r['ttft_p99_ms'], '6.0f')} "
            f"{f(r['e2e_p50_ms'], '9.0f')} {f(r['preemptions'], '8.0f')} "
            f"{f(r['kv_peak'], '8.2f')} {f(r['kv_mean'], '5.2f')} {f(r['running_mean'], '8.1f')} "
            f"{f(r['waiting_mean'], '8.1f')} {r['held']:6.0f} ({r['held_kv_full']:4.0f}, "
            f"{r.get('held_preempting', 0.0):4.0f}) "
            f"{r['wait_s']:7.1f}")
    lines.append("ms; served/sent req/s; KV usage of the engine (bench samples, 1 s); held: "
                 "requests the proxy's gate queued (kv_full, kv_preempting: the first of a queue)")
    return "\n".join(lines)


@functools.cache
def python_for(tree: Path) -> str:
    """The venv's python, checked to import ``tree``'s pdstack when run from ``tree``
    (``-m`` puts the working directory first on the path; until stop 51 the ``kv-before``
    proxy ran from this checkout's directory with the old tree only on PYTHONPATH, behind
    it: it was this checkout's code). Once per tree."""
    py = str(REPO / ".venv" / "bin" / "python")
    where = subprocess.run([py, "-c", "import pdstack; print(pdstack.__file__)"], cwd=tree,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"the proxy for {tree} would import pdstack from {where}")
    return py


def names(flag: str, text: str) -> list[str]:
    """The variants a comma-separated ``flag`` names; one clear error for an unknown one."""
    listed = [v for v in text.split(",") if v]
    unknown = [v for v in listed if v not in VARIANTS]
    if unknown:
        print(f"{flag}: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})",
              file=sys.stderr)
        raise SystemExit(2)
    return listed


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", default="1", help="the engine's cores (taskset list)")
    p.add_argument("--kv-tokens", type=int, default=6144, help="the engine's KV, in tokens")
    p.add_argument("--rate", type=float, default=8.0, help="asked req/s")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--label", default="gate_kv_use")
    p.add_argument("--system-prompts", type=int, default=12, help="distinct shared prompts")
    p.add_argument("--system-len", default="uniform:300:700", help="their length, tokens")
    p.add_argument("--shared-share", type=float, default=0.85,
                   help="the share of requests that start with one of them")
    p.add_argument("--output-len", default="uniform:96:192", help="answers, tokens")
    p.add_argument("--before-rev", default="",
                   help="also run the proxy of this git revision (variant kv-before)")
    p.add_argument("--before-variants", default="kv",
                   help="with --before-rev: these variants of REV's proxy too (NAME-before)")
    p.add_argument("--variants", default="off,kv,kv97",
                   help=f"comma-separated, of: {', '.join(VARIANTS)}")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    chosen = names("--variants", args.variants)
    chosen_before = names("--before-variants", args.before_variants)
    ve.require_venv()
    kv_bytes = str(args.kv_tokens * BYTES_PER_TOKEN)
    rows: list[dict[str, Any]] = []
    with heavy_lock(), tempfile.TemporaryDirectory() as tmp:
        port = ve.free_port()
        eng = ve.start_engine("gate-kv", port, args.cpu, None,
                              extra_args=["--kv-cache-memory-bytes", kv_bytes])
        proxies: dict[str, subprocess.Popen] = {}
        try:
            ve.wait_ready([eng])
            table_file = Path(tmp) / "backends.json"
            table_file.write_text(json.dumps({
                "kv_mode": "colocated", "served_model_name": ve.SERVED_NAME,
                "backends": [{"name": "e0", "role": "colocated", "node": "n",
                              "url": eng.url}],
                "pairings": [], "skip_prefill_threshold_tokens": 0}))
            ports = {}
            variants = {v: VARIANTS[v] for v in chosen}
            code: dict[str, Path] = {}  # variant -> the tree whose pdstack its proxy runs
            if args.before_rev:
                before = Path(tmp) / "before"
                subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach",
                                str(before), args.before_rev], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                for v in chosen_before:
                    variants[f"{v}-before"] = VARIANTS[v]
                    code[f"{v}-before"] = before
            for name, flags in variants.items():
                ports[name] = ve.free_port()
                tree = code.get(name, REPO)
                proxies[name] = subprocess.Popen(
                    [python_for(tree), "-m", "pdstack.cli", "proxy",
                     "--backends", str(table_file), "--host", "127.0.0.1",
                     "--port", str(ports[name]), *flags],
                    stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=tree)
            time.sleep(3)
            for rnd in range(args.rounds):
                order = list(variants) if rnd % 2 == 0 else list(reversed(variants))
                for name in order:
                    out = Path(tmp) / f"{name}-{rnd}.json"
                    target = f"http://127.0.0.1:{ports[name]}"
                    subprocess.run(
                        [str(REPO / ".venv" / "bin" / "pdstack"), "bench", "--target", target,
                         "--model", ve.SERVED_NAME, "--token-ids", "--token-id-range", "10:4000",
                         "--system-prompts", str(args.system_prompts),
                         "--system-len", args.system_len,
                         "--shared-share", f"{args.shared_share:g}", "--user-len", "uniform:32:96",
                         "--output-len", args.output_len, "--rates", f"{args.rate:g}",
                         "--duration", f"{args.duration:g}", "--warmup", "5",
                         "--drain-timeout", "60", "--seed", str(rnd + 1),
                         "--cache-salt", f"gate-{name}-{rnd}", "--metrics-url",
                         f"{eng.url}/metrics", "--metrics-url", f"{target}/metrics",
                         "--no-progress", "--output", str(out)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
                        timeout=args.duration + 200)
                    rows.append(row(out, name, rnd))
                    print(table(rows[-1:]).splitlines()[2], flush=True)
        finally:
            for p in proxies.values():
                p.terminate()
            eng.stop()
            if args.before_rev:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                str(Path(tmp) / "before")], check=False)
    save(RESULTS, args, {"variants": variants}, rows, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
