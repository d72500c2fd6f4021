"""Ports and engine names: the one place a node's ports are numbered and its engines
named (from the topology alone, so validation can check collisions before planning).

Which ports an engine needs beside its HTTP port comes from its KV mode
(:meth:`pdstack.kvmodes.KvMode.engine`): a NIXL side channel where it runs NIXL, LMCache's
receiver ports on an lmcache-pd decoder. :func:`node_ports` numbers them once per node;
the planner reads that record and the topology's checks its labelled form
(:func:`make_node_ports`).

Its types come from :mod:`pdstack.specs`: the topology's checks import this module, the
planner reads it, and this module imports neither."""

from __future__ import annotations

from dataclasses import dataclass

from pdstack import kvmodes
from pdstack.specs import DeploymentSpec, EngineSpec, NodeSpec, Topology

ROLE_SHORT = {"prefill": "prefill", "decode": "decode", "colocated": "engine"}


@dataclass(frozen=True)
class EnginePorts:
    """One engine of a node: its service name, what its KV mode implies for it (``kv``) and
    the ports numbered from that (None or empty: it listens on no such port)."""

    index: int
    name: str
    role: str
    kv: kvmodes.EngineKv
    http: int
    kv_events_replay: int | None = None
    nixl_side_channel: int | None = None
    # lmcache-pd decoders: LMCache's receiver, one init and one alloc port per TP rank
    lmcache_pd_init: tuple[int, ...] = ()
    lmcache_pd_alloc: tuple[int, ...] = ()


@dataclass(frozen=True)
class LmcachePorts:
    """The node's LMCache MP server: its ZMQ port and the /metrics gate (pdstack.sidecars;
    LMCache's own API is on a unix socket)."""

    zmq: int
    http: int


@dataclass(frozen=True)
class ProxyPorts:
    """The proxy's node: its HTTP port and what listens beside it (None: not in this stack)."""

    http: int
    kv_events: int | None = None
    lmcache_pd_notify: int | None = None
    prometheus: int | None = None
    grafana: int | None = None


@dataclass(frozen=True)
class NodePorts:
    """Every port of one node, numbered once (:func:`node_ports`)."""

    engines: tuple[EnginePorts, ...]
    lmcache: LmcachePorts | None = None  # None: the node runs no LMCache server
    proxy: ProxyPorts | None = None  # None: the proxy runs elsewhere

    def labelled(self) -> dict[str, int]:
        """Owner label -> port (``prefill-0 http``, ``lmcache zmq``, ``proxy http`` ...)."""
        ports: dict[str, int] = {}
        for e in self.engines:
            ports[f"{e.name} http"] = e.http
            if e.kv_events_replay is not None:
                ports[f"{e.name} kv events replay"] = e.kv_events_replay
            if e.nixl_side_channel is not None:
                ports[f"{e.name} nixl side channel"] = e.nixl_side_channel
            pairs = list(zip(e.lmcache_pd_init, e.lmcache_pd_alloc, strict=True))
            for rank, (ip, ap) in enumerate(pairs):
                suffix = f" rank {rank}" if len(pairs) > 1 else ""
                ports[f"{e.name} lmcache-pd init{suffix}"] = ip
                ports[f"{e.name} lmcache-pd alloc{suffix}"] = ap
        if self.lmcache is not None:
            ports["lmcache zmq"] = self.lmcache.zmq
            ports["lmcache http"] = self.lmcache.http
        if self.proxy is not None:
            p = self.proxy
            named = {"proxy http": p.http, "proxy kv events": p.kv_events,
                     "proxy lmcache-pd notify": p.lmcache_pd_notify,
                     "prometheus http": p.prometheus, "grafana http": p.grafana}
            ports |= {label: port for label, port in named.items() if port is not None}
        return ports


def node_ports(topo: Topology, node: NodeSpec, mode: kvmodes.KvMode) -> NodePorts:
    """The one place ports are numbered: engine i gets base + i on its node; what each
    engine needs comes from ``mode``, the deployment's KV mode."""
    d = topo.deployment
    partners = cross_node_roles(topo.nodes, node)
    engines = tuple(
        _engine_ports(d, node, i, name, mode.engine(eng.role, eng.role in partners))
        for i, (eng, name) in enumerate(zip(node.engines, engine_names(node), strict=True))
    )
    lmcache = None
    if mode.runs_lmcache_server(e.role for e in node.engines):
        lmcache = LmcachePorts(zmq=d.ports.lmcache_zmq, http=d.ports.lmcache_http)
    proxy = None
    if node.proxy:
        proxy = ProxyPorts(
            http=d.ports.proxy,
            kv_events=d.ports.kv_events if d.kv_events else None,
            lmcache_pd_notify=lmcache_pd_notify_port(d) if mode.lmcache_push else None,
            prometheus=d.observability.prometheus_port if d.monitoring else None,
            grafana=d.observability.grafana_port if d.monitoring else None,
        )
    return NodePorts(engines=engines, lmcache=lmcache, proxy=proxy)


def _engine_ports(
    d: DeploymentSpec, node: NodeSpec, index: int, name: str, kv: kvmodes.EngineKv
) -> EnginePorts:
    init: tuple[int, ...] = ()
    alloc: tuple[int, ...] = ()
    if kv.receives_push:
        init, alloc = lmcache_pd_receiver_ports(d, node, index)
    return EnginePorts(
        index=index,
        name=name,
        role=node.engines[index].role,
        kv=kv,
        http=d.ports.engine_http_base + index,
        kv_events_replay=d.ports.kv_events_replay_base + index if d.kv_events else None,
        nixl_side_channel=d.ports.nixl_side_channel_base + index if kv.nixl else None,
        lmcache_pd_init=init,
        lmcache_pd_alloc=alloc,
    )


def make_node_ports(topo: Topology, node: NodeSpec) -> dict[str, int]:
    """A node's ports by owner label (:meth:`NodePorts.labelled`): what validation checks
    for collisions."""
    return node_ports(topo, node, kvmodes.get(topo.deployment.kv_mode)).labelled()


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
    d: DeploymentSpec, node: NodeSpec, index: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(init ports, alloc ports) of engine ``index`` on ``node``, one per TP rank.

    Every engine before it on the node reserves a block of ``2 * tp`` ports from
    ``lmcache_pd_base``; inside its block rank r gets init ``start + 2r`` and alloc
    ``start + 2r + 1``.  With TP 1 everywhere this is ``base + 2i`` / ``base + 2i + 1``."""
    start = d.ports.lmcache_pd_base + 2 * sum(engine_tp(d, e) for e in node.engines[:index])
    tp = engine_tp(d, node.engines[index])
    return tuple(start + 2 * r for r in range(tp)), tuple(start + 2 * r + 1 for r in range(tp))


def engine_names(node: NodeSpec) -> list[str]:
    """The service name of each engine on the node, in order: ``prefill-0``, ``decode-1``,
    ``engine-0`` (colocated)."""
    counters: dict[str, int] = {}
    names = []
    for eng in node.engines:
        names.append(f"{ROLE_SHORT[eng.role]}-{counters.setdefault(eng.role, 0)}")
        counters[eng.role] += 1
    return names


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
