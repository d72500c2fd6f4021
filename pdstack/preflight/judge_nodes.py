"""The judging of each node itself: SSH and the probe, the listeners it could not bind, the
private address and its interface (up, MTU), RDMA where the plan expects it, host memory for
the LMCache L1; and the facts summary of the report."""

from __future__ import annotations

import ipaddress
from typing import Any

from pdstack.plan import NodePlan, Plan
from pdstack.preflight.probes import ProbeNode
from pdstack.preflight.report import CAUSE_TEXT, Check, Kind, is_private_address


def judge_node(plan: Plan, node: ProbeNode, checks: list[Check]) -> None:
    if not _judge_reach(node, checks):
        return
    _judge_binds(node, checks)
    _judge_address(plan, node, checks)
    _judge_memory(node, checks)
    _judge_rdma(node, checks)


def _node_fail(kind: Kind, name: str, cause: str, result: str, **more: Any) -> Check:
    """A failed check about node ``name`` itself (not an edge)."""
    return Check(kind=kind, status="fail", node=name, cause=cause, subject=name, result=result,
                 **more)


def _judge_reach(node: ProbeNode, checks: list[Check]) -> bool:
    """ssh and the probe: False when nothing more can be judged on this node."""
    name = node.plan.name
    ssh = node.plan.ssh
    target = f"{ssh.user}@{ssh.host}:{ssh.port}"
    if node.error is not None and node.error.cause != "probe_error":
        checks.append(
            Check(
                kind="ssh",
                status="fail",
                node=name,
                cause=node.error.cause,
                subject=f"{name} ({target})",
                result=f"{CAUSE_TEXT[node.error.cause]}: {node.error}",
            )
        )
        return False
    note = node.transport.host_key_note if node.transport else None
    is_local = node.transport is not None and node.transport.description.startswith("local")
    checks.append(
        Check(
            kind="ssh",
            status="warn" if note else "ok",
            node=name,
            subject=f"{name} ({target})",
            result=("runs locally" if is_local else "ssh ok") + (f"; {note}" if note else ""),
        )
    )
    if node.error is not None:
        checks.append(_node_fail("probe", name, "probe_error", f"probe failed: {node.error}"))
        return False
    return True


def _judge_binds(node: ProbeNode, checks: list[Check]) -> None:
    """The probe's listeners: every planned address:port it could not listen on."""
    name = node.plan.name
    if node.listener_error:
        checks.append(
            _node_fail(
                "probe", name, "probe_error",
                f"listener did not start: {node.listener_error}",
            )
        )
    for b in node.binds:
        status = b.get("status")
        if status not in ("address_not_available", "error"):
            continue
        port = b.get("port") or None  # 0: the ephemeral (UCX) listener
        where = f"{b.get('address')}:{port or '<ephemeral>'}"
        missing = status == "address_not_available"
        checks.append(
            Check(
                kind="probe",
                status="fail",
                node=name,
                port=port,
                dst_address=b.get("address"),
                cause="address_missing" if missing else "probe_error",
                subject=name,
                result=f"cannot listen on {where}: "
                + ("address not on any interface" if missing else str(b.get("error"))),
            )
        )


def _judge_address(plan: Plan, node: ProbeNode, checks: list[Check]) -> None:
    """The private address: private, on an interface that is up, MTU as configured."""
    name = node.plan.name
    addr = node.plan.private_address
    ifaces = node.facts.get("interfaces", {}).get("interfaces", [])
    holder = next(
        (i for i in ifaces for a in i.get("addresses", []) if a.get("address") == addr), None
    )
    try:
        private = is_private_address(addr)
        loopback = ipaddress.ip_address(addr).is_loopback
    except ValueError:
        private, loopback = False, False
    if loopback and len(plan.nodes) == 1:
        checks.append(
            Check(
                kind="address",
                status="ok",
                node=name,
                subject=name,
                result=f"{addr} is loopback (single-node plan)",
            )
        )
    elif not private:
        checks.append(
            _node_fail(
                "address", name, "address_not_private",
                f"address {addr} is not private (RFC 1918, CGNAT 100.64/10 or "
                "IPv6 ULA fc00::/7); engines would expose KV ports publicly",
                dst_address=addr,
            )
        )
    if holder is None:
        have = _addresses_text(ifaces)
        checks.append(
            _node_fail(
                "address", name, "address_missing",
                f"private address {addr} is on no interface (has: {have})",
                dst_address=addr,
            )
        )
        return
    if not (holder.get("up") and holder.get("lower_up")):
        checks.append(
            _node_fail(
                "address", name, "interface_down",
                f"{addr} is on {holder.get('name')}, which is down "
                f"(state {holder.get('state')})",
                dst_address=addr,
            )
        )
    elif private:
        checks.append(
            Check(
                kind="address",
                status="ok",
                node=name,
                dst_address=addr,
                subject=name,
                result=f"{addr} on {holder.get('name')}, private",
            )
        )
    if not loopback:
        _judge_interface_mtu(node, holder, checks)


