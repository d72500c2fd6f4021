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
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import shlex
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from pdstack.plan import Edge, NodePlan, Plan
from pdstack.preflight.report import (
    CAUSE_TEXT,
    Check,
    Kind,
    NodeReport,
    PreflightReport,
    Status,
    is_private_address,
)
from pdstack.preflight.transport import Spawned, Transport, TransportError, connect

T = TypeVar("T")
SMALL_PING = 56  # payload bytes of the control ping that tells "ICMP blocked" from "MTU"


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


def _edge_label(e: Edge) -> str:
    return f"{e.src_node} -> {e.dst_node} {e.dst_address}:{e.port} ({e.purpose})"


class _Node:
    """Per-node state during one run."""

    def __init__(self, plan: NodePlan):
        self.plan = plan
        self.transport: Transport | None = None
        self.error: TransportError | None = None
        self.probe: str | None = None
        self.facts: dict[str, Any] = {}
        self.listener: Spawned | None = None
        self.binds: list[dict[str, Any]] = []
        self.listener_error: str | None = None
        self.listener_done: dict[str, Any] = {}
        self.batch: dict[str, Any] | None = None
        self.batch_error: str | None = None


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
    run = _Run(plan, probe_file.read_bytes(), timeout=timeout, ssh_timeout=ssh_timeout,
               python=python, throughput_s=throughput_s)
    nodes = run.nodes
    # ---- phase 1: connect, upload, facts, listeners
    _parallel(list(nodes.values()), run.setup)
    # ---- phase 2: one batch per source node
    ready = [n for n in nodes.values() if n.error is None]
    run.plan_mtu_pairs(ready)
    _parallel(ready, run.probe_from)
    # ---- phase 3: stop listeners, close
    _parallel(list(nodes.values()), _teardown)

    _judge(plan, nodes, report)
    report.duration_s = time.monotonic() - t0
    return report


