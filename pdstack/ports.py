"""Ports and engine names: the one place a node's ports are numbered and its engines
named (from the topology alone, so validation can check collisions before planning).

Its types come from :mod:`pdstack.specs`: the topology's checks import this module, the
planner reads it, and this module imports neither."""

from __future__ import annotations

from pdstack import kvmodes
from pdstack.specs import DeploymentSpec, EngineSpec, NodeSpec, Topology

ROLE_SHORT = {"prefill": "prefill", "decode": "decode", "colocated": "engine"}


def make_node_ports(topo: Topology, node: NodeSpec) -> dict[str, int]:
    """The one place ports are numbered: engine i gets base + i on its node."""
    d = topo.deployment
    ports: dict[str, int] = {}
    for i, (eng, name) in enumerate(zip(node.engines, engine_names(node), strict=True)):
        ports[f"{name} http"] = d.ports.engine_http_base + i
        if d.kv_events:
            ports[f"{name} kv events replay"] = kv_events_replay_port(d, i)
        if uses_nixl(topo, node, eng.role):
            ports[f"{name} nixl side channel"] = d.ports.nixl_side_channel_base + i
        if lmcache_push(d) and eng.role == "decode":
            init, alloc = lmcache_pd_receiver_ports(topo, node, i)
            for rank, (ip, ap) in enumerate(zip(init, alloc, strict=True)):
                suffix = f" rank {rank}" if len(init) > 1 else ""
                ports[f"{name} lmcache-pd init{suffix}"] = ip
                ports[f"{name} lmcache-pd alloc{suffix}"] = ap
    if has_lmcache_server(d, node):
        ports["lmcache zmq"] = d.ports.lmcache_zmq
        # the /metrics gate (pdstack.sidecars); LMCache's own API is on a unix socket
        ports["lmcache http"] = d.ports.lmcache_http
    if node.proxy:
        ports["proxy http"] = d.ports.proxy
        if d.kv_events:
            ports["proxy kv events"] = d.ports.kv_events
        if lmcache_push(d):
            ports["proxy lmcache-pd notify"] = lmcache_pd_notify_port(d)
        if d.monitoring:
            ports["prometheus http"] = d.observability.prometheus_port
            ports["grafana http"] = d.observability.grafana_port
    return ports


def kv_events_replay_port(d: DeploymentSpec, index: int) -> int:
    """Where engine ``index`` of a node answers KV-event replay requests (its ZMQ ROUTER)."""
    return d.ports.kv_events_replay_base + index


def zmq_tcp(host: str, port: int) -> str:
    """A ZMQ TCP endpoint (IPv6 addresses in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def engine_tp(d: DeploymentSpec, eng: EngineSpec) -> int:
    """The tensor-parallel size an engine runs with (``--tensor-parallel-size``)."""
    return (len(eng.gpus) or 1) if d.profile == "gpu" else 1


def lmcache_pd_notify_port(d: DeploymentSpec) -> int:
    """The proxy's ZMQ PULL port for LMCache's ProxyNotif (``LMCACHE_PD_PROXY_PORT``)."""
    return d.ports.lmcache_pd_base - 1


def lmcache_pd_receiver_ports(
    topo: Topology, node: NodeSpec, index: int
) -> tuple[list[int], list[int]]:
    """(init ports, alloc ports) of engine ``index`` on ``node``, one per TP rank.

    Every engine before it on the node reserves a block of ``2 * tp`` ports from
    ``lmcache_pd_base``; inside its block rank r gets init ``start + 2r`` and alloc
    ``start + 2r + 1``.  With TP 1 everywhere this is ``base + 2i`` / ``base + 2i + 1``."""
    d = topo.deployment
    start = d.ports.lmcache_pd_base + 2 * sum(engine_tp(d, e) for e in node.engines[:index])
    tp = engine_tp(d, node.engines[index])
    return [start + 2 * r for r in range(tp)], [start + 2 * r + 1 for r in range(tp)]


def engine_names(node: NodeSpec) -> list[str]:
    """The service name of each engine on the node, in order: ``prefill-0``, ``decode-1``,
    ``engine-0`` (colocated)."""
    counters: dict[str, int] = {}
    names = []
    for eng in node.engines:
        names.append(f"{ROLE_SHORT[eng.role]}-{counters.setdefault(eng.role, 0)}")
        counters[eng.role] += 1
    return names


def lmcache_push(d: DeploymentSpec) -> bool:
    """LMCache's legacy P/D push (kv_mode lmcache-pd)."""
    return kvmodes.get(d.kv_mode).lmcache_push


def has_lmcache_server(d: DeploymentSpec, node: NodeSpec) -> bool:
    """The node runs an LMCache MP server when some engine on it uses the tier (nixl+l1:
    a decoder-only node has none; its L1 would hold host RAM for nothing)."""
    return kvmodes.get(d.kv_mode).runs_lmcache_server(e.role for e in node.engines)


def cross_node_roles(topo_nodes: list[NodeSpec], node: NodeSpec) -> set[str]:
    """Roles on ``node`` that have a P/D partner on another node."""
    others = {e.role for n in topo_nodes if n.name != node.name for e in n.engines}
    mine = {e.role for e in node.engines}
    out = set()
    if "prefill" in mine and "decode" in others:
        out.add("prefill")
    if "decode" in mine and "prefill" in others:
        out.add("decode")
    return out


def uses_nixl(topo: Topology, node: NodeSpec, role: str) -> bool:
    """NIXL only where needed: on every P/D engine where the mode hands off same-node pairs
    over NIXL (``nixl``, ``nixl+l1``); in ``shared-l1+nixl`` only for an engine whose role
    has a partner on another node (same-node pairs use the LMCache store)."""
    mode = kvmodes.get(topo.deployment.kv_mode)
    if role not in ("prefill", "decode"):
        return False
    return mode.nixl_for(role in cross_node_roles(topo.nodes, node))
