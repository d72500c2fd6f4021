"""``pdstack proxy``: run the P/D-aware OpenAI proxy.

Backends come from one of:
- ``-i/--inventory DIR``: ``make_plan(load_topology(DIR)).backend_table``;
- ``--backends FILE``: a backend table as JSON (what the planner renders);
- ``--prefill URL... --decode URL... --kv-mode MODE``: ad hoc (every prefiller pairs with
  every decoder, all on node ``local``; in ``colocated`` every URL is an engine).

kv_mode ``lmcache-pd`` (LMCache's legacy push) also needs, per decoder, where its LMCache
receives the KV, and a port for the prefillers' ZMQ ``ProxyNotif`` (their
``LMCACHE_PD_PROXY_HOST``/``LMCACHE_PD_PROXY_PORT``).  ``-i``/``--backends`` carry both
(the planner's ``lmcache_pd`` / ``lmcache_pd_notify``); ad hoc, give them as flags::

    pdstack proxy --kv-mode lmcache-pd --prefill http://10.0.0.31:8100 \
        --decode http://10.0.0.31:8101 http://10.0.0.32:8101 \
        --lmcache-pd-receiver 10.0.0.31:7302:7303 10.0.0.32:7302,7304:7303,7305 \
        --lmcache-pd-notify-port 7299 --host 10.0.0.31

(one ``HOST:INIT_PORTS:ALLOC_PORTS`` per ``--decode``, in the same order, comma-separated
ports in TP-rank order = the decoder's ``LMCACHE_PD_PEER_HOST`` /
``LMCACHE_PD_PEER_INIT_PORT`` / ``LMCACHE_PD_PEER_ALLOC_PORT``).  The PULL socket binds
``--lmcache-pd-notify-host`` (default: the table's host, else ``--host``).

Secrets (admin token, client API keys) come from the environment or ``--env-file``,
never from argv: see :mod:`pdstack.proxy.config`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
from pathlib import Path
from typing import Any

from pdstack import kvmodes
from pdstack.proxy.admission import AdmissionConfig
from pdstack.proxy.config import MIB, ProxyConfig, load_secrets

DEFAULT_ENV_FILE = "/etc/pdstack/secrets.env"
KV_MODE_CHOICES = kvmodes.NAMES


def register(subparsers: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help=help_text, description=__doc__.splitlines()[0])
    src = p.add_argument_group("backends (pick one source)")
    src.add_argument("-i", "--inventory", help="inventory directory (uses the planner)")
    src.add_argument("--backends", help="backend table JSON file")
    src.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill engine URLs")
    src.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode engine URLs")
    src.add_argument("--kv-mode", choices=KV_MODE_CHOICES, help="KV mode for --prefill/--decode")
    src.add_argument("--served-model-name", default="", help="model name for /v1/models fallback")
    src.add_argument(
        "--lmcache-pd-receiver",
        nargs="+",
        default=[],
        metavar="HOST:INIT:ALLOC",
        help="lmcache-pd, ad hoc: each --decode's LMCache receiver, in order "
        "(ports comma-separated per TP rank)",
    )
    lmc = p.add_argument_group("kv_mode lmcache-pd")
    lmc.add_argument(
        "--lmcache-pd-notify-port",
        type=int,
        default=None,
        help="ZMQ PULL port for the prefillers' ProxyNotif (default: the backend table's)",
    )
    lmc.add_argument(
        "--lmcache-pd-notify-host",
        default=None,
        help="address the ProxyNotif socket binds (default: the table's, else --host)",
    )
    lmc.add_argument(
        "--lmcache-pd-notify-timeout",
        type=float,
        default=ProxyConfig().lmcache_pd_notify_timeout_s,
        help="seconds the decode leg waits for ProxyNotif; then it goes anyway and the "
        "decoder recomputes (default %(default)s)",
    )

    d = ProxyConfig()
    p.add_argument("--host", default=d.host, help="bind address (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="port (default %(default)s)")
    p.add_argument(
        "--env-file",
        default=None,
        help=f"KEY=VALUE file with secrets (default {DEFAULT_ENV_FILE} if present)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=d.max_concurrency,
        help="requests in flight before 429 (default %(default)s)",
    )
    p.add_argument(
        "--prefix-chars",
        type=int,
        default=d.prefix_chars,
        help="leading prompt characters hashed for prefill affinity",
    )
    p.add_argument(
        "--load-factor",
        type=float,
        default=d.load_factor,
        help="bounded-load factor, >= 1 (default %(default)s)",
    )
    p.add_argument(
        "--skip-prefill-threshold",
        type=int,
        default=None,
        metavar="TOKENS",
        help="skip prefill when the uncached prompt part is below this many tokens "
        "(shared-l1 modes; default: the backend table's value; 0 = off)",
    )
    p.add_argument("--chars-per-token", type=float, default=d.chars_per_token)
    p.add_argument("--health-interval", type=float, default=d.health_interval_s)
    p.add_argument("--health-timeout", type=float, default=d.health_timeout_s)
    p.add_argument(
        "--eject-after",
        type=int,
        default=d.eject_after,
        help="consecutive failures before a backend is ejected",
    )
    p.add_argument(
        "--readmit-after",
        type=int,
        default=d.readmit_after,
        help="consecutive passing health checks before re-admission",
    )
    p.add_argument(
        "--close-after",
        type=int,
        default=d.close_after,
        help="successful legs before a re-admitted (half-open) backend is closed again",
    )
    p.add_argument("--max-retries", type=int, default=d.max_retries)
    p.add_argument("--connect-timeout", type=float, default=d.connect_timeout_s)
    p.add_argument(
        "--leg-budget-base",
        type=float,
        default=d.leg_budget_base_s,
        help="seconds a leg may wait for the prefill answer / first decode byte, plus "
        "--leg-budget-per-1k-tokens per 1000 prompt tokens (default %(default)s)",
    )
    p.add_argument(
        "--leg-budget-per-1k-tokens", type=float, default=d.leg_budget_per_1k_tokens_s
    )
    p.add_argument(
        "--prefill-timeout",
        type=float,
        default=d.prefill_timeout_s,
        help="a fixed prefill-leg timeout instead of the budget",
    )
    p.add_argument(
        "--decode-first-byte-timeout",
        type=float,
        default=d.decode_first_byte_timeout_s,
        help="a fixed decoder first-byte timeout instead of the budget",
    )
    p.add_argument("--stream-idle-timeout", type=float, default=d.stream_idle_timeout_s)
    p.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout_s,
        help="whole non-streaming decode leg",
    )
    lim = p.add_argument_group("client limits")
    lim.add_argument(
        "--max-body-mb",
        type=float,
        default=d.max_body_bytes / MIB,
        help="largest request body, MiB (413 above; default %(default)s)",
    )
    lim.add_argument(
        "--max-body-held-mb",
        type=float,
        default=d.max_body_bytes_held / MIB,
        help="request-body bytes held at once, MiB (503 + Retry-After above; "
        "default %(default)s)",
    )
    lim.add_argument("--header-timeout", type=float, default=d.header_timeout_s)
    lim.add_argument("--body-timeout", type=float, default=d.body_timeout_s)
    lim.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout_s,
        help="close a connection without a request this long (default %(default)s)",
    )
    adm = p.add_argument_group(
        "KV-aware admission",
        "hold requests in the proxy while every decoder / colocated engine is near its KV "
        "limit (read from the engines' own /metrics), instead of pushing them into preemption",
    )
    a = d.admission
    adm.add_argument("--admission", choices=("off", "kv"), default="kv" if a.enabled else "off",
                     help="off (default) or kv")
    adm.add_argument("--admission-kv-high", type=float, default=a.kv_high, metavar="RATIO",
                     help="KV usage watermark, reservations included (default %(default)s)")
    adm.add_argument("--admission-max-waiting", type=int, default=a.max_waiting, metavar="N",
                     help="requests an engine may queue itself (default %(default)s)")
    adm.add_argument("--admission-max-running", type=int, default=a.max_running, metavar="N",
                     help="the proxy's requests active on one engine at most; 0 = no cap "
                     "(default %(default)s)")
    adm.add_argument("--admission-scrape-interval", type=float, default=a.scrape_interval_s,
                     metavar="S", help="engine /metrics scrape interval (default %(default)s)")
    adm.add_argument("--admission-queue-max", type=int, default=a.queue_max, metavar="N",
                     help="requests the proxy holds at most; more: 503 (default %(default)s)")
    adm.add_argument("--admission-queue-timeout", type=float, default=a.queue_timeout_s,
                     metavar="S", help="longest wait in the queue; then 503 (default %(default)s)")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run)
    return p


def backend_table_from_args(args: argparse.Namespace) -> Any:
    """The planner's BackendTable for whichever source the flags name."""
    from pdstack.plan import BackendTable

    sources = [bool(args.inventory), bool(args.backends), bool(args.prefill or args.decode)]
    if sum(sources) != 1:
        raise SystemExit("pdstack proxy: give exactly one of -i, --backends, --prefill/--decode")
    if args.inventory:
        from pdstack.plan import make_plan
        from pdstack.topology import load_topology

        return make_plan(load_topology(args.inventory)).backend_table
    if args.backends:
        return BackendTable.model_validate(json.loads(Path(args.backends).read_text()))
    if not args.kv_mode:
        raise SystemExit("pdstack proxy: --kv-mode is required with --prefill/--decode")
    if kvmodes.get(args.kv_mode).disaggregated and not (args.prefill and args.decode):
        raise SystemExit("pdstack proxy: P/D modes need at least one --prefill and one --decode")
    table = BackendTable.adhoc(args.prefill, args.decode, args.kv_mode, args.served_model_name)
    if kvmodes.get(args.kv_mode).lmcache_push:
        return _adhoc_lmcache_pd(table, args)
    if args.lmcache_pd_receiver:
        raise SystemExit("pdstack proxy: --lmcache-pd-receiver needs --kv-mode lmcache-pd")
    return table


