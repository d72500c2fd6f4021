"""The judging of each network path of the plan: every edge (a TCP connect to a planned port),
UCX's ephemeral data port behind a cross-node NIXL edge, the path MTU between node pairs (a
full-size don't-fragment ping told from ICMP being blocked), and the NIXL throughput runs."""

from __future__ import annotations

from typing import Any

from pdstack.plan import Edge, Plan
from pdstack.preflight.probes import SMALL_PING, ProbeNode, ephemeral_port
from pdstack.preflight.report import CAUSE_TEXT, Check, Status


def _edge_label(e: Edge) -> str:
    return f"{e.src_node} -> {e.dst_node} {e.dst_address}:{e.port} ({e.purpose})"


def _connect_result(node: ProbeNode | None, addr: str, port: int) -> dict[str, Any] | None:
    if node is None or node.batch is None:
        return None
    return next(
        (
            r
            for r in node.batch.get("connect", [])
            if r.get("host") == addr and r.get("port") == port
        ),
        None,
    )


def judge_edge(e: Edge, nodes: dict[str, ProbeNode]) -> Check:
    src = nodes.get(e.src_node)
    dst = nodes.get(e.dst_node)
    base: dict[str, Any] = dict(
        kind="edge",
        src=e.src_node,
        dst=e.dst_node,
        dst_address=e.dst_address,
        port=e.port,
        purpose=e.purpose,
    )
    label = _edge_label(e)
    if src is None or src.error is not None:
        why = str(src.error) if src is not None and src.error else "unknown node"
        return Check(
            status="fail",
            cause="src_unreachable",
            subject=label,
            result=f"not probed: source {e.src_node} unreachable ({why})",
            **base,
        )
    if src.batch is None:
        return Check(
            status="fail",
            cause="probe_error",
            subject=label,
            result=f"probe on {e.src_node} failed: {src.batch_error}",
            **base,
        )
    r = _connect_result(src, e.dst_address, e.port)
    if r is None:
        return Check(
            status="fail",
            cause="probe_error",
            subject=label,
            result="no result from the probe",
            **base,
        )
    notes = []
    if dst is not None and dst.error is not None:
        notes.append(f"destination {e.dst_node} unreachable over SSH, so no listener there")
    bind = next(
        (
            b
            for b in (dst.binds if dst else [])
            if b.get("address") == e.dst_address and b.get("port") == e.port
        ),
        None,
    )
    if bind and bind.get("status") == "in_use":
        notes.append("port already in use on the destination (an existing listener answered)")
    detail = {"connect": r, "listener": bind}
    note = f" [{'; '.join(notes)}]" if notes else ""
    status = r.get("status")
    if status == "ok":
        return Check(
            status="ok",
            rtt_ms=r.get("rtt_ms"),
            detail=detail,
            subject=label,
            result=f"ok, {r.get('rtt_ms')} ms" + note,
            **base,
        )
    elapsed = (r.get("elapsed_ms") or 0) / 1000.0
    cause = status if status in CAUSE_TEXT else "error"
    what = CAUSE_TEXT[cause]
    if cause == "timeout":
        what = f"timed out after {r.get('timeout_s')}s (filtered by a firewall DROP, or no route)"
    elif cause == "error":
        what = f"error: {r.get('error')}"
    return Check(
        status="fail",
        cause=cause,
        elapsed_s=round(elapsed, 3),
        detail=detail,
        subject=label,
        result=f"{what}" + note,
        **base,
    )


def judge_ucx(e: Edge, nodes: dict[str, ProbeNode]) -> Check:
    """The decoder's node reaching an ephemeral TCP port on the prefiller's node."""
    port = ephemeral_port(nodes.get(e.dst_node), e.dst_address)
    purpose = f"{e.purpose.replace(' nixl side channel', '')} UCX data path (ephemeral port)"
    ucx = Edge(src_node=e.src_node, dst_node=e.dst_node, dst_address=e.dst_address,
               port=port or 1, purpose=purpose)
    check = judge_edge(ucx, nodes)
    check.kind = "ucx"
    if port is None:
        check.port = None
        check.subject = (f"{e.src_node} -> {e.dst_node} {e.dst_address}:<ephemeral> "
                         f"({purpose})")
        if check.cause != "src_unreachable":
            check.status, check.cause = "fail", "probe_error"
            check.result = "no ephemeral listener on the destination (see its probe check)"
        check.message = f"{check.subject}: {check.result}"
    elif check.status == "fail":
        check.result += ("; UCX over TCP needs the nodes' ephemeral ports open to each other "
                         "(or UCX_TCP_PORT_RANGE opened in the firewall)")
        check.message = f"{check.subject}: {check.result}"
    return check


