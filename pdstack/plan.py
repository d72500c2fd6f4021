"""The planner: topology -> per-node services, the proxy's backend table, network edges.

Pure functions, no I/O.  Everything downstream (renderer, proxy, preflight, Ansible,
launch, upgrade) reads the :class:`Plan`, never the raw inventory.
"""

from __future__ import annotations

import itertools
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from pdstack import kvmodes, naming, secrets, sidecars
from pdstack.ports import (
    engine_names,
    engine_tp,
    kv_events_replay_port,
    lmcache_pd_notify_port,
    lmcache_pd_receiver_ports,
    make_node_ports,
    zmq_tcp,
)
from pdstack.ports import has_lmcache_server as _has_lmcache_server
from pdstack.ports import lmcache_push as _push
from pdstack.ports import uses_nixl as _uses_nixl
from pdstack.topology import (
    DeploymentSpec,
    NodeSpec,
    TenantSpec,
    Topology,
    native_tier_sizes,
)

KvPath = Literal["shared-l1", "nixl", "lmcache-pd"]
ServiceKind = Literal["engine", "lmcache", "proxy"]
# vLLM's NIXL connector on CPU (NixlBaseConnectorWorker.__init__) moves each worker's main
# thread to the last core of every NUMA node it finds under this directory, so all NIXL
# engines of a node share that one core whatever their cpu_threads_bind.  A prefiller holding
# KV steps in a sched_yield busy loop; in its own container (cgroup) it starved the decoder's
# main thread on that core until its 30 s KV lease ran out: every P->D handoff in the lab took
# ~31 s, 0.05-0.7 s with this directory hidden (engines keep the cores they are bound to).
NUMA_SYSFS_MASK = "/sys/devices/system/node:ro,size=4k"


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class SshTarget(_Model):
    host: str
    user: str
    port: int
    key_file: str | None = None
    common_args: str | None = None
    connection: str = "ssh"  # "local": the node is this machine (no SSH)
    python: str | None = None  # the node's interpreter for the probe (None: python3)


class Service(_Model):
    name: str
    kind: ServiceKind
    role: str | None = None
    node: str
    image: str
    command: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    ports: dict[str, int] = Field(default_factory=dict)
    gpu_ids: list[int] = Field(default_factory=list)
    bind_address: str
    generation: str | None = None
    kv_transfer_config: dict | None = None
    healthcheck_url: str | None = None
    depends_on: list[str] = Field(default_factory=list)
    # container paths mounted as an empty tmpfs (read-only) over what the image sees
    tmpfs: list[str] = Field(default_factory=list)
    # the secrets it reads (pdstack.secrets.SERVICE_SECRETS) and the env file that holds
    # them on the node; none: it is given no secret at all
    secrets: list[str] = Field(default_factory=list)
    secrets_file: str | None = None


class NodePlan(_Model):
    name: str
    private_address: str
    ssh: SshTarget
    mtu: int
    rdma: bool
    gpu_count: int
    services: list[Service]
    # every secrets env file of the node's services (Grafana's too, on the proxy's node):
    # path -> the secrets it holds, which Ansible copies there from the node's secrets file
    secret_files: dict[str, list[str]] = Field(default_factory=dict)

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)


class LmcachePdReceiver(_Model):
    """Where an lmcache-pd decoder receives pushed KV: LMCache's ``disagg_spec`` receiver
    (one init and one alloc port per TP rank, rank order)."""

    host: str
    init_ports: list[int]
    alloc_ports: list[int]


class LmcachePdNotify(_Model):
    """Where the proxy's ZMQ PULL socket listens for LMCache's ``ProxyNotif`` pushes."""

    host: str
    port: int


def _drop_none(data: dict, *keys: str) -> dict:
    for key in keys:
        if key in data and data[key] is None:
            del data[key]
    return data


class KvEventsSource(_Model):
    """One engine's vLLM KV events: the ZMQ topic its batches carry (the backend's name)
    and its replay endpoint (a ROUTER on its private address)."""

    topic: str
    replay: str