def parse_receiver(text: str) -> dict[str, Any]:
    """``HOST:INIT[,INIT..]:ALLOC[,ALLOC..]`` -> ``{"host", "init_ports", "alloc_ports"}``."""
    host, sep, rest = text.rpartition(":")
    host, sep2, init = host.rpartition(":")
    try:
        if not (sep and sep2 and host):
            raise ValueError
        init_ports = [int(x) for x in init.split(",")]
        alloc_ports = [int(x) for x in rest.split(",")]
    except ValueError:
        raise SystemExit(
            f"pdstack proxy: --lmcache-pd-receiver {text!r}: want HOST:INIT_PORTS:ALLOC_PORTS "
            "(e.g. 10.0.0.31:7302:7303, or 10.0.0.31:7302,7304:7303,7305 for TP 2)"
        ) from None
    if len(init_ports) != len(alloc_ports):
        raise SystemExit(
            f"pdstack proxy: --lmcache-pd-receiver {text!r}: one init and one alloc port per rank"
        )
    return {"host": host.strip("[]"), "init_ports": init_ports, "alloc_ports": alloc_ports}


def _adhoc_lmcache_pd(table: Any, args: argparse.Namespace) -> Any:
    from pdstack.plan import LmcachePdNotify, LmcachePdReceiver

    if args.lmcache_pd_notify_port is None or len(args.lmcache_pd_receiver) != len(args.decode):
        raise SystemExit(
            "pdstack proxy: --kv-mode lmcache-pd with --prefill/--decode needs "
            "--lmcache-pd-notify-port and one --lmcache-pd-receiver HOST:INIT:ALLOC per "
            "--decode (or use -i INVENTORY / --backends, which carry them)"
        )
    receivers = iter(args.lmcache_pd_receiver)
    backends = [
        b.model_copy(update={"lmcache_pd": LmcachePdReceiver(**parse_receiver(next(receivers)))})
        if b.role == "decode"
        else b
        for b in table.backends
    ]
    notify = LmcachePdNotify(
        host=args.lmcache_pd_notify_host or args.host, port=args.lmcache_pd_notify_port
    )
    return table.model_copy(update={"backends": backends, "lmcache_pd_notify": notify})