def judge_mtu_paths(nodes: dict[str, ProbeNode], checks: list[Check]) -> None:
    for src in nodes.values():
        if src.batch is None:
            continue
        pings = {p.get("id"): p for p in src.batch.get("ping", [])}
        for dst in nodes.values():
            if dst is src or f"{dst.plan.name}/mtu" not in pings:
                continue
            big = pings[f"{dst.plan.name}/mtu"]
            small = pings.get(f"{dst.plan.name}/small", {})
            mtu = min(src.plan.mtu, dst.plan.mtu)
            size = big.get("size")
            base: dict[str, Any] = dict(
                kind="path_mtu",
                src=src.plan.name,
                dst=dst.plan.name,
                dst_address=dst.plan.private_address,
                detail={"mtu": mtu, "size": size, "ping": big, "small_ping": small},
            )
            label = f"{src.plan.name} -> {dst.plan.name} {dst.plan.private_address}"
            status, cause, result = _mtu_verdict(big, small, mtu, size)
            rtt = {"rtt_ms": big.get("rtt_ms")} if status == "ok" else {}
            checks.append(
                Check(status=status, cause=cause, subject=label, result=result, **rtt, **base)
            )


def _mtu_verdict(
    big: dict[str, Any], small: dict[str, Any], mtu: int, size: Any
) -> tuple[Status, str | None, str]:
    """(status, cause, result) of one path's DF ping of the full MTU (``big``) and its
    small control ping: a smaller MTU on the path is told from ICMP being blocked."""
    if big.get("status") == "ok":
        return "ok", None, f"MTU {mtu} ok (DF ping of {size} bytes)"
    if big.get("status") == "too_big":
        where = f"local/path MTU {big['mtu']}" if big.get("mtu") else "packet too big"
        return "fail", "mtu", f"MTU {mtu} fails at size {size} ({where}; DF ping)"
    if small.get("status") == "ok":
        return "fail", "mtu", (
            f"MTU {mtu} fails at size {size} (no reply to a "
            f"don't-fragment ping of {big.get('packet_bytes')} bytes, while a "
            f"{SMALL_PING}-byte ping answers: a smaller MTU on the path)")
    if big.get("status") == "unavailable":
        return "warn", "icmp_blocked", f"MTU {mtu} unverified: {big.get('error')}"
    return "warn", "icmp_blocked", (
        f"MTU {mtu} unverified: no ICMP echo reply at any size "
        f"({small.get('status')}); ICMP blocked or host unreachable")


def judge_throughput(plan: Plan, nodes: dict[str, ProbeNode], checks: list[Check]) -> None:
    for src in nodes.values():
        for t in (src.batch or {}).get("throughput", []):
            dst = t.get("id")
            edge = next((e for e in plan.edges if e.src_node == src.plan.name
                         and e.dst_node == dst and e.port == t.get("port")), None)
            subject = f"{src.plan.name} -> {dst} {t.get('host')}:{t.get('port')}"
            if edge is not None:
                subject += f" ({edge.purpose})"
            base: dict[str, Any] = dict(
                kind="throughput", src=src.plan.name, dst=dst, dst_address=t.get("host"),
                port=t.get("port"), purpose=edge.purpose if edge else None, subject=subject,
                detail={"throughput": t},
            )
            if t.get("status") == "ok":
                checks.append(Check(
                    status="ok", result=f"{t.get('mbit_per_s')} Mbit/s (one TCP stream, "
                    f"{t.get('seconds')}s)", **base))
            else:
                cause = t.get("status") if t.get("status") in CAUSE_TEXT else "error"
                checks.append(Check(
                    status="fail", cause=cause,
                    result=f"throughput run failed: {t.get('error') or CAUSE_TEXT[cause]}",
                    **base))