class KvEventsListen(_Model):
    """Where the proxy's ZMQ SUB binds for every engine's KV events (their PUBs connect
    to it), and the ``PYTHONHASHSEED`` the engines hash blocks with (vLLM's NONE_HASH)."""

    host: str
    port: int
    hash_seed: str


class Backend(_Model):
    name: str
    role: str
    node: str
    url: str
    generation: str = ""
    # lmcache-pd decoders only (omitted from the JSON otherwise)
    lmcache_pd: LmcachePdReceiver | None = None
    kv_events: KvEventsSource | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict:
        return _drop_none(handler(self), "lmcache_pd", "kv_events")


class Pairing(_Model):
    prefill: str
    decode: str
    kv_path: KvPath


class BackendTable(_Model):
    kv_mode: str
    served_model_name: str
    backends: list[Backend]
    pairings: list[Pairing] = Field(default_factory=list)
    skip_prefill_threshold_tokens: int = 0
    # lmcache-pd only (omitted from the JSON otherwise)
    lmcache_pd_notify: LmcachePdNotify | None = None
    # pdstack_tenants: the proxy's per-tenant weights and limits (omitted when none)
    tenants: dict[str, TenantSpec] = Field(default_factory=dict)
    # every engine runs vLLM's --scheduling-policy priority: the proxy sets each request's
    # ``priority`` from its tenant's class (:func:`engine_priority`; omitted when false)
    engine_priority: bool = False
    # every engine's KV events go there (omitted when none publish)
    kv_events: KvEventsListen | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict:
        data = _drop_none(handler(self), "lmcache_pd_notify", "kv_events")
        if not data.get("tenants"):
            data.pop("tenants", None)
        if not data.get("engine_priority"):
            data.pop("engine_priority", None)
        return data

    @classmethod
    def adhoc(
        cls,
        prefill_urls: list[str],
        decode_urls: list[str],
        kv_mode: str,
        served_model_name: str = "",
    ) -> BackendTable:
        """Every prefiller pairs with every decoder, all on node ``local`` (for flags)."""
        mode = kvmodes.get(kv_mode)
        if not mode.disaggregated:
            backends = [
                Backend(name=f"local/engine-{i}", role="colocated", node="local", url=u)
                for i, u in enumerate([*prefill_urls, *decode_urls])
            ]
            return cls(kv_mode=kv_mode, served_model_name=served_model_name, backends=backends)
        pre = [
            Backend(name=f"local/prefill-{i}", role="prefill", node="local", url=u)
            for i, u in enumerate(prefill_urls)
        ]
        dec = [
            Backend(name=f"local/decode-{i}", role="decode", node="local", url=u)
            for i, u in enumerate(decode_urls)
        ]
        # every backend is on node "local": the mode's same-node path joins each pair
        path = mode.kv_path(same_node=True)
        pairs = [
            Pairing(prefill=p.name, decode=d.name, kv_path=path)  # type: ignore[arg-type]
            for p in pre
            for d in dec
        ]
        return cls(
            kv_mode=kv_mode,
            served_model_name=served_model_name,
            backends=[*pre, *dec],
            pairings=pairs,
        )


class Edge(_Model):
    src_node: str
    dst_node: str
    dst_address: str
    port: int
    purpose: str
    protocol: Literal["tcp"] = "tcp"


class Plan(_Model):
    deployment: str
    kv_mode: str
    profile: str
    kv_tier: str = kvmodes.NONE
    nodes: dict[str, NodePlan]
    backend_table: BackendTable
    edges: list[Edge]


def generation_of(d: DeploymentSpec) -> str:
    return naming.generation(d.model.revision, d.engine_image)


def model_path(d: DeploymentSpec) -> str:
    """The model argument of ``vllm serve``: ``{revision}`` in the name is filled in, so a
    local model tree can hold one folder per revision (``/models/tiny/{revision}``)."""
    return d.model.name.replace("{revision}", d.model.revision)


# --------------------------------------------------------------------------- connectors

# vLLM hashes a prompt's first block with NONE_HASH, derived from PYTHONHASHSEED: vLLM 0.26
# draws it at random when the variable is unset (vllm/v1/core/kv_cache_utils.py
# init_none_hash), so no other process could compute the engine's block hashes. Every engine
# gets this seed; the proxy hashes requests with it (pdstack.proxy.kv_index).
KV_EVENTS_HASH_SEED = "0"


