"""``run_preflight(plan)``: prove every network path of a plan before anything starts.

Phases, each parallel over nodes and bounded in time:

1. SSH to every node (paramiko), upload the stdlib probe (``scripts/pdstack_probe.py``)
   to ``/tmp``, collect host facts (interfaces, MTU, GPU, RDMA, memory, disk), and start a
   listener on every planned destination port where nothing listens yet.
2. From every source node, one probe run connects to all its edges and sends
   don't-fragment pings at the configured MTU to every other node, all in parallel.
3. Listeners are stopped (stdin closed) and connections closed.

Worst case (every edge filtered, a node unreachable) is about ``ssh_timeout + timeout +
a few seconds``; with the defaults (5 s, 3 s) well under 30 s for any number of nodes.

Then every check is judged from what the nodes answered: each node itself
(:mod:`pdstack.preflight.judge_nodes`) and each path between them
(:mod:`pdstack.preflight.judge_paths`). The per-node work is :mod:`pdstack.preflight.probes`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from pdstack.plan import Plan
from pdstack.preflight.judge_nodes import facts_summary, judge_node
from pdstack.preflight.judge_paths import (
    judge_edge,
    judge_mtu_paths,
    judge_throughput,
    judge_ucx,
)
from pdstack.preflight.probes import ProbeNode, ProbeRun, is_ucx_edge, teardown
from pdstack.preflight.report import NodeReport, PreflightReport

T = TypeVar("T")


def default_probe_path() -> Path:
    env = os.environ.get("PDSTACK_PROBE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "scripts" / "pdstack_probe.py"


def _parallel(items: list[Any], fn: Callable[[Any], T]) -> list[T]:
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(64, len(items))) as pool:
        return list(pool.map(fn, items))


def run_preflight(
    plan: Plan,
    *,
    timeout: float = 3.0,
    ssh_timeout: float = 5.0,
    probe_path: str | Path | None = None,
    inventory: str | None = None,
    python: str | None = None,
    throughput_s: float = 0.0,
) -> PreflightReport:
    """Probe every edge of ``plan``; never raises for a network problem, never hangs.

    ``throughput_s`` > 0 also measures one TCP stream of that many seconds per source node
    and destination node joined by a NIXL edge (the KV transfer path)."""
    t0 = time.monotonic()
    report = PreflightReport(
        deployment=plan.deployment,
        inventory=inventory,
        timeout_s=timeout,
        ssh_timeout_s=ssh_timeout,
        started_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    probe_file = Path(probe_path) if probe_path else default_probe_path()
    run = ProbeRun(plan, probe_file.read_bytes(), timeout=timeout, ssh_timeout=ssh_timeout,
                   python=python, throughput_s=throughput_s)
    nodes = run.nodes
    # ---- phase 1: connect, upload, facts, listeners
    _parallel(list(nodes.values()), run.setup)
    # ---- phase 2: one batch per source node
    ready = [n for n in nodes.values() if n.error is None]
    run.plan_mtu_pairs(ready)
    _parallel(ready, run.probe_from)
    # ---- phase 3: stop listeners, close
    _parallel(list(nodes.values()), teardown)

    _judge(plan, nodes, report)
    report.duration_s = time.monotonic() - t0
    return report


def _judge(plan: Plan, nodes: dict[str, ProbeNode], report: PreflightReport) -> None:
    checks = report.checks
    for name, node in nodes.items():
        ssh = node.plan.ssh
        report.nodes[name] = NodeReport(
            name=name,
            ssh_target=node.transport.description
            if node.transport
            else f"{ssh.user}@{ssh.host}:{ssh.port}",
            reachable=node.error is None or node.error.cause == "probe_error",
            facts=facts_summary(node.facts),
        )
        judge_node(plan, node, checks)
    for e in plan.edges:
        checks.append(judge_edge(e, nodes))
    for e in plan.edges:
        if is_ucx_edge(e):
            checks.append(judge_ucx(e, nodes))
    judge_mtu_paths(nodes, checks)
    judge_throughput(plan, nodes, checks)