class _Run:
    """What the three phases of one preflight run share."""

    def __init__(self, plan: Plan, probe_src: bytes, *, timeout: float, ssh_timeout: float,
                 python: str | None, throughput_s: float):
        self.timeout = timeout
        self.ssh_timeout = ssh_timeout
        self.python = python
        self.throughput_s = throughput_s
        self.probe_src = probe_src
        self.full_digest = hashlib.sha256(probe_src).hexdigest()
        self.remote_probe = f"/tmp/pdstack_probe-{self.full_digest[:12]}.py"
        self.nodes = {name: _Node(np) for name, np in plan.nodes.items()}
        # listen addresses per destination node
        self.wanted: dict[str, list[tuple[str, int]]] = {name: [] for name in self.nodes}
        for e in plan.edges:
            if e.dst_node in self.wanted and (e.dst_address, e.port) not in self.wanted[e.dst_node]:
                self.wanted[e.dst_node].append((e.dst_address, e.port))
        # UCX's TCP transport (NIXL without RDMA) moves the KV over connections to an ephemeral
        # port on the peer: one extra listener on port 0 wherever a cross-node NIXL edge lands
        self.ucx_edges = [e for e in plan.edges if _is_ucx_edge(e)]
        for e in self.ucx_edges:
            if e.dst_node in self.wanted and (e.dst_address, 0) not in self.wanted[e.dst_node]:
                self.wanted[e.dst_node].append((e.dst_address, 0))
        self.listen_seconds = ssh_timeout + 3 * timeout + 30
        self.edges_by_src: dict[str, list[Edge]] = {}
        for e in plan.edges:
            self.edges_by_src.setdefault(e.src_node, []).append(e)
        self.mtu_pairs: dict[str, list[tuple[str, int]]] = {}

    def pick(self, node: _Node) -> str:
        """Shell that sets $PY: the given interpreter, else the inventory's
        ansible_python_interpreter, else the system python3 (not a user's shim)."""
        chosen = self.python or node.plan.ssh.python or "/usr/bin/python3"
        return (
            f'PY={shlex.quote(chosen)}; [ -x "$PY" ] || PY=$(command -v python3) || '
            "{ echo 'python3 not found on this node' >&2; exit 127; }"
        )

    def setup(self, node: _Node) -> None:
        try:
            node.transport = connect(node.plan.name, node.plan.ssh, self.ssh_timeout)
        except TransportError as exc:
            node.error = exc
            return
        except Exception as exc:  # paramiko raises a zoo; never let one node kill the run
            node.error = TransportError("ssh_unreachable", f"{type(exc).__name__}: {exc}")
            return
        tr = node.transport
        wanted = self.wanted[node.plan.name]
        command = f'{self.pick(node)}; {self._install_command()}; "$PY" {self.remote_probe} info'
        if wanted:
            binds = " ".join(f"--bind {_hostport(a, p)}" for a, p in wanted)
            command += (
                f' && exec "$PY" {self.remote_probe} listen {binds} '
                f"--seconds {self.listen_seconds:.0f} --exit-on-stdin-eof"
            )
        node.probe = self.remote_probe
        try:
            proc = tr.spawn(command)
            proc.write(self.probe_src)
            line = proc.readline(self.ssh_timeout + 10)
            node.facts = json.loads(line)
            if wanted:
                node.listener = proc
                try:
                    ready = json.loads(proc.readline(self.ssh_timeout + 5))
                    node.binds = ready.get("binds", [])
                except (TransportError, ValueError) as exc:
                    node.listener_error = str(exc)
            else:
                proc.finish(2.0)
        except TransportError as exc:
            node.error = exc
        except ValueError as exc:
            node.error = TransportError("probe_error", f"probe printed no JSON: {exc}")

    def _install_command(self) -> str:
        # One remote command per node (each SSH exec pays the login shell's start-up):
        # install the probe if this exact version is not there yet (read exactly
        # len(probe) bytes from stdin), print host facts, then become the listener.
        n = len(self.probe_src)
        remote_probe, full_digest = self.remote_probe, self.full_digest
        # reuse a copy only if it is ours and byte-identical (the name in /tmp is
        # predictable; another user's file there is never executed)
        return (
            f'{{ test -O {remote_probe} && sha256sum {remote_probe} | grep -q "^{full_digest} "; }}'
            f" || {{ umask 022; t=$(mktemp /tmp/.pdstack_probe.XXXXXX) "
            f'&& head -c {n} > "$t" && [ "$(wc -c < "$t")" -eq {n} ] '
            f'&& mv -f "$t" {remote_probe} || {{ rm -f "$t"; echo "probe upload failed" >&2; '
            "exit 126; }; }"
        )

    def plan_mtu_pairs(self, ready: list[_Node]) -> None:
        for a in ready:
            for b in self.nodes.values():
                if a is b:
                    continue
                mtu = min(a.plan.mtu, b.plan.mtu)
                self.mtu_pairs.setdefault(a.plan.name, []).append((b.plan.name, mtu))

    def _throughput_targets(self, src: str) -> list[dict[str, Any]]:
        """One NIXL edge per destination node, to a port our own listener holds."""
        out: dict[str, dict[str, Any]] = {}
        for e in self.edges_by_src.get(src, []):
            if e.dst_node == src or "nixl" not in e.purpose or e.dst_node in out:
                continue
            binds = self.nodes[e.dst_node].binds
            mine = any(b.get("port") == e.port and b.get("status") == "listening" for b in binds)
            if mine:
                out[e.dst_node] = {"id": e.dst_node, "host": e.dst_address, "port": e.port,
                                   "seconds": self.throughput_s}
        return list(out.values())

    def _batch_spec(self, node: _Node) -> dict[str, Any]:
        name = node.plan.name
        wanted_targets = {(e.dst_address, e.port) for e in self.edges_by_src.get(name, [])}
        for e in self.ucx_edges:
            port = _ephemeral_port(self.nodes.get(e.dst_node), e.dst_address)
            if e.src_node == name and port:
                wanted_targets.add((e.dst_address, port))
        targets = sorted(wanted_targets)
        pings = []
        for dst, mtu in self.mtu_pairs.get(name, []):
            addr = self.nodes[dst].plan.private_address
            overhead = 48 if ":" in addr else 28
            pings.append({"id": f"{dst}/mtu", "host": addr, "size": mtu - overhead})
            pings.append({"id": f"{dst}/small", "host": addr, "size": SMALL_PING})
        tputs = self._throughput_targets(name) if self.throughput_s > 0 else []
        return {
            "timeout": self.timeout,
            "connect": [{"id": f"{h}:{p}", "host": h, "port": p} for h, p in targets],
            "ping": pings,
            "throughput": tputs,
        }

    def probe_from(self, node: _Node) -> None:
        assert node.transport is not None
        spec = self._batch_spec(node)
        command = f'{self.pick(node)}; exec "$PY" {node.probe} batch'
        limit = self.timeout + 8 + len(spec["throughput"]) * (
            self.throughput_s + self.timeout + 2)
        try:
            res = node.transport.exec(command, stdin=json.dumps(spec).encode(), timeout=limit)
            if res.rc != 0:
                node.batch_error = f"probe batch exited {res.rc}: {res.stderr.strip()[:300]}"
                return
            node.batch = json.loads(res.stdout)
        except TransportError as exc:
            node.batch_error = str(exc)
        except ValueError as exc:
            node.batch_error = f"probe printed no JSON: {exc}"


