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
import math
import signal
from pathlib import Path
from typing import Any

from pdstack import kvmodes
from pdstack.proxy import gc_tuning
from pdstack.proxy.admission_flags import add_admission_flags, admission_from_args
from pdstack.proxy.config import MIB, ProxyConfig, load_secrets
from pdstack.proxy.flags import Flag, add_fields, dest
from pdstack.proxy.kv_events_route import HEADROOM, KvEventsConfig

DEFAULT_ENV_FILE = "/etc/pdstack/secrets.env"
KV_MODE_CHOICES = kvmodes.NAMES


# the KV-event router's numbers (KvEventsConfig fields)
_KV_ROUTE = (
    Flag("pending_s", "seconds a routed prompt's blocks count as held on its engine before "
         "its KV events tell (0: only what events told; default %(default)s)",
         flag="--kv-pending-s"),
    Flag("miss_weight", "routing cost of a prompt token to compute, against one queued ahead "
         "of it on the engine (above 1: stickier to the engine holding the prefix; default "
         "%(default)s)"),
)
_SERVER = (
    Flag("host", "bind address (default %(default)s)"),
    Flag("port", "port (default %(default)s)"),
)
_TUNING = (
    Flag("max_concurrency", "requests in flight before 429 (default %(default)s)"),
    Flag("prefix_chars", "leading prompt characters hashed for prefill affinity"),
    Flag("load_factor", "bounded-load factor, >= 1 (default %(default)s)"),
    Flag(
        "skip_prefill_threshold_tokens",
        "skip prefill when the uncached prompt part is below this many tokens "
        "(shared-l1 modes; default: the backend table's value; 0 = off)",
        flag="--skip-prefill-threshold",
        metavar="TOKENS",
    ),
    Flag("chars_per_token"),
    Flag("health_interval_s"),
    Flag("health_timeout_s"),
    Flag("eject_after", "consecutive failures before a backend is ejected"),
    Flag("readmit_after", "consecutive passing health checks before re-admission"),
    Flag(
        "readmit_interval_s",
        "probe a backend out of rotation (starting or ejected, not wedged) this often between "
        "health rounds; 0 = health rounds only (default %(default)s)",
    ),
    Flag("close_after", "successful legs before a re-admitted (half-open) backend is closed again"),
    Flag(
        "wedge_after_s",
        "a leg waiting this long with no answer from its backend since makes it a wedge "
        "suspect, confirmed by a 1-token generation; 0 = off (default %(default)s)",
    ),
    Flag(
        "wedge_probe_timeout_s",
        "deadline of that generation; past it the backend is wedged (default %(default)s)",
    ),
    Flag("max_retries"),
    Flag(
        "max_migrations",
        "continue a stream whose leg failed mid-stream on another engine at most this often "
        "a request; 0 = off (default %(default)s)",
    ),
    Flag(
        "stall_probe_after_s",
        "an engine with streams that can migrate, silent this long, has its /health "
        "probed; 0 = off (default %(default)s)",
    ),
    Flag(
        "stall_probe_timeout_s",
        "no answer within this: the engine is frozen and its streams migrate now; it is "
        "not ejected for it (default %(default)s)",
    ),
    Flag("connect_timeout_s"),
    Flag(
        "leg_budget_base_s",
        "seconds a leg may wait for the prefill answer / first decode byte, plus "
        "--leg-budget-per-1k-tokens per 1000 prompt tokens (default %(default)s)",
    ),
    Flag("leg_budget_per_1k_tokens_s"),
    Flag("prefill_timeout_s", "a fixed prefill-leg timeout instead of the budget"),
    Flag("decode_first_byte_timeout_s", "a fixed decoder first-byte timeout instead of the budget"),
    Flag("stream_idle_timeout_s"),
    Flag("request_timeout_s", "whole non-streaming decode leg"),
)
_LMCACHE_PD = (
    Flag(
        "lmcache_pd_notify_port",
        "ZMQ PULL port for the prefillers' ProxyNotif (default: the backend table's)",
    ),
    Flag(
        "lmcache_pd_notify_host",
        "address the ProxyNotif socket binds (default: the table's, else --host)",
    ),
    Flag(
        "lmcache_pd_notify_timeout_s",
        "seconds the decode leg waits for ProxyNotif; then it goes anyway and the "
        "decoder recomputes (default %(default)s)",
    ),
)
_CLIENT_TIMEOUTS = (
    Flag("header_timeout_s"),
    Flag("body_timeout_s"),
    Flag("idle_timeout_s", "close a connection without a request this long (default %(default)s)"),
)
_CONFIG_FLAGS = _SERVER + _TUNING + _LMCACHE_PD + _CLIENT_TIMEOUTS