def kv_events_config(topo: Topology, node: NodeSpec, index: int, proxy_addr: str) -> dict:
    """An engine's ``--kv-events-config``: its PUB *connects* to the proxy's SUB (vLLM 0.26
    and 0.32 bind a PUB endpoint only for ``*``, ``::`` or ipc, i.e. every interface, and
    connect to any other), topic = its backend name; replays are answered by a ROUTER bound
    on its private address (both versions bind the replay endpoint as given)."""
    d = topo.deployment
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": zmq_tcp(proxy_addr, d.ports.kv_events),
        "replay_endpoint": zmq_tcp(node.private_address, kv_events_replay_port(d, index)),
        "topic": f"{node.name}/{engine_names(node)[index]}",
    }



def native_tier_connector(size_gb: float, store_threshold: int | None = None) -> dict:
    """vLLM's native CPU tier as a connector: what ``vllm serve --kv-offloading-size GB``
    (backend ``native``) sets up itself (vLLM 0.26 ``VllmConfig._post_init_kv_transfer_config``);
    written out so that it composes with NIXL in a MultiConnector (the flag would replace it).
    ``store_threshold`` (``pdstack_kv_tier_store_threshold``): lookups before a block is
    stored (vLLM 0.26 ``vllm/v1/kv_offload/cpu/spec.py``); None leaves vLLM's default."""
    extra: dict[str, int] = {"cpu_bytes_to_use": int(size_gb * 2**30)}
    if store_threshold is not None:
        extra["store_threshold"] = store_threshold
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


# The LMCache MP client's budgets on the cpu profile (LMCache >= 0.5.6, where the fault tests
# run them: tests/e2e/test_compose_cpu.py heal). LMCache's defaults are a 300 s mq_timeout and
# a 10 s heartbeat: a lookup whose reply was lost with a killed server leaves its request
# "deferred" for 300 s (the engine takes no new work meanwhile: the wedged decoder of issue 27).
# The cpu profile moves KV "engine_driven": each store and each retrieve is two blocking RPCs
# (PREPARE + COMMIT, lmcache/v1/multiprocess/transfer_context/{pickle,shm}.py) inside the
# engine's step, each waiting up to mq_timeout, until the heartbeat (ping every interval, the
# same timeout) has seen the server go: with 5 s / 2 s a killed server froze every engine's
# steps for 8-16 s (issue 38: requests waited that long for a first token, and the proxy
# flagged a healthy prefiller wedged). With 1 s / 1 s a store to a dead server costs <= 2 s and
# the outage is seen within 2 s: the longest first-token waits were 4.2-4.6 s (four runs), 3.6,
# 3.2 and 4.5 s (three more), once 7.0 s (a fresh-clone .ci/run); a lost lookup is a cache miss
# after 1 s, and the client re-registers its KV caches when the server is back. A reply slower
# than 1 s (a busy LMCache) is a cache miss, never an error. 0.5 s / 0.5 s was tried (issue 38):
# waits 2.5 / 2.5 / 1.8 s, but in 1 of 3 runs a decoder's EngineCore died under the loaded
# machine (one request answered 500), so the budgets stay at 1 s. The gpu profile keeps
# LMCache's defaults: its transfers are asynchronous ("lmcache_driven"), not yet measured with
# the pinned 0.5.3.
LMCACHE_MP_CPU_BUDGETS = {"lmcache.mp.mq_timeout": 1.0, "lmcache.mp.heartbeat_interval": 1.0}


