"""The planner: topology -> per-node services, the proxy's backend table, network edges.

Pure functions, no I/O.  Everything downstream (renderer, proxy, preflight, Ansible,
launch, upgrade) reads the :class:`Plan`, never the raw inventory.

:func:`make_plan` reads top-down: the KV mode (:mod:`pdstack.kvmodes`, what the mode
implies for each engine), each node's ports numbered from it (:mod:`pdstack.ports`), each
node's services (:mod:`pdstack.plan_engine`, :mod:`pdstack.plan_proxy`), the proxy's
backend table and the network edges. The plan's types live in :mod:`pdstack.plan_types`.
"""

from __future__ import annotations

from pdstack import kvmodes, secrets
from pdstack.plan_engine import NUMA_SYSFS_MASK, engine_service, lmcache_service, model_path
from pdstack.plan_proxy import backend_table, proxy_service
from pdstack.plan_types import (
    Backend,
    BackendTable,
    Edge,
    KvEventsListen,
    KvEventsSource,
    KvPath,
    LmcachePdNotify,
    LmcachePdReceiver,
    NodePlan,
    Pairing,
    Plan,
    Service,
    ServiceKind,
    SshTarget,
)
from pdstack.ports import NodePorts, node_ports
from pdstack.topology import NodeSpec, Topology, native_tier_sizes

# what downstream imports from here: the plan's types, and two engine facts
__all__ = [
    "NUMA_SYSFS_MASK", "Backend", "BackendTable", "Edge", "KvEventsListen", "KvEventsSource",
    "KvPath", "LmcachePdNotify", "LmcachePdReceiver", "NodePlan", "Pairing", "Plan", "Service",
    "ServiceKind", "SshTarget", "make_plan", "model_path",
]


def make_plan(topo: Topology) -> Plan:
    """The plan of ``topo``: the KV mode once, each node's ports from it, each node's
    services, the proxy's backend table, the network edges."""
    d = topo.deployment
    mode = kvmodes.get(d.kv_mode)
    ports = {node.name: node_ports(topo, node, mode) for node in topo.nodes}
    proxy_node = next(n for n in topo.nodes if n.proxy)
    nodes = {
        node.name: _node_plan(topo, node, ports[node.name], proxy_node.private_address)
        for node in topo.nodes
    }
    table = backend_table(topo, mode, ports, proxy_node)
    return Plan(
        deployment=d.name,
        kv_mode=d.kv_mode,
        profile=d.profile,
        kv_tier=d.tier,
        nodes=nodes,
        backend_table=table,
        edges=_edges(nodes, table, proxy_node.name),
    )


def _node_plan(topo: Topology, node: NodeSpec, ports: NodePorts, proxy_addr: str) -> NodePlan:
    """One node: its LMCache server, its engines and the proxy, as the ports say."""
    d = topo.deployment
    services: list[Service] = []
    if ports.lmcache is not None:
        users = sum(e.kv.lmcache_tier for e in ports.engines)
        services.append(lmcache_service(d, node, ports.lmcache, users))
    tier_gb = native_tier_sizes(d, node)
    services += [engine_service(d, node, e, proxy_addr, tier_gb.get(e.index))
                 for e in ports.engines]
    if ports.proxy is not None:
        services.append(proxy_service(topo, node, ports.proxy, [e.name for e in ports.engines]))
    services = [_with_secrets(s) for s in services]
    return NodePlan(
        name=node.name,
        private_address=node.private_address,
        ssh=SshTarget(**node.ssh.model_dump()),
        mtu=node.mtu,
        rdma=node.rdma,
        gpu_count=node.gpu_count,
        services=services,
        secret_files=_secret_files(services),
    )


def _with_secrets(svc: Service) -> Service:
    """``svc`` with the secrets its kind reads (pdstack.secrets, the one home of that)."""
    names = list(secrets.names_for(svc.kind))
    return svc.model_copy(update={"secrets": names,
                                  "secrets_file": secrets.service_file(svc.kind)})


def _secret_files(services: list[Service]) -> dict[str, list[str]]:
    kinds: list[str] = [s.kind for s in services]
    if "proxy" in kinds:
        kinds.append("grafana")  # the monitoring profile lives on the proxy's node
    out: dict[str, list[str]] = {}
    for kind in kinds:
        path = secrets.service_file(kind)
        if path:
            out[path] = list(secrets.names_for(kind))
    return out


def _edges(nodes: dict[str, NodePlan], table: BackendTable, proxy_node: str) -> list[Edge]:
    """Every src->dst:port the stack uses (deduplicated, stable order), from the services'
    own ports."""
    out: dict[tuple, Edge] = {}

    def add(src: str, dst: str, port: int, purpose: str) -> None:
        e = Edge(src_node=src, dst_node=dst, dst_address=nodes[dst].private_address,
                 port=port, purpose=purpose)
        out.setdefault((src, dst, port), e)

    by_name = {f"{n.name}/{s.name}": s for n in nodes.values() for s in n.services}
    proxy = by_name[f"{proxy_node}/proxy"]
    for node in nodes.values():
        for svc in node.services:
            if svc.kind == "engine":
                add(proxy_node, node.name, svc.ports["http"], f"proxy->{svc.name} http")
                # its KV events: PUB -> the proxy's SUB, and the proxy's replay requests
                if "kv_events_replay" in svc.ports:
                    add(node.name, proxy_node, proxy.ports["kv_events"],
                        f"{svc.name}->proxy kv events")
                    add(proxy_node, node.name, svc.ports["kv_events_replay"],
                        f"proxy->{svc.name} kv events replay")
                if svc.depends_on:
                    add(node.name, node.name, by_name[f"{node.name}/lmcache"].ports["zmq"],
                        f"{svc.name}->lmcache zmq")
            if svc.kind == "lmcache":
                add(proxy_node, node.name, svc.ports["metrics"], "proxy->lmcache metrics")
    receivers = {b.name: b.lmcache_pd for b in table.backends}
    for pair in table.pairings:
        p, dec = by_name[pair.prefill], by_name[pair.decode]
        if pair.kv_path == "nixl":
            add(dec.node, p.node, p.ports["nixl_side_channel"],
                f"{dec.name}->{p.name} nixl side channel")
        if pair.kv_path == "lmcache-pd":
            rx = receivers[pair.decode]
            assert rx is not None
            for rank, (init, alloc) in enumerate(zip(rx.init_ports, rx.alloc_ports, strict=True)):
                suffix = f" rank {rank}" if len(rx.init_ports) > 1 else ""
                add(p.node, dec.node, init, f"{p.name}->{dec.name} lmcache-pd init{suffix}")
                add(p.node, dec.node, alloc, f"{p.name}->{dec.name} lmcache-pd alloc{suffix}")
            # the prefiller's LMCache PUSHes ProxyNotif to the proxy when the KV is in
            add(p.node, proxy_node, proxy.ports["lmcache_pd_notify"], "lmcache-pd notify")
    return list(out.values())