def admission_from_args(args: argparse.Namespace) -> AdmissionConfig:
    for flag, value, lo, hi in (
        ("--admission-kv-high", args.admission_kv_high, 0.05, 1.0),
        ("--admission-scrape-interval", args.admission_scrape_interval, 0.01, 10.0),
        ("--admission-queue-timeout", args.admission_queue_timeout, 0.0, 3600.0),
    ):
        if not lo <= value <= hi:
            raise SystemExit(f"pdstack proxy: {flag} must be within [{lo:g}, {hi:g}], got {value}")
    for flag, ivalue in (("--admission-max-waiting", args.admission_max_waiting),
                         ("--admission-max-running", args.admission_max_running),
                         ("--admission-queue-max", args.admission_queue_max)):
        if ivalue < 0:
            raise SystemExit(f"pdstack proxy: {flag} must be >= 0, got {ivalue}")
    return AdmissionConfig(
        enabled=args.admission == "kv",
        kv_high=args.admission_kv_high,
        max_waiting=args.admission_max_waiting,
        max_running=args.admission_max_running,
        scrape_interval_s=args.admission_scrape_interval,
        queue_max=args.admission_queue_max,
        queue_timeout_s=args.admission_queue_timeout,
    )


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    config = ProxyConfig(
        host=args.host,
        port=args.port,
        max_concurrency=args.max_concurrency,
        prefix_chars=args.prefix_chars,
        load_factor=max(1.0, args.load_factor),
        skip_prefill_threshold_tokens=args.skip_prefill_threshold,
        chars_per_token=args.chars_per_token,
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        eject_after=args.eject_after,
        readmit_after=args.readmit_after,
        max_retries=args.max_retries,
        connect_timeout_s=args.connect_timeout,
        close_after=args.close_after,
        max_body_bytes=int(args.max_body_mb * MIB),
        max_body_bytes_held=int(args.max_body_held_mb * MIB),
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        idle_timeout_s=args.idle_timeout,
        leg_budget_base_s=args.leg_budget_base,
        leg_budget_per_1k_tokens_s=args.leg_budget_per_1k_tokens,
        prefill_timeout_s=args.prefill_timeout,
        decode_first_byte_timeout_s=args.decode_first_byte_timeout,
        stream_idle_timeout_s=args.stream_idle_timeout,
        request_timeout_s=args.request_timeout,
        lmcache_pd_notify_host=args.lmcache_pd_notify_host,
        lmcache_pd_notify_port=args.lmcache_pd_notify_port,
        lmcache_pd_notify_timeout_s=args.lmcache_pd_notify_timeout,
        admission=admission_from_args(args),
    )
    env_file = args.env_file
    if env_file is None and Path(DEFAULT_ENV_FILE).exists():
        env_file = DEFAULT_ENV_FILE
    if env_file is not None and not Path(env_file).exists():
        raise SystemExit(f"pdstack proxy: env file {env_file} does not exist")
    return load_secrets(config, env_file)