def kv_transfer_config(
    topo: Topology, node: NodeSpec, role: str, lmcache_address: str,
    tier_gb: float | None = None,
) -> dict | None:
    """The exact ``--kv-transfer-config`` of one engine (``tier_gb``: its native tier)."""
    d = topo.deployment
    mode = kvmodes.get(d.kv_mode)
    nixl_role = "kv_producer" if role == "prefill" else "kv_consumer"
    if mode.lmcache_push:
        # LMCache's legacy push; its settings travel as LMCACHE_* env (_lmcache_pd_env)
        return {
            "kv_connector": "LMCacheConnectorV1",
            "kv_role": nixl_role,
            "kv_connector_extra_config": {"discard_partial_chunks": False},
        }
    cpu = d.profile == "cpu"
    nixl: dict = {"kv_connector": "NixlConnector", "kv_role": nixl_role}
    if cpu:
        nixl["kv_buffer_device"] = "cpu"
    lmc_mp = {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": f"tcp://{lmcache_address}",
            "lmcache.mp.port": d.ports.lmcache_zmq,
            **(LMCACHE_MP_CPU_BUDGETS if cpu else {}),
        },
    }
    connectors = []
    if _uses_nixl(topo, node, role):
        connectors.append(nixl)
    if mode.uses_tier(role):
        connectors.append(lmc_mp)
    if tier_gb and kvmodes.native_tier_role(d.tier, role):
        connectors.append(native_tier_connector(tier_gb, d.kv_tier_store_threshold))
    if not connectors:
        return None
    config = connectors[0] if len(connectors) == 1 else {
        "kv_connector": "MultiConnector",
        # LMCache's P/D recipe names the NIXL side's role at the top; shared-l1+nixl keeps
        # kv_both (its same-node pairs hand off through the store)
        "kv_role": nixl_role if mode.same_node_path == kvmodes.NIXL else "kv_both",
        "kv_connector_extra_config": {"connectors": connectors},
    }
    if mode.load_failure_policy is not None:
        # a top-level KVTransferConfig field: only the scheduler reads it (vLLM 0.26)
        config = {**config, "kv_load_failure_policy": mode.load_failure_policy}
    return config


def _lmcache_pd_env(topo: Topology, node: NodeSpec, index: int, proxy_addr: str) -> dict[str, str]:
    """LMCache's PD settings (``LMCACHE_<KEY>`` = config key ``<key>``, LMCache 0.5.x
    ``lmcache/v1/config.py``); per-rank port lists are comma-separated (its
    ``_to_int_list`` env converter), indexed by the engine's TP rank."""
    d = topo.deployment
    role = node.engines[index].role
    buf = int(d.lmcache.pd_buffer_size_gb * 2**30)
    env = {
        # LMCache hashes token chunks with Python's hash(): prefiller and decoder must agree
        # ("P/D Disaggregation detected but PYTHONHASHSEED not set ... incorrect KV cache
        # transfer", LMCache 0.5.6 token_database.py)
        "PYTHONHASHSEED": "0",
        "LMCACHE_ENABLE_PD": "True",
        "LMCACHE_TRANSFER_CHANNEL": "nixl",
        "LMCACHE_LOCAL_CPU": "False",
        "LMCACHE_SAVE_UNFULL_CHUNK": "True",  # PD needs it (LMCache forces it, with a warning)
        "LMCACHE_CHUNK_SIZE": str(d.lmcache.chunk_size),
        "LMCACHE_PD_BUFFER_SIZE": str(buf),
        "LMCACHE_PD_BUFFER_DEVICE": "cpu" if d.profile == "cpu" else "cuda",
    }
    if role == "prefill":
        env |= {"LMCACHE_PD_ROLE": "sender", "LMCACHE_PD_PROXY_HOST": proxy_addr,
                "LMCACHE_PD_PROXY_PORT": str(lmcache_pd_notify_port(d))}
    else:
        init, alloc = lmcache_pd_receiver_ports(topo, node, index)
        env |= {
            "LMCACHE_PD_ROLE": "receiver",
            "LMCACHE_PD_PEER_HOST": node.private_address,
            "LMCACHE_PD_PEER_INIT_PORT": ",".join(map(str, init)),
            "LMCACHE_PD_PEER_ALLOC_PORT": ",".join(map(str, alloc)),
        }
    return env


# --------------------------------------------------------------------------- services


