"""What a preflight run found: one :class:`Check` per fact, gathered in a :class:`PreflightReport`.

The JSON form (``PreflightReport.to_dict()``) is documented by ``schema.json`` beside this
file; keep the two in step (tests validate every report against the schema).
"""

from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["ok", "warn", "fail"]
Kind = Literal[
    "ssh", "probe", "address", "interface_mtu", "path_mtu", "edge", "ucx", "rdma", "resources",
    "throughput",
]

SCHEMA_VERSION = 1

# cause codes (machine-readable; ``message`` says it for people)
CAUSE_TEXT: dict[str, str] = {
    "timeout": "timed out (filtered by a firewall DROP, or no route)",
    "refused": "connection refused (nothing listening, or a firewall REJECT)",
    "host_unreachable": "host unreachable (no route, link down, or REJECT host-unreachable)",
    "network_unreachable": "network unreachable (no route from the source)",
    "error": "error",
    "src_unreachable": "not probed: source node unreachable over SSH",
    "ssh_unreachable": "ssh unreachable",
    "ssh_auth": "ssh authentication failed",
    "host_key": "ssh host key rejected",
    "probe_error": "the probe failed on the node",
    "address_not_private": "address not private",
    "address_missing": "address not on any interface",
    "interface_down": "interface down",
    "mtu": "MTU too small",
    "icmp_blocked": "ICMP echo not answered; MTU unverified",
    "rdma_absent": "RDMA expected but absent",
    "memory": "not enough host memory",
}


@dataclass
class Check:
    """One finding.  ``message`` = ``"<subject>: <result>"`` and names src, dst, port,
    purpose and cause for an edge; ``cause`` is one of :data:`CAUSE_TEXT`'s codes."""

    kind: Kind
    status: Status
    subject: str = ""
    result: str = ""
    message: str = ""
    node: str | None = None
    src: str | None = None
    dst: str | None = None
    dst_address: str | None = None
    port: int | None = None
    purpose: str | None = None
    cause: str | None = None
    rtt_ms: float | None = None
    elapsed_s: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.message:
            self.message = f"{self.subject}: {self.result}"


@dataclass
class NodeReport:
    name: str
    ssh_target: str
    reachable: bool = False
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass
class PreflightReport:
    deployment: str
    inventory: str | None
    timeout_s: float
    ssh_timeout_s: float
    started_at: str
    duration_s: float = 0.0
    nodes: dict[str, NodeReport] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == "warn"]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def summary(self) -> dict[str, int]:
        out = {"ok": 0, "warn": 0, "fail": 0}
        for c in self.checks:
            out[c.status] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "deployment": self.deployment,
            "inventory": self.inventory,
            "ok": self.ok,
            "exit_code": self.exit_code,
            "started_at": self.started_at,
            "duration_s": round(self.duration_s, 3),
            "timeout_s": self.timeout_s,
            "ssh_timeout_s": self.ssh_timeout_s,
            "summary": self.summary(),
            "nodes": {name: asdict(n) for name, n in self.nodes.items()},
            "checks": [asdict(c) for c in self.checks],
        }


def is_private_address(address: str) -> bool:
    """RFC 1918, CGNAT (RFC 6598) or IPv6 ULA (fc00::/7)."""
    ip = ipaddress.ip_address(address)
    nets = (
        ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10"]
        if ip.version == 4
        else ["fc00::/7"]
    )
    return any(ip in ipaddress.ip_network(n) for n in nets)