def _addresses_text(ifaces: list[dict[str, Any]]) -> str:
    """The node's addresses outside ``lo``, as ``ADDR on IFACE, ...`` (or ``none``)."""
    return (
        ", ".join(
            f"{a.get('address')} on {i.get('name')}"
            for i in ifaces
            for a in i.get("addresses", [])
            if i.get("name") != "lo"
        )
        or "none"
    )


def _judge_interface_mtu(node: ProbeNode, holder: dict[str, Any], checks: list[Check]) -> None:
    """The MTU of the interface holding the private address against pdstack_mtu."""
    mtu = holder.get("mtu")
    low = isinstance(mtu, int) and mtu < node.plan.mtu
    checks.append(
        Check(
            kind="interface_mtu",
            status="fail" if low else "ok",
            node=node.plan.name,
            cause="mtu" if low else None,
            detail={
                "interface": holder.get("name"),
                "interface_mtu": mtu,
                "configured_mtu": node.plan.mtu,
            },
            subject=node.plan.name,
            result=f"{holder.get('name')} MTU {mtu} is below the configured "
            f"pdstack_mtu {node.plan.mtu}"
            if low
            else f"{holder.get('name')} MTU {mtu} (configured {node.plan.mtu})",
        )
    )


def _judge_rdma(node: ProbeNode, checks: list[Check]) -> None:
    """RDMA where the plan expects it (pdstack_rdma: true)."""
    if not node.plan.rdma:
        return
    name = node.plan.name
    rdma = node.facts.get("rdma", {})
    if not rdma.get("present"):
        checks.append(
            _node_fail(
                "rdma", name, "rdma_absent",
                "RDMA expected (pdstack_rdma: true) but absent: no "
                "/dev/infiniband/uverbs* device; NIXL would fall back to TCP",
            )
        )
    elif rdma.get("ibv_devinfo") and not rdma.get("active_ports"):
        checks.append(
            _node_fail(
                "rdma", name, "rdma_absent",
                "RDMA expected but no port is PORT_ACTIVE (ibv_devinfo)",
                detail={"ports": rdma.get("ports", [])},
            )
        )
    else:
        checks.append(
            Check(
                kind="rdma",
                status="ok",
                node=name,
                subject=name,
                result=f"RDMA present ({', '.join(rdma.get('hcas', [])) or 'uverbs'}, "
                f"{rdma.get('active_ports', '?')} active port(s))",
            )
        )


def _l1_size_gb(node: NodePlan) -> float | None:
    """The LMCache L1 size the plan gives this node's LMCache server, if it runs one."""
    for svc in node.services:
        if svc.kind == "lmcache" and "--l1-size-gb" in svc.command:
            i = svc.command.index("--l1-size-gb")
            try:
                return float(svc.command[i + 1])
            except (IndexError, ValueError):
                return None
    return None


def _judge_memory(node: ProbeNode, checks: list[Check]) -> None:
    need_gb = _l1_size_gb(node.plan)
    avail = node.facts.get("resources", {}).get("memory", {}).get("available_bytes")
    if need_gb is None or not isinstance(avail, int):
        return
    have_gb = avail / 2**30
    detail = {"lmcache_l1_gb": need_gb, "memory_available_gb": round(have_gb, 1)}
    name = node.plan.name
    if have_gb < need_gb:
        checks.append(Check(
            kind="resources", status="fail", node=name, cause="memory", subject=name,
            detail=detail,
            result=f"LMCache L1 of {need_gb:g} GiB does not fit: {have_gb:.1f} GiB of host "
                   "memory available",
        ))
    else:
        checks.append(Check(
            kind="resources", status="ok", node=name, subject=name, detail=detail,
            result=f"LMCache L1 {need_gb:g} GiB fits ({have_gb:.1f} GiB available)",
        ))


def facts_summary(facts: dict[str, Any]) -> dict[str, Any]:
    if not facts:
        return {}
    res = facts.get("resources", {})
    gpu = facts.get("gpu", {})
    rdma = facts.get("rdma", {})
    return {
        "hostname": facts.get("hostname"),
        "python": facts.get("python"),
        "memory_total_bytes": res.get("memory", {}).get("total_bytes"),
        "memory_available_bytes": res.get("memory", {}).get("available_bytes"),
        "disk": res.get("disk", []),
        "cpus": res.get("cpus"),
        "gpu_count": gpu.get("count", 0) if gpu.get("present") else 0,
        "gpu_driver": gpu.get("driver_version"),
        "gpus": [g.get("name") for g in gpu.get("gpus", [])],
        "rdma_present": bool(rdma.get("present")),
        "rdma_active_ports": rdma.get("active_ports", 0),
        "interfaces": [
            {
                "name": i.get("name"),
                "mtu": i.get("mtu"),
                "state": i.get("state"),
                "addresses": [a.get("address") for a in i.get("addresses", [])],
            }
            for i in facts.get("interfaces", {}).get("interfaces", [])
        ],
    }
