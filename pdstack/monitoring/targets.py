"""Scrape targets and the monitoring stack's addresses, from the plan (one home: the plan's
services; nothing here is configured twice)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdstack.plan import Plan, Service
from pdstack.topology import DeploymentSpec

# job name per service kind (PromQL selects on it)
JOBS = {"proxy": "pdstack-proxy", "engine": "pdstack-engine", "lmcache": "pdstack-lmcache"}


@dataclass(frozen=True)
class Target:
    job: str
    address: str  # host:port on the private network
    metrics_path: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class MonitoringPlan:
    """Where the monitoring stack runs (the proxy's node) and what it scrapes."""

    node: str
    address: str  # the node's private address: Prometheus and Grafana bind it
    prometheus_port: int
    grafana_port: int
    targets: list[Target]

    @property
    def prometheus_url(self) -> str:
        return f"http://{self.address}:{self.prometheus_port}"

    @property
    def grafana_url(self) -> str:
        return f"http://{self.address}:{self.grafana_port}"


def _target(svc: Service, address: str, metrics_path: str) -> Target:
    port = svc.ports["metrics"] if svc.kind == "lmcache" else svc.ports["http"]
    labels = {"node": svc.node, "service": svc.name, "role": svc.role or svc.kind}
    if svc.generation:
        labels["generation"] = svc.generation
    return Target(JOBS[svc.kind], f"{address}:{port}", metrics_path, labels)


def scrape_targets(d: DeploymentSpec, plan: Plan) -> list[Target]:
    """Every proxy, engine and LMCache server of the plan, on its private address."""
    out: list[Target] = []
    for node in plan.nodes.values():
        for svc in node.services:
            # a proxy bound to 0.0.0.0 is still scraped on the node's private address
            address = svc.bind_address
            if address in ("0.0.0.0", "::", ""):
                address = node.private_address
            path = d.ports.proxy_metrics_path if svc.kind == "proxy" else "/metrics"
            out.append(_target(svc, address, path))
    return out


def monitoring_plan(d: DeploymentSpec, plan: Plan) -> MonitoringPlan:
    proxy_node = next(
        n for n in plan.nodes.values() if any(s.kind == "proxy" for s in n.services)
    )
    o = d.observability
    return MonitoringPlan(
        node=proxy_node.name,
        address=proxy_node.private_address,
        prometheus_port=o.prometheus_port,
        grafana_port=o.grafana_port,
        targets=scrape_targets(d, plan),
    )
