"""``pdstack launch``: run one node's planned services as plain processes.

For hosts without Docker (a lent GPU machine, a Slurm allocation).  The services are
exactly ``Plan.nodes[N].services`` -- the same ``command``, ``env`` and ports as the
node's rendered ``compose.yaml`` -- started in the compose stack's order:

1. the LMCache MP server (healthy once its ZMQ port accepts connections);
2. every engine at once, ``CUDA_VISIBLE_DEVICES`` from the service's ``gpu_ids``
   (healthy once ``/health`` answers 200);
3. the proxy, with ``--backends`` pointing at ``<log-dir>/backends.json``
   (``plan.backend_table.model_dump_json()``).

Each service runs in its own process group (``setsid``), writes ``<log-dir>/<svc>.log``
and has a pid file ``<log-dir>/<svc>.pid``.  While waiting for health the server process
is watched: a crash fails the start at once and prints the last lines of its log.
``stop`` sends SIGTERM to each process group (proxy, engines, LMCache in that order),
then SIGKILL after ``--grace`` seconds.

``start --foreground`` stays and supervises, as the Compose stack's restart policy and engine
healthcheck do: a service that dies is started again (backoff 1 s doubling to 60 s), and an
engine that the engine watchdog (``pdstack.sidecars.watchdog``) finds wedged has its
process group killed and is started again; the others keep running (``--restart no``: the
first death stops all). A detached ``start`` supervises nothing: run ``--foreground`` under
systemd, a Slurm step or tmux.

Secrets come from the node's secrets file (``/etc/pdstack/secrets.env``) when readable, and
each service is given only those it reads (:mod:`pdstack.secrets`, as the compose stack's
per-service ``env_file``): the engines ``HF_TOKEN`` and ``VLLM_API_KEY``, the proxy its keys
and admin token, the LMCache server none; a secret of another service in this command's own
environment is not passed on. They are never printed, logged or put on a command line.

The LMCache server's HTTP API (``/run_script``, ``/cache/clear``, ... unauthenticated) is on
a unix socket in ``<log-dir>/lmcache-api/`` (mode 0700), not on a TCP port
(``pdstack.sidecars.lmcache_socket``); no metrics gate runs here: read LMCache's
metrics with ``curl --unix-socket <log-dir>/lmcache-api/api.sock http://lmcache/metrics``.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path
from typing import Any

from pdstack.argtypes import seconds
from pdstack.commands import load_or_exit
from pdstack.launch.launcher import Launcher
from pdstack.launch.prepare import parse_overrides, prepare, read_env_file
from pdstack.launch.services import EXIT_FAILED, EXIT_INVALID, EXIT_OK
from pdstack.launch.supervise import RESTART_POLICIES
from pdstack.plan import Plan, make_plan
from pdstack.secrets import NODE_SECRETS_FILE as SECRETS_ENV_FILE

# where the compose stack mounts the proxy's backend table (launch writes <log-dir>/backends.json)
BACKENDS_IN_COMPOSE = "/etc/pdstack/backends.json"


def default_log_dir(plan: Plan, node: str) -> Path:
    return Path("build") / "launch" / plan.deployment / node


def pick_node(plan: Plan, wanted: str | None) -> str:
    if wanted:
        if wanted not in plan.nodes:
            raise KeyError(f"no node {wanted!r} (nodes: {', '.join(plan.nodes)})")
        return wanted
    if len(plan.nodes) == 1:
        return next(iter(plan.nodes))
    host = socket.gethostname()
    for name, node in plan.nodes.items():
        if host in (name, node.ssh.host, name.split(".")[0]):
            return name
    raise KeyError(f"several nodes ({', '.join(plan.nodes)}); pick one with --node")


def print_status(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        ports = " ".join(f"{k}={v}" for k, v in r["ports"].items())
        print(f"{r['service']:<12} {r['state']:<8} "
              f"{'healthy' if r['healthy'] else 'unhealthy':<9} "
              f"pid={r['pid']} gpus={','.join(map(str, r['gpus'])) or '-'} {ports}")


def cmd_launch(args: argparse.Namespace) -> int:
    plan = make_plan(load_or_exit(args.inventory))
    try:
        node_name = pick_node(plan, args.node)
        overrides = parse_overrides(args.env)
    except (KeyError, ValueError) as err:
        print(f"pdstack launch: {err.args[0]}", file=sys.stderr)
        return EXIT_INVALID
    node = plan.nodes[node_name]
    log_dir = Path(args.log_dir) if args.log_dir else default_log_dir(plan, node_name)
    names = [s.name for s in node.services]
    if args.services:
        wanted = [n.strip() for n in args.services.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            print(f"pdstack launch: {node_name} has no service {', '.join(unknown)} "
                  f"(it has {', '.join(names)})", file=sys.stderr)
            return EXIT_INVALID
        names = [n for n in names if n in wanted]
    launcher = Launcher(plan, node, log_dir)

    if args.action == "stop":
        return launcher.stop(names, grace=args.grace)
    if args.action == "status":
        rc, rows = launcher.status(names)
        print_status(rows, as_json=args.json)
        return rc

    secrets = read_env_file(Path(args.secrets_env))
    try:
        prepared = prepare(plan, node, log_dir, secrets, overrides, names)
    except FileNotFoundError as err:
        print(f"pdstack launch: {err.args[0]}; nothing started", file=sys.stderr)
        return EXIT_FAILED
    rc = launcher.start(prepared, timeout=args.timeout, keep_on_failure=args.keep_on_failure)
    if rc != EXIT_OK or not args.foreground:
        return rc
    return launcher.watch(prepared, grace=args.grace, restart=args.restart,
                          wedge_s=args.wedge_s)


def register(sub: argparse._SubParsersAction, name: str, help_text: str) -> None:
    p = sub.add_parser(
        name,
        help=help_text,
        description=__doc__.split("\n", 2)[2] if __doc__ else help_text,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  pdstack launch -i inventory/h200x2-shared-l1 start --log-dir /tmp/pd\n"
        "  pdstack launch -i inventory/h200x2-shared-l1 status --log-dir /tmp/pd\n"
        "  pdstack launch -i inventory/h200x2-shared-l1 stop --log-dir /tmp/pd\n"
        "  pdstack launch -i inventory/X start --services proxy   # one service only",
    )
    p.add_argument("action", nargs="?", default="start", choices=("start", "stop", "status"))
    p.add_argument("-i", "--inventory", required=True, help="inventory directory (inventory/X)")
    p.add_argument("--node", help="which node of the plan runs here (default: the only one, "
                                  "or the one named like this host)")
    p.add_argument("--log-dir", help="logs, pid files, backends.json "
                                     "(default build/launch/<deployment>/<node>)")
    p.add_argument("--services", help="comma-separated subset of the node's services")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds each stage may take to become healthy (default 1800)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds between SIGTERM and SIGKILL on stop (default 30)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="set (KEY=VALUE) or unset (KEY=) a variable for every service, "
                        "over the plan's; repeatable")
    p.add_argument("--secrets-env", default=SECRETS_ENV_FILE,
                   help=f"KEY=VALUE secrets for the services (default {SECRETS_ENV_FILE}; "
                        "skipped when absent)")
    p.add_argument("--foreground", action="store_true",
                   help="after start, stay and supervise until SIGINT/SIGTERM, then stop all: "
                   "a service that dies, or an engine the watchdog finds wedged, is started "
                   "again (see --restart)")
    p.add_argument("--restart", choices=RESTART_POLICIES, default="unless-stopped",
                   help="with --foreground: unless-stopped (default; as the Compose stack) "
                   "restarts what dies, with a backoff of 1 s doubling to 60 s; no: the "
                   "first death stops every service (exit 1)")
    p.add_argument("--wedge-s", type=seconds, default=None, metavar="S",
                   help="with --foreground: seconds an engine may hold requests with no "
                   "progress, or fail /health once up, before it is restarted (default: the "
                   "Compose watchdog's, 120 on gpu, 30 on cpu)")
    p.add_argument("--keep-on-failure", action="store_true",
                   help="leave started services running when the start fails")
    p.add_argument("--json", action="store_true", help="status as JSON")
    p.set_defaults(func=cmd_launch)
