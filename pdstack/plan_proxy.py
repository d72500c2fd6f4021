"""The proxy in the plan: its service (with the running cap it admits by, from the engines'
flags or vLLM's defaults) and its backend table (every engine, the P/D pairs the KV mode
joins, tenants, where KV events and LMCache's pushes reach it). Pure, no I/O."""

from __future__ import annotations

import itertools

from pdstack import kvmodes
from pdstack.plan_engine import KV_EVENTS_HASH_SEED, generation_of
from pdstack.plan_types import (
    Backend,
    BackendTable,
    KvEventsListen,
    KvEventsSource,
    LmcachePdNotify,
    LmcachePdReceiver,
    Pairing,
    Service,
    named_ports,
)
from pdstack.ports import NodePorts, ProxyPorts, zmq_tcp
from pdstack.proxy.wait_budget import BURST_GROWTH
from pdstack.specs import NodeSpec, Topology


def proxy_service(topo: Topology, node: NodeSpec, ports: ProxyPorts, engines: list[str]) -> Service:
    """The proxy on ``node`` (``engines``: the node's engine services, started first)."""
    d = topo.deployment
    bind = d.proxy_bind_address or node.private_address
    cmd = [
        "pdstack", "proxy",
        "--backends", "/etc/pdstack/backends.json",
        "--host", bind,
        "--port", str(ports.http),
    ]
    if d.admission != "off":
        cmd += ["--admission", d.admission]
        cap = admission_max_running(topo)
        if cap:
            cmd += ["--admission-max-running", str(cap)]
        cmd += ["--admission-ttft-slo", f"{d.ttft_slo:g}"]
        if d.burst_growth != BURST_GROWTH:  # the proxy's own default otherwise
            cmd += ["--admission-burst-growth", f"{d.burst_growth:g}"]
    service_ports = named_ports(http=ports.http, kv_events=ports.kv_events,
                                lmcache_pd_notify=ports.lmcache_pd_notify)
    return Service(
        name="proxy",
        kind="proxy",
        node=node.name,
        image=d.proxy_image,
        command=cmd,
        env=(
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": d.observability.otlp_traces_endpoint}
            if d.observability.otlp_traces_endpoint
            else {}
        ),
        ports=service_ports,
        bind_address=bind,
        healthcheck_url=f"http://{bind}:{ports.http}/health",
        depends_on=engines,
    )


def backend_table(
    topo: Topology, mode: kvmodes.KvMode, ports: dict[str, NodePorts], proxy_node: NodeSpec
) -> BackendTable:
    """What the proxy on ``proxy_node`` reads: its backends, their pairings, tenants and
    where it listens for KV events and LMCache's pushes."""
    d = topo.deployment
    backends = _backends(topo, ports)
    priority = engine_priority(topo)
    pairings = _pairings(mode, backends)
    proxy = ports[proxy_node.name].proxy
    assert proxy is not None
    addr = proxy_node.private_address
    return BackendTable(
        kv_mode=d.kv_mode,
        served_model_name=d.model.served_name,
        backends=backends,
        pairings=pairings,
        skip_prefill_threshold_tokens=d.skip_prefill_threshold_tokens,
        lmcache_pd_notify=(
            LmcachePdNotify(host=addr, port=proxy.lmcache_pd_notify)
            if proxy.lmcache_pd_notify is not None
            else None
        ),
        tenants=topo.tenants,
        engine_priority=priority,
        kv_events=KvEventsListen(
            host=addr, port=proxy.kv_events, hash_seed=KV_EVENTS_HASH_SEED,
        ) if proxy.kv_events is not None else None,
    )


def _backends(topo: Topology, ports: dict[str, NodePorts]) -> list[Backend]:
    """The proxy's backends: every engine, node by node."""
    generation = generation_of(topo.deployment)
    out = []
    for node in topo.nodes:
        addr = node.private_address
        for e in ports[node.name].engines:
            out.append(Backend(
                name=f"{node.name}/{e.name}",
                role=e.role,
                node=node.name,
                url=f"http://{addr}:{e.http}",
                generation=generation,
                standby=node.engines[e.index].standby,
                lmcache_pd=LmcachePdReceiver(
                    host=addr, init_ports=list(e.lmcache_pd_init),
                    alloc_ports=list(e.lmcache_pd_alloc),
                ) if e.kv.receives_push else None,
                kv_events=KvEventsSource(
                    topic=f"{node.name}/{e.name}", replay=zmq_tcp(addr, e.kv_events_replay),
                ) if e.kv_events_replay is not None else None,
            ))
    return out


