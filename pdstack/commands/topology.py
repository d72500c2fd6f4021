"""``pdstack validate | plan | render``: the topology commands."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdstack.commands import load_or_exit
from pdstack.plan import make_plan


def cmd_validate(args: argparse.Namespace) -> int:
    topo = load_or_exit(args.inventory)
    plan = make_plan(topo)
    n_services = sum(len(n.services) for n in plan.nodes.values())
    print(
        f"{args.inventory}: ok: {len(plan.nodes)} node(s), {n_services} service(s), "
        f"kv_mode {plan.kv_mode}, kv_tier {plan.kv_tier}, "
        f"{len(plan.backend_table.pairings)} pairing(s), "
        f"{len(plan.edges)} network edge(s)"
    )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    topo = load_or_exit(args.inventory)
    plan = make_plan(topo)
    if args.json:
        print(plan.model_dump_json(indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    # piped or redirected: no terminal width to fit, so never wrap or cut a cell ("…")
    console = Console() if sys.stdout.isatty() else Console(width=10_000, no_color=True)
    services = Table(
        title=f"{plan.deployment}: services ({plan.kv_mode}, tier {plan.kv_tier}, {plan.profile})"
    )
    for col in ("node", "service", "role", "GPUs", "ports", "KV connector"):
        services.add_column(col)
    for node in plan.nodes.values():
        for s in node.services:
            conn = (s.kv_transfer_config or {}).get("kv_connector", "")
            ports = " ".join(f"{k}={v}" for k, v in s.ports.items())
            gpus = ",".join(map(str, s.gpu_ids))
            services.add_row(node.name, s.name, s.role or "", gpus, ports, conn)
    console.print(services)
    pairs = Table(title="pairings (prefiller -> decoder)")
    for col in ("prefill", "decode", "KV path"):
        pairs.add_column(col)
    for p in plan.backend_table.pairings:
        pairs.add_row(p.prefill, p.decode, p.kv_path)
    console.print(pairs)
    edges = Table(title="network edges that must be reachable")
    for col in ("src", "dst", "address:port", "purpose"):
        edges.add_column(col)
    for e in plan.edges:
        edges.add_row(e.src_node, e.dst_node, f"{e.dst_address}:{e.port}", e.purpose)
    console.print(edges)
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    # here, not at the top: validate and plan need no templates or dashboard builder (the
    # GPU payload has no grafana_foundation_sdk)
    from pdstack.render import output_dirs, render_all, write_stacks

    topo = load_or_exit(args.inventory)
    plan = make_plan(topo)
    dirs = output_dirs(plan, Path(args.output) if args.output else None)
    rendered = render_all(topo, plan, dirs)
    if args.check:
        stale = [
            str(dirs[n] / f)
            for n, files in rendered.items()
            for f, text in files.items()
            if not (dirs[n] / f).is_file() or (dirs[n] / f).read_text() != text
        ]
        if stale:
            print("pdstack: out of date (run pdstack render): " + ", ".join(stale),
                  file=sys.stderr)
            return 1
        print("up to date: " + ", ".join(str(p) for p in dirs.values()))
        return 0
    for path in write_stacks(rendered, dirs):
        print(f"wrote {path}")
    return 0


def register(sub: argparse._SubParsersAction, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    p.add_argument("-i", "--inventory", required=True, help="inventory directory (inventory/X)")
    if name == "validate":
        p.set_defaults(func=cmd_validate)
    elif name == "plan":
        p.add_argument("--json", action="store_true", help="the whole plan as JSON")
        p.set_defaults(func=cmd_plan)
    else:
        p.add_argument("-o", "--output", help="output directory (default build/<node>/)")
        p.add_argument("--check", action="store_true",
                       help="exit 1 if the files on disk differ from a fresh render")
        p.set_defaults(func=cmd_render)
