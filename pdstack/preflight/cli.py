"""``pdstack preflight -i inventory/X [--json] [--timeout S]``.

Exit 0 when every check passed (warnings allowed), 1 when a check failed, 2 on misuse
(invalid inventory, bad arguments, probe script missing).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXIT_OK, EXIT_FAIL, EXIT_MISUSE = 0, 1, 2


def register(subparsers: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        name, help=help_text, description=__doc__.splitlines()[0] if __doc__ else help_text
    )
    p.add_argument("-i", "--inventory", required=True, help="inventory directory (hosts.yml)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (schema.json)")
    p.add_argument("--timeout", type=float, default=3.0, metavar="S",
                   help="per-edge connect / ping timeout in seconds (default 3)")
    p.add_argument("--ssh-timeout", type=float, default=5.0, metavar="S",
                   help="SSH connect timeout per node in seconds (default 5)")
    p.add_argument("--throughput", type=float, default=0.0, metavar="S",
                   help="also measure TCP throughput for S seconds over each cross-node "
                        "NIXL path (default off)")
    p.add_argument("--probe", default=None, help="path of pdstack_probe.py (default: scripts/)")
    p.add_argument("--all", action="store_true", help="list passing checks too, not only problems")
    p.set_defaults(func=cmd_preflight)
    return p


def cmd_preflight(args: argparse.Namespace) -> int:
    from pdstack.commands import load_or_exit
    from pdstack.plan import make_plan
    from pdstack.preflight.runner import default_probe_path, run_preflight

    if not 0 < args.timeout <= 60 or not 0 < args.ssh_timeout <= 60:
        print("pdstack preflight: --timeout and --ssh-timeout must be in (0, 60]", file=sys.stderr)
        return EXIT_MISUSE
    if not 0 <= args.throughput <= 30:
        print("pdstack preflight: --throughput must be in [0, 30] seconds", file=sys.stderr)
        return EXIT_MISUSE
    topo = load_or_exit(args.inventory, "pdstack preflight")  # exit 2 = EXIT_MISUSE
    probe = args.probe or default_probe_path()
    try:
        open(probe, "rb").close()
    except OSError as exc:
        print(f"pdstack preflight: probe script not readable: {exc}", file=sys.stderr)
        return EXIT_MISUSE
    report = run_preflight(make_plan(topo), timeout=args.timeout, ssh_timeout=args.ssh_timeout,
                           probe_path=probe, inventory=str(args.inventory),
                           throughput_s=args.throughput)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print_report(report, show_all=args.all)
    return report.exit_code


def print_report(report: Any, show_all: bool = False) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(soft_wrap=False)
    if not console.is_terminal:
        console = Console(soft_wrap=False, width=160)
    nodes = Table(title=f"preflight {report.deployment}: nodes")
    for col in ("node", "ssh", "reachable", "host", "GPUs", "RDMA", "mem avail", "interfaces"):
        nodes.add_column(col)
    for n in report.nodes.values():
        f = n.facts
        mem = f.get("memory_available_bytes")
        ifaces = " ".join(f"{i['name']}:{i['mtu']}" for i in f.get("interfaces", [])
                          if i["name"] != "lo")
        nodes.add_row(
            n.name, escape(n.ssh_target), "[green]yes[/]" if n.reachable else "[red]no[/]",
            f.get("hostname") or "", str(f.get("gpu_count", "")),
            "" if not f else ("yes" if f.get("rdma_present") else "no"),
            f"{mem / 2**30:.1f} GiB" if mem else "", ifaces,
        )
    console.print(nodes)

    table = Table(title="checks" if show_all else "checks (problems only; --all lists all)")
    for col in ("status", "kind", "node/src", "dst", "port", "purpose", "result"):
        table.add_column(col, overflow="fold")
    style = {"ok": "green", "warn": "yellow", "fail": "bold red"}
    for c in report.checks:
        if c.status == "ok" and not show_all:
            continue
        table.add_row(
            f"[{style[c.status]}]{c.status}[/]", c.kind, c.src or c.node or "", c.dst or "",
            str(c.port or ""), escape(c.purpose or ""), escape(c.result or c.message),
        )
    if table.row_count:
        console.print(table)
    s = report.summary()
    verdict = "[green]PASS[/]" if report.ok else "[bold red]FAIL[/]"
    console.print(f"{verdict}: {s['ok']} ok, {s['warn']} warn, {s['fail']} fail "
                  f"in {report.duration_s:.1f}s")
    for c in report.failures:
        print(f"FAIL {c.message}", file=sys.stderr)