async def serve(proxy: Any, host: str, port: int) -> None:
    """Run until SIGINT/SIGTERM."""
    from aiohttp import web

    runner = proxy.runner()
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096, reuse_address=True)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    logging.getLogger("pdstack.proxy").warning(
        "pdstack proxy on http://%s:%d (kv_mode %s, %d backends)",
        host,
        port,
        proxy.registry.kv_mode,
        len(proxy.registry.backends),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s"
    )
    from pdstack.proxy.app import Proxy
    from pdstack.proxy.backends import BackendRegistry
    from pdstack.topology import TopologyError

    try:
        table = backend_table_from_args(args)
        registry = BackendRegistry.from_table(table)
    except (ValueError, OSError, TopologyError) as exc:
        print(f"pdstack proxy: {exc}")
        return 2
    config = config_from_args(args)
    from pdstack.proxy import tracing

    try:
        tracing.configure_from_env()  # OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, off when unset
    except tracing.TracingUnavailable as exc:
        print(f"pdstack proxy: {exc}")
        return 2
    proxy = Proxy(registry, config)
    loop_factory = None
    try:
        import uvloop  # type: ignore[import-not-found]

        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve(proxy, config.host, config.port))
    except OSError as exc:
        print(f"pdstack proxy: cannot serve on {config.host}:{config.port}: {exc}")
        return 1
    return 0