def _pairings(mode: kvmodes.KvMode, backends: list[Backend]) -> list[Pairing]:
    """Every prefiller with every decoder that the mode joins by a KV path."""
    pairings: list[Pairing] = []
    for p in (b for b in backends if b.role == "prefill"):
        for dec in (b for b in backends if b.role == "decode"):
            path = mode.kv_path(same_node=p.node == dec.node)
            if path is None:
                continue  # e.g. shared-l1 across nodes; validation guarantees a same-node one
            pairings.append(
                Pairing(prefill=p.name, decode=dec.name, kv_path=path)  # type: ignore[arg-type]
            )
    return pairings


# vLLM flags that bound how many requests an engine runs well at once: past
# --max-cudagraph-capture-size every decode step runs outside CUDA graphs (~10x slower:
# the collapses of results/h200x1 run 2, all with > 128 running), past --max-num-seqs
# requests wait inside vLLM where the proxy cannot route them elsewhere
RUNNING_LIMIT_FLAGS = ("--max-cudagraph-capture-size", "--max-num-seqs")
# vLLM 0.26's own defaults when neither flag is given (engine/arg_utils.py
# _set_default_max_num_seqs_and_batched_tokens_args, config/vllm.py): max_num_seqs 1024 on
# GPUs of >= 70 GiB other than the A100, else 256; CUDA graphs captured up to
# min(2 * max_num_seqs, 512) running requests
VLLM_MAX_CAPTURE = 512
VLLM_SEQS_LARGE_GPU = 1024
VLLM_SEQS_OTHER = 256
LARGE_GPU_NAMES = ("H100", "H200", "H20", "GH200", "B100", "B200", "GB200", "B300",
                   "MI300", "MI325", "MI350", "MI355")


def _vllm_default_seqs(gpu_model: str | None) -> int:
    name = (gpu_model or "").upper()
    big = any(g in name for g in LARGE_GPU_NAMES) and "A100" not in name
    return VLLM_SEQS_LARGE_GPU if big else VLLM_SEQS_OTHER


def engine_running_limit(args: list[str], profile: str, gpu_model: str | None) -> int:
    """How many requests one engine runs at once before it slows down or queues: its
    explicit running-limit flags, else (GPUs) vLLM's defaults; 0 (no limit known) on CPU
    without a flag. Unknown GPU models get the smaller default (256)."""
    def explicit(flag: str) -> int | None:
        vals = [int(v) for v in _flag_values(args, flag) if v.isdigit()]
        return vals[-1] if vals else None

    seqs, capture = explicit("--max-num-seqs"), explicit("--max-cudagraph-capture-size")
    if profile != "gpu":
        return min([v for v in (seqs, capture) if v is not None], default=0)
    seqs = seqs or _vllm_default_seqs(gpu_model)
    if "--enforce-eager" in args:
        return seqs
    return min(seqs, capture or min(2 * seqs, VLLM_MAX_CAPTURE))


def admission_max_running(topo: Topology) -> int:
    """The proxy's running cap: the smallest running limit of any gated engine (decoder or
    colocated), from its flags or vLLM's defaults (:func:`engine_running_limit`); 0 (no cap)
    when none is known."""
    d = topo.deployment
    limits = [
        engine_running_limit([*d.model.extra_args, *eng.extra_args], d.profile, node.gpu_model)
        for node in topo.nodes
        for eng in node.engines
        if eng.role != "prefill"
    ]
    return min((v for v in limits if v), default=0)


def engine_priority(topo: Topology) -> bool:
    """Every engine runs vLLM's ``--scheduling-policy priority`` (its last value), so the
    proxy sets each request's ``priority``. With vLLM's default (fcfs) a priority does
    nothing in 0.26 (older versions refuse a non-zero one with a 400): one such engine
    turns it off for all, and a client's own ``priority`` then reaches the engines as sent."""
    d = topo.deployment
    policies = [
        _flag_values([*d.model.extra_args, *eng.extra_args], "--scheduling-policy")
        for node in topo.nodes
        for eng in node.engines
    ]
    return bool(policies) and all(p and p[-1] == "priority" for p in policies)


def _flag_values(args: list[str], flag: str) -> list[str]:
    """The values of ``flag`` in an argv list (``--flag V`` and ``--flag=V``), in order."""
    out = []
    for a, b in itertools.pairwise([*args, ""]):
        if a == flag:
            out.append(b)
        elif a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
    return out