def register(subparsers: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(name, help=help_text, description=__doc__.splitlines()[0])
    d = ProxyConfig()
    _add_backend_flags(p)
    add_fields(p.add_argument_group("kv_mode lmcache-pd"), d, _LMCACHE_PD)
    add_fields(p, d, _SERVER)
    p.add_argument(
        "--env-file",
        default=None,
        help=f"KEY=VALUE file with secrets (default {DEFAULT_ENV_FILE} if present)",
    )
    add_fields(p, d, _TUNING)
    _add_limit_flags(p, d)
    add_admission_flags(p, d.admission)
    p.add_argument(
        "--kv-events", choices=("on", "off"), default="on",
        help="follow the engines' vLLM KV events (the backend table's kv_events) and route "
        "colocated requests by the blocks each engine holds (default %(default)s)",
    )
    kv = KvEventsConfig()
    add_fields(p, kv, _KV_ROUTE, prefix="kv-")
    p.add_argument(
        "--kv-unheld", choices=("ring", "cost"), default="ring" if kv.unheld_home else "cost",
        help="a prompt no engine holds (beyond a first block): ring = to its hash-ring home "
        "under the load bound, cost = to the least queued engine (default %(default)s)",
    )
    p.add_argument(
        "--kv-headroom", choices=HEADROOM, default=kv.headroom,
        help="an engine without KV headroom for a request: filter = routed to only when none "
        "has any, cost = costed the prompt's tokens more (default %(default)s)",
    )
    p.add_argument(
        "--gc", default=gc_tuning.mode_from_env(), metavar="MODE",
        help="the garbage collector once serving: tuned (what is alive then frozen: full "
        "collections walk the requests' objects only), default (CPython's), or T0,T1,T2 "
        f"thresholds, frozen too (default %(default)s: ${gc_tuning.ENV}, else tuned)",
    )
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run)
    return p


def _add_backend_flags(p: argparse.ArgumentParser) -> None:
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


def _add_limit_flags(p: argparse.ArgumentParser, d: ProxyConfig) -> None:
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
        help="request-body bytes held at once, MiB (503 + Retry-After above; default %(default)s)",
    )
    add_fields(lim, d, _CLIENT_TIMEOUTS)


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


def config_from_args(args: argparse.Namespace, table: Any = None) -> ProxyConfig:
    """The proxy's settings from its flags, the tenants of ``table`` (a BackendTable) and
    the secrets (ValueError: named keys that do not fit the tenants)."""
    from pdstack.proxy.tenants import TenantPolicy

    values = {f.field: getattr(args, dest(f.name())) for f in _CONFIG_FLAGS}
    values["load_factor"] = max(1.0, values["load_factor"])
    tenants = getattr(table, "tenants", None) or {}
    config = ProxyConfig(
        **values,
        max_body_bytes=int(args.max_body_mb * MIB),
        max_body_bytes_held=int(args.max_body_held_mb * MIB),
        admission=admission_from_args(args),
        tenants={name: TenantPolicy.from_spec(name, spec) for name, spec in tenants.items()},
        engine_priority=bool(getattr(table, "engine_priority", False)),
    )
    for flag in ("kv_pending_s", "kv_miss_weight"):
        value = getattr(args, flag, 0.0)
        if not (math.isfinite(value) and value >= 0):  # inf x a full hit's 0 miss is NaN
            raise SystemExit(f"pdstack proxy: --{flag.replace('_', '-')} must be a finite "
                             f"number >= 0, got {value}")
    if table is not None:
        defaults = KvEventsConfig()
        config.kv_events = KvEventsConfig.from_table(
            table, enabled=getattr(args, "kv_events", "on") == "on",
            pending_s=getattr(args, "kv_pending_s", defaults.pending_s),
            miss_weight=getattr(args, "kv_miss_weight", defaults.miss_weight),
            unheld_home=getattr(args, "kv_unheld", "ring") == "ring",
            headroom=getattr(args, "kv_headroom", defaults.headroom),
        )
    env_file = args.env_file
    if env_file is None and Path(DEFAULT_ENV_FILE).exists():
        env_file = DEFAULT_ENV_FILE
    if env_file is not None and not Path(env_file).exists():
        raise SystemExit(f"pdstack proxy: env file {env_file} does not exist")
    return load_secrets(config, env_file)


async def serve(proxy: Any, host: str, port: int, gc_mode: str = "default") -> None:
    """Run until SIGINT/SIGTERM; once serving, the collector as ``gc_mode`` asks
    (:mod:`pdstack.proxy.gc_tuning`)."""
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
    tuning = gc_tuning.tune(gc_mode)
    try:
        await stop.wait()
    finally:
        gc_tuning.restore(tuning)
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
    try:
        config = config_from_args(args, table)
        gc_tuning.parse_mode(args.gc)
    except ValueError as exc:  # named keys (never printed) that do not fit the tenants
        print(f"pdstack proxy: {exc}")
        return 2
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
            runner.run(serve(proxy, config.host, config.port, args.gc))
    except OSError as exc:
        print(f"pdstack proxy: cannot serve on {config.host}:{config.port}: {exc}")
        return 1
    return 0