def _engine_env(
    topo: Topology, node: NodeSpec, index: int, name: str, proxy_addr: str
) -> tuple[dict[str, str], list[str]]:
    """An engine's environment (no secrets: :mod:`pdstack.secrets`) and its tmpfs mounts."""
    d = topo.deployment
    eng = node.engines[index]
    ports = make_node_ports(topo, node)
    env = {"VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false"}
    if d.kv_events:
        env["PYTHONHASHSEED"] = KV_EVENTS_HASH_SEED
    if f"{name} nixl side channel" in ports:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = node.private_address
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(ports[f"{name} nixl side channel"])
        if d.profile == "gpu":
            # UCX turns cuda_ipc GET off on GPUs without active NVLinks, and NIXL pulls
            # (READ): same-host KV then went over TCP, 63-83 MB/s (results/h200x1 run 1);
            # forced on: ~1 GB/s, TTFT P50 16.4 s -> 151 ms at 8 req/s (run 2)
            env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "y"
    tmpfs: list[str] = []
    if d.profile == "cpu":
        env["VLLM_CPU_OMP_THREADS_BIND"] = eng.cpu_threads_bind
        env["NIXL_PTHR_DELAY_US"] = "1000"
        if "VLLM_NIXL_SIDE_CHANNEL_PORT" in env:
            tmpfs.append(NUMA_SYSFS_MASK)
    if _push(d):
        env |= _lmcache_pd_env(topo, node, index, proxy_addr)
    if d.observability.otlp_traces_endpoint:
        # the endpoint is OTLP/HTTP (vLLM's exporter defaults to gRPC)
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    return env, tmpfs


def _engine_service(
    topo: Topology, node: NodeSpec, index: int, name: str, proxy_addr: str
) -> Service:
    d = topo.deployment
    eng = node.engines[index]
    ports = make_node_ports(topo, node)
    http = ports[f"{name} http"]
    m = d.model
    cmd = [
        "vllm", "serve", model_path(d),
        "--served-model-name", m.served_name,
        "--host", node.private_address,
        "--port", str(http),
        "--max-model-len", str(m.max_model_len),
        "--dtype", m.dtype,
        "--load-format", m.load_format,
        # usage.prompt_tokens_details.cached_tokens: the proxy tells clients the prefill
        # leg's prefix-cache hit (pdstack.proxy.app); VLLM_API_KEY, when the node's
        # secrets file sets it, makes vLLM refuse requests without it (never in argv)
        "--enable-prompt-tokens-details",
        # GET /load: the API server's requests in flight, which the engine watchdog counts
        # as held (pdstack.sidecars): the scheduler's gauges freeze with a stopped core
        "--enable-server-load-tracking",
    ]
    if d.kv_events:  # every block stored and evicted (GPU, and the native tier's medium
        # CPU), to the proxy's index (pdstack.proxy.kv_events)
        cmd += ["--kv-events-config",
                json.dumps(kv_events_config(topo, node, index, proxy_addr), separators=(",", ":"))]
    if "{revision}" not in m.name and not m.name.startswith("/"):
        cmd += ["--revision", m.revision]
    if d.profile == "gpu":
        cmd += ["--tensor-parallel-size", str(engine_tp(d, eng))]
    if m.quantization:
        cmd += ["--quantization", m.quantization]
    if m.skip_tokenizer_init:
        cmd += ["--skip-tokenizer-init"]
    if m.trust_remote_code:
        cmd += ["--trust-remote-code"]
    if eng.kv_cache_bytes:
        cmd += ["--kv-cache-memory-bytes", str(eng.kv_cache_bytes)]
    tier_gb = native_tier_sizes(d, node).get(index)
    ktc = kv_transfer_config(topo, node, eng.role, node.private_address, tier_gb)
    if ktc is not None:
        cmd += ["--kv-transfer-config", json.dumps(ktc, separators=(",", ":"))]
    if d.observability.otlp_traces_endpoint:
        cmd += ["--otlp-traces-endpoint", d.observability.otlp_traces_endpoint]
    cmd += [*m.extra_args, *eng.extra_args]

    env, tmpfs = _engine_env(topo, node, index, name, proxy_addr)
    service_ports = {"http": http}
    if d.kv_events:
        service_ports["kv_events_replay"] = kv_events_replay_port(d, index)
    if "VLLM_NIXL_SIDE_CHANNEL_PORT" in env:
        service_ports["nixl_side_channel"] = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    return Service(
        name=name,
        kind="engine",
        role=eng.role,
        node=node.name,
        image=d.engine_image,
        command=cmd,
        env=env,
        ports=service_ports,
        gpu_ids=list(eng.gpus),
        bind_address=node.private_address,
        generation=generation_of(d),
        kv_transfer_config=ktc,
        healthcheck_url=f"http://{node.private_address}:{http}/health",
        depends_on=["lmcache"] if kvmodes.get(d.kv_mode).uses_tier(eng.role) else [],
        tmpfs=tmpfs,
    )


