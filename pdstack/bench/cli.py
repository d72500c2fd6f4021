"""``pdstack bench`` and ``pdstack bench compare``."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from pdstack.argtypes import positive_int, seconds
from pdstack.bench import scenarios
from pdstack.bench.stats import SLO_TTFT_MS
from pdstack.bench.workload import Distribution, DistributionError, WorkloadConfig

EPILOG = """\
length distributions: N | uniform:LO:HI | normal:MEAN:STD | lognormal:MEAN:SIGMA
scenarios (presets; an explicit flag overrides its knob; none: the defaults shown below):
  seed          4 shared system prompts of uniform:2000:6000 tokens, 80 % shared
  many-tenants  like seed, with ceil(2 * KV capacity / mean system length) shared prompts
                (capacity: --kv-capacity-tokens, else vLLM's cache_config_info at --metrics-url)
  multi-turn    like seed, as conversations: --turns (uniform:3:8) turns, each after an
                exponential --think-time (mean 4 s); prompt = the conversation so far + a
                new user message; session id in `user` and X-Session-ID
  long-input    6-12 k token prompts, Poisson: a shared prefix of uniform:2000:4000 (one of
                16) + a unique uniform:4000:8000, about a third of each prompt shared
examples:
  pdstack bench --target http://127.0.0.1:8000 --rates 1,2,5 --duration 60 --output run.json
  pdstack bench --target http://127.0.0.1:8000 --token-ids --metrics-url http://127.0.0.1:8000/metrics
  pdstack bench --target URL --token-ids --scenario many-tenants --metrics-url ENGINE/metrics
  pdstack bench --target URL --token-ids --scenario multi-turn --turns uniform:3:8 --think-time 4
  pdstack bench compare before.json after.json --output compare.png
"""


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad rate list {text!r}") from exc
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be a comma-separated list of numbers > 0")
    return rates


def _dist(text: str) -> Distribution:
    try:
        return Distribution.parse(text)
    except DistributionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _share(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError("share must be within [0, 1]")
    return value


# the workload knobs a --scenario presets: (flag, type, help)
_WORKLOAD_FLAGS: tuple[tuple[str, Any, str], ...] = (
    ("--system-prompts", positive_int, "K shared system prompts (default 4)"),
    ("--shared-share", _share, "share of requests that reuse a shared system prompt (default 0.8)"),
    ("--system-len", _dist,
     "system prompt length in tokens (default 1024; seed: uniform:2000:6000)"),
    ("--user-len", _dist, "user message length in tokens (default uniform:32:256)"),
    ("--output-len", _dist, "answer length (max_tokens) (default uniform:64:256)"),
    ("--turns", _dist, "multi-turn: turns per conversation (default uniform:3:8)"),
    ("--think-time", seconds,
     "multi-turn: mean seconds between turns, exponential (default 4)"),
    ("--kv-capacity-tokens", positive_int,
     "many-tenants: one engine's GPU KV in tokens (default: from "
     "vllm:cache_config_info at --metrics-url, the smallest engine)"),
)


def register(subparsers: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        name,
        help=help_text,
        description="Prefix-heavy chat benchmark: Poisson arrivals at each asked rate; "
        "asked vs served load, TTFT/ITL/E2E percentiles, prefix-cache hit ratio.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", help="base URL of the OpenAI server (proxy or engine)")
    p.add_argument("--rates", type=_rates, default=[1.0, 2.0, 5.0],
                   help="asked request rates, req/s, comma-separated (default 1,2,5)")
    p.add_argument("--duration", type=float, default=60.0,
                   help="measured seconds per rate (default 60)")
    p.add_argument("--warmup", type=float, default=10.0,
                   help="seconds of load before each measurement (default 10)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="after a window, wait this long for in-flight requests (default 60)")
    p.add_argument("--cooldown", type=float, default=0.0, help="pause between rates (s)")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="text prompts to /v1/chat/completions or /v1/completions (default chat)")
    p.add_argument("--token-ids", action="store_true",
                   help="send prompts as token-id lists to /v1/completions "
                   "(engines run with --skip-tokenizer-init)")
    p.add_argument("--token-id-range", default="10:4000",
                   help="LO:HI range of random token ids (default 10:4000)")
    p.add_argument("--scenario", choices=tuple(scenarios.PRESETS), default=None,
                   help="named preset of the workload knobs below (see the end of --help)")
    for flag, kind, help_ in _WORKLOAD_FLAGS:  # default None: the scenario's, else the help's
        p.add_argument(flag, type=kind, default=None, help=help_)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (answers may end before max_tokens)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="cap on in-flight requests (arrivals wait for a slot)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--metrics-url", action="append", default=[], metavar="URL",
                   help="Prometheus /metrics to scrape before/after each rate (repeatable)")
    p.add_argument("--prefill-url", default=None,
                   help="play the NIXL P/D proxy in the client: prefill here, decode at --target")
    p.add_argument("--cache-salt", default=None,
                   help="vLLM cache_salt on every request: the same requests on cold prefix "
                        "caches and native tier (vLLM keys cached blocks by it)")
    p.add_argument("--prompt-salt", default=None,
                   help="lead every prompt with this salt (its first token id, or word): the "
                        "same requests on cold caches for fronts that hash prompts and know no "
                        "cache_salt (a router's prefix index)")
    p.add_argument("--no-return-token-ids", dest="token_ids_back", action="store_false",
                   help="token-id prompts without vLLM's return_token_ids (output counted from "
                        "usage): only OpenAI's fields, for fronts that mishandle others "
                        "(vllm-router 0.1.17's kv_aware skips its KV lookup)")
    p.add_argument("--slo-ttft-p50-ms", type=float, default=2000.0)
    p.add_argument("--slo-ttft-p99-ms", type=float, default=3500.0)
    p.add_argument("--slo-ttft-ms", type=float, default=SLO_TTFT_MS,
                   help="per-request TTFT SLO: a request met it when it completed without "
                   f"error within this TTFT (slo_goodput_rps, slo_attainment_pct; default "
                   f"{SLO_TTFT_MS:g})")
    p.add_argument("--gpu-hour-price", type=float, default=None, help="price of one GPU-hour")
    p.add_argument("--gpus", type=int, default=None, help="GPUs serving the target")
    p.add_argument("--tenant", action="append", default=[], metavar="NAME:SHARE",
                   help="drive several tenants at once (repeatable): each gets SHARE of every "
                   "asked rate, its own prompt mix and its key from PDSTACK_BENCH_KEY_<NAME>; "
                   "TTFT and served are reported per tenant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default=None, help="name of this run in plots and compare")
    p.add_argument("--output", type=Path, default=None,
                   help="write FILE.json, plus FILE_served.png and FILE_ttft.png beside it")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_bench)

    sub = p.add_subparsers(dest="bench_command", metavar="{compare}")
    c = sub.add_parser("compare", help="overlay several bench JSON files",
                       description="Overlay runs: one table each, and both plots with all runs.")
    c.add_argument("files", nargs="+", type=Path, metavar="FILE.json")
    c.add_argument("--output", type=Path, default=Path("compare.png"),
                   help="plot prefix: writes <stem>_served.png and <stem>_ttft.png "
                   "(default compare.png)")
    c.set_defaults(func=run_compare)
    return p


def resolve_scenario(args: argparse.Namespace) -> scenarios.Resolved:
    """The workload knobs from ``--scenario`` and the explicit flags; many-tenants is
    sized here (from ``--kv-capacity-tokens`` or the engines' ``/metrics``).
    Raises :class:`scenarios.ScenarioError` with the message for the user."""
    resolved = scenarios.resolve(
        args.scenario, {k: getattr(args, k, None) for k in scenarios.KNOBS}
    )
    if args.kv_capacity_tokens is not None and args.scenario != "many-tenants":
        raise scenarios.ScenarioError("--kv-capacity-tokens needs --scenario many-tenants")
    if not resolved.needs_kv_capacity:
        return resolved
    if args.kv_capacity_tokens is not None:
        scenarios.size_many_tenants(resolved, args.kv_capacity_tokens, "--kv-capacity-tokens")
        return resolved
    from pdstack.bench import promscrape

    found: list[tuple[int, str]] = []
    for url, samples in asyncio.run(promscrape.snapshot(args.metrics_url)).items():
        if isinstance(samples, dict):
            cap = promscrape.kv_capacity_tokens(samples)
            if cap is not None:
                found.append((cap, url))
    if not found:
        where = ", ".join(args.metrics_url) if args.metrics_url else "no --metrics-url given"
        raise scenarios.ScenarioError(
            "--scenario many-tenants needs one engine's KV capacity: pass "
            f"--kv-capacity-tokens N, or a --metrics-url of a vLLM engine that exports "
            f"vllm:cache_config_info ({where})"
        )
    cap, url = min(found)
    scenarios.size_many_tenants(resolved, cap, url)
    return resolved


def _config(args: argparse.Namespace, resolved: scenarios.Resolved | None = None) -> Any:
    from pdstack.bench.runner import BenchConfig
    from pdstack.bench.tenants import parse_tenant

    if resolved is None:
        resolved = resolve_scenario(args)
    knobs = resolved.knobs
    lo, _, hi = args.token_id_range.partition(":")
    workload = WorkloadConfig(
        num_system_prompts=knobs["system_prompts"],
        shared_share=knobs["shared_share"],
        system_len=knobs["system_len"],
        user_len=knobs["user_len"],
        output_len=knobs["output_len"],
        token_ids=args.token_ids,
        token_id_min=int(lo),
        token_id_max=int(hi),
        seed=args.seed,
        turns=knobs["turns"],
        think_time=knobs["think_time"] if knobs["think_time"] is not None else 4.0,
        prompt_salt=args.prompt_salt,
    )
    return BenchConfig(
        target=args.target,
        rates=args.rates,
        duration=args.duration,
        warmup=args.warmup,
        drain_timeout=args.drain_timeout,
        cooldown=args.cooldown,
        model=args.model,
        endpoint=args.endpoint,
        ignore_eos=args.ignore_eos,
        max_concurrency=args.max_concurrency,
        request_timeout=args.request_timeout,
        metrics_urls=args.metrics_url,
        prefill_url=args.prefill_url,
        cache_salt=args.cache_salt,
        token_ids_back=args.token_ids_back,
        slo_ttft_p50_ms=args.slo_ttft_p50_ms,
        slo_ttft_p99_ms=args.slo_ttft_p99_ms,
        slo_ttft_ms=args.slo_ttft_ms,
        gpu_hour_price=args.gpu_hour_price,
        gpus=args.gpus,
        label=args.label,
        workload=workload,
        scenario=resolved.name,
        scenario_sizing=resolved.sizing or None,
        tenants=[parse_tenant(t) for t in args.tenant],
    )


def run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pdstack.bench import report
    from pdstack.bench.runner import run_sweep

    if not args.target:
        print("pdstack bench: --target URL is required", file=sys.stderr)
        return 2
    if args.duration <= 0 or args.warmup < 0:
        print("pdstack bench: --duration must be > 0 and --warmup >= 0", file=sys.stderr)
        return 2
    try:
        cfg = _config(args)
    except scenarios.ScenarioError as exc:
        print(f"pdstack bench: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"pdstack bench: {exc}", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    try:
        doc = asyncio.run(run_sweep(cfg, console=console, show_progress=not args.no_progress))
    except (OSError, RuntimeError) as exc:
        print(f"pdstack bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(report.summary_table(doc))
    if args.output:
        out, served, ttft = report.write_outputs(doc, args.output)
        print(f"wrote {out}, {served}, {ttft}")
    return 0 if all(not r["failed"] for r in doc["results"]) else 1


def run_compare(args: argparse.Namespace) -> int:
    from pdstack.bench import report

    docs = []
    for path in args.files:
        try:
            docs.append((path.stem, report.load(path)))
        except (OSError, ValueError) as exc:
            print(f"pdstack bench compare: {path}: {exc}", file=sys.stderr)
            return 2
    for name, doc in docs:
        print(f"== {doc.get('label') or name} ({doc.get('target')}, {doc.get('date')})")
        print(report.summary_table(doc))
        print()
    served, ttft = report.plot_paths(args.output)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    report.write_plots(docs, served, ttft)
    print(f"wrote {served}, {ttft}")
    return 0
