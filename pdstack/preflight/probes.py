"""One preflight run's work on its nodes: connect over SSH, upload the stdlib probe, read the
host facts, hold a listener on every planned destination port, run each source node's batch
(connects, don't-fragment pings, throughput), and tear it all down. What each node answered
stays on its :class:`ProbeNode` for the judging (:mod:`pdstack.preflight.judge_nodes`,
:mod:`pdstack.preflight.judge_paths`)."""

from __future__ import annotations

import hashlib
import json
import shlex
from typing import Any

from pdstack.plan import Edge, NodePlan, Plan
from pdstack.preflight.transport import Spawned, Transport, TransportError, connect

SMALL_PING = 56  # payload bytes of the control ping that tells "ICMP blocked" from "MTU"


class ProbeNode:
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


class ProbeRun:
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
        self.nodes = {name: ProbeNode(np) for name, np in plan.nodes.items()}
        # listen addresses per destination node
        self.wanted: dict[str, list[tuple[str, int]]] = {name: [] for name in self.nodes}
        for e in plan.edges:
            if e.dst_node in self.wanted and (e.dst_address, e.port) not in self.wanted[e.dst_node]:
                self.wanted[e.dst_node].append((e.dst_address, e.port))
        # UCX's TCP transport (NIXL without RDMA) moves the KV over connections to an ephemeral
        # port on the peer: one extra listener on port 0 wherever a cross-node NIXL edge lands
        self.ucx_edges = [e for e in plan.edges if is_ucx_edge(e)]
        for e in self.ucx_edges:
            if e.dst_node in self.wanted and (e.dst_address, 0) not in self.wanted[e.dst_node]:
                self.wanted[e.dst_node].append((e.dst_address, 0))
        self.listen_seconds = ssh_timeout + 3 * timeout + 30
        self.edges_by_src: dict[str, list[Edge]] = {}
        for e in plan.edges:
            self.edges_by_src.setdefault(e.src_node, []).append(e)
        self.mtu_pairs: dict[str, list[tuple[str, int]]] = {}

    def pick(self, node: ProbeNode) -> str:
        """Shell that sets $PY: the given interpreter, else the inventory's
        ansible_python_interpreter, else the system python3 (not a user's shim)."""
        chosen = self.python or node.plan.ssh.python or "/usr/bin/python3"
        return (
            f'PY={shlex.quote(chosen)}; [ -x "$PY" ] || PY=$(command -v python3) || '
            "{ echo 'python3 not found on this node' >&2; exit 127; }"
        )

    def setup(self, node: ProbeNode) -> None:
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

    def plan_mtu_pairs(self, ready: list[ProbeNode]) -> None:
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

    def _batch_spec(self, node: ProbeNode) -> dict[str, Any]:
        name = node.plan.name
        wanted_targets = {(e.dst_address, e.port) for e in self.edges_by_src.get(name, [])}
        for e in self.ucx_edges:
            port = ephemeral_port(self.nodes.get(e.dst_node), e.dst_address)
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

    def probe_from(self, node: ProbeNode) -> None:
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


def teardown(node: ProbeNode) -> None:
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


def is_ucx_edge(e: Edge) -> bool:
    return "nixl" in e.purpose and e.src_node != e.dst_node


def ephemeral_port(node: ProbeNode | None, addr: str) -> int | None:
    if node is None:
        return None
    return next((b.get("port") for b in node.binds if b.get("requested_port") == 0
                 and b.get("address") == addr and b.get("status") == "listening"), None)


def _hostport(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