def _lmcache_service(d: DeploymentSpec, node: NodeSpec) -> Service:
    lm = d.lmcache
    mode = kvmodes.get(d.kv_mode)
    server = [
        "server",
        "--host", node.private_address,
        "--port", str(d.ports.lmcache_zmq),
        "--l1-size-gb", str(lm.l1_size_gb),
        "--eviction-policy", lm.eviction_policy,
        "--chunk-size", str(lm.chunk_size),
        "--supported-transfer-mode", "engine_driven" if d.profile == "cpu" else "auto",
        # LMCache's deployment guide: one STORE/RETRIEVE worker per engine sharing the server
        # (each engine is bound to one worker thread; default 1)
        "--max-gpu-workers", str(max(1, sum(mode.uses_tier(e.role) for e in node.engines))),
    ]
    # its HTTP API (/run_script, /cache/clear, /env ... unauthenticated) on a unix socket
    # only the metrics gate shares, never on a port (pdstack.sidecars.lmcache_socket);
    # the gate serves GET /metrics of it on lmcache_http
    cmd = sidecars.lmcache_on_socket_command(sidecars.LMCACHE_API_SOCKET, server)
    return Service(
        name="lmcache",
        kind="lmcache",
        node=node.name,
        image=lm.image or d.engine_image,
        command=cmd,
        # no secrets: it uses none (the rendered service has no env_file either)
        env={"LMCACHE_TRACK_USAGE": "false"},
        ports={"zmq": d.ports.lmcache_zmq, "metrics": d.ports.lmcache_http},
        # the engines hand it KV over CUDA IPC: it must see every GPU they use
        gpu_ids=sorted({g for eng in node.engines for g in eng.gpus}),
        bind_address=node.private_address,
        healthcheck_url=f"tcp://{node.private_address}:{d.ports.lmcache_zmq}",
    )


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


def _proxy_service(topo: Topology, node: NodeSpec) -> Service:
    d = topo.deployment
    bind = d.proxy_bind_address or node.private_address
    cmd = [
        "pdstack", "proxy",
        "--backends", "/etc/pdstack/backends.json",
        "--host", bind,
        "--port", str(d.ports.proxy),
    ]
    if d.admission != "off":
        cmd += ["--admission", d.admission]
        cap = admission_max_running(topo)
        if cap:
            cmd += ["--admission-max-running", str(cap)]
        cmd += ["--admission-ttft-slo", f"{d.ttft_slo:g}"]
    ports = {"http": d.ports.proxy}
    if d.kv_events:
        ports["kv_events"] = d.ports.kv_events
    if _push(d):
        ports["lmcache_pd_notify"] = lmcache_pd_notify_port(d)
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
        ports=ports,
        bind_address=bind,
        healthcheck_url=f"http://{bind}:{d.ports.proxy}/health",
        depends_on=engine_names(node),
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