def _teardown(node: _Node) -> None:
    if node.listener is not None:
        try:
            out = node.listener.finish(3.0)
            for line in out.splitlines():
                if line.startswith("{") and '"done"' in line:
                    node.listener_done = json.loads(line)
        except (TransportError, ValueError, OSError, EOFError):
            pass
    if node.transport is not None:
        node.transport.close()


def _is_ucx_edge(e: Edge) -> bool:
    return "nixl" in e.purpose and e.src_node != e.dst_node


def _ephemeral_port(node: _Node | None, addr: str) -> int | None:
    if node is None:
        return None
    return next((b.get("port") for b in node.binds if b.get("requested_port") == 0
                 and b.get("address") == addr and b.get("status") == "listening"), None)


def _hostport(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


# ---------------------------------------------------------------------------- judging


def _judge(plan: Plan, nodes: dict[str, _Node], report: PreflightReport) -> None:
    checks = report.checks
    for name, node in nodes.items():
        ssh = node.plan.ssh
        report.nodes[name] = NodeReport(
            name=name,
            ssh_target=node.transport.description
            if node.transport
            else f"{ssh.user}@{ssh.host}:{ssh.port}",
            reachable=node.error is None or node.error.cause == "probe_error",
            facts=_facts_summary(node.facts),
        )
        _judge_node(plan, node, checks)
    for e in plan.edges:
        checks.append(_judge_edge(e, nodes))
    for e in plan.edges:
        if _is_ucx_edge(e):
            checks.append(_judge_ucx(e, nodes))
    _judge_mtu_paths(nodes, checks)
    _judge_throughput(plan, nodes, checks)


def _judge_node(plan: Plan, node: _Node, checks: list[Check]) -> None:
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


def _judge_reach(node: _Node, checks: list[Check]) -> bool:
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


def _judge_binds(node: _Node, checks: list[Check]) -> None:
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


def _judge_address(plan: Plan, node: _Node, checks: list[Check]) -> None:
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


def _judge_interface_mtu(node: _Node, holder: dict[str, Any], checks: list[Check]) -> None:
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


def _judge_rdma(node: _Node, checks: list[Check]) -> None:
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


def _judge_memory(node: _Node, checks: list[Check]) -> None:
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


def _connect_result(node: _Node | None, addr: str, port: int) -> dict[str, Any] | None:
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


def _judge_edge(e: Edge, nodes: dict[str, _Node]) -> Check:
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


def _judge_ucx(e: Edge, nodes: dict[str, _Node]) -> Check:
    """The decoder's node reaching an ephemeral TCP port on the prefiller's node."""
    port = _ephemeral_port(nodes.get(e.dst_node), e.dst_address)
    purpose = f"{e.purpose.replace(' nixl side channel', '')} UCX data path (ephemeral port)"
    ucx = Edge(src_node=e.src_node, dst_node=e.dst_node, dst_address=e.dst_address,
               port=port or 1, purpose=purpose)
    check = _judge_edge(ucx, nodes)
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


def _judge_mtu_paths(nodes: dict[str, _Node], checks: list[Check]) -> None:
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


def _judge_throughput(plan: Plan, nodes: dict[str, _Node], checks: list[Check]) -> None:
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


def _facts_summary(facts: dict[str, Any]) -> dict[str, Any]:
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