def make_plan(topo: Topology) -> Plan:
    d = topo.deployment
    proxy_node = next(n for n in topo.nodes if n.proxy)
    nodes: dict[str, NodePlan] = {}
    backends: list[Backend] = []
    for node in topo.nodes:
        services: list[Service] = []
        if _has_lmcache_server(d, node):
            services.append(_lmcache_service(d, node))
        for i, name in enumerate(engine_names(node)):
            svc = _engine_service(topo, node, i, name, proxy_node.private_address)
            services.append(svc)
            receiver = None
            if _push(d) and svc.role == "decode":
                init, alloc = lmcache_pd_receiver_ports(topo, node, i)
                receiver = LmcachePdReceiver(
                    host=node.private_address, init_ports=init, alloc_ports=alloc
                )
            backends.append(
                Backend(
                    name=f"{node.name}/{name}",
                    role=svc.role or "colocated",
                    node=node.name,
                    url=f"http://{node.private_address}:{svc.ports['http']}",
                    generation=svc.generation or "",
                    lmcache_pd=receiver,
                    kv_events=KvEventsSource(
                        topic=f"{node.name}/{name}",
                        replay=zmq_tcp(node.private_address, svc.ports["kv_events_replay"]),
                    ) if d.kv_events else None,
                )
            )
        if node.proxy:
            services.append(_proxy_service(topo, node))
        services = [_with_secrets(s) for s in services]
        nodes[node.name] = NodePlan(
            name=node.name,
            private_address=node.private_address,
            ssh=SshTarget(**topo.node(node.name).ssh.model_dump()),
            mtu=node.mtu,
            rdma=node.rdma,
            gpu_count=node.gpu_count,
            services=services,
            secret_files=_secret_files(services),
        )

    pairings: list[Pairing] = []
    mode = kvmodes.get(d.kv_mode)
    for p in (b for b in backends if b.role == "prefill"):
        for dec in (b for b in backends if b.role == "decode"):
            path = mode.kv_path(same_node=p.node == dec.node)
            if path is None:
                continue  # e.g. shared-l1 across nodes; validation guarantees a same-node one
            pairings.append(
                Pairing(prefill=p.name, decode=dec.name, kv_path=path)  # type: ignore[arg-type]
            )

    table = BackendTable(
        kv_mode=d.kv_mode,
        served_model_name=d.model.served_name,
        backends=backends,
        pairings=pairings,
        skip_prefill_threshold_tokens=d.skip_prefill_threshold_tokens,
        lmcache_pd_notify=(
            LmcachePdNotify(host=proxy_node.private_address, port=lmcache_pd_notify_port(d))
            if _push(d)
            else None
        ),
        tenants=topo.tenants,
        engine_priority=engine_priority(topo),
        kv_events=KvEventsListen(
            host=proxy_node.private_address, port=d.ports.kv_events,
            hash_seed=KV_EVENTS_HASH_SEED,
        ) if d.kv_events else None,
    )
    return Plan(
        deployment=d.name,
        kv_mode=d.kv_mode,
        profile=d.profile,
        kv_tier=d.tier,
        nodes=nodes,
        backend_table=table,
        edges=_edges(topo, nodes, pairings, proxy_node.name, backends),
    )


def _edges(
    topo: Topology,
    nodes: dict[str, NodePlan],
    pairings: list[Pairing],
    proxy_node: str,
    backends: list[Backend],
) -> list[Edge]:
    """Every src->dst:port the stack uses (deduplicated, stable order)."""
    out: dict[tuple, Edge] = {}

    def add(src: str, dst: str, port: int, purpose: str) -> None:
        e = Edge(src_node=src, dst_node=dst, dst_address=nodes[dst].private_address,
                 port=port, purpose=purpose)
        out.setdefault((src, dst, port), e)

    for node in nodes.values():
        for svc in node.services:
            if svc.kind == "engine":
                add(proxy_node, node.name, svc.ports["http"], f"proxy->{svc.name} http")
                # its KV events: PUB -> the proxy's SUB, and the proxy's replay requests
                if "kv_events_replay" in svc.ports:
                    add(node.name, proxy_node, topo.deployment.ports.kv_events,
                        f"{svc.name}->proxy kv events")
                    add(proxy_node, node.name, svc.ports["kv_events_replay"],
                        f"proxy->{svc.name} kv events replay")
                if svc.depends_on:
                    add(node.name, node.name, topo.deployment.ports.lmcache_zmq,
                        f"{svc.name}->lmcache zmq")
            if svc.kind == "lmcache":
                add(proxy_node, node.name, svc.ports["metrics"], "proxy->lmcache metrics")
    by_name = {f"{n.name}/{s.name}": s for n in nodes.values() for s in n.services}
    receivers = {b.name: b.lmcache_pd for b in backends}
    for pair in pairings:
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
            add(p.node, proxy_node, lmcache_pd_notify_port(topo.deployment), "lmcache-pd notify")
    return list(out.values())
