"""A node's engine services in the plan, and the LMCache MP server they share: each
engine's ``vllm serve`` command, its kv-transfer-config (written from what the KV mode
implies for it, :class:`pdstack.kvmodes.EngineKv`, carried on its
:class:`pdstack.ports.EnginePorts`), its environment and mounts. Pure, no I/O."""

from __future__ import annotations

import json

from pdstack import naming, sidecars
from pdstack.plan_types import Service, named_ports
from pdstack.ports import (
    EnginePorts,
    LmcachePorts,
    engine_tp,
    lmcache_pd_notify_port,
    zmq_tcp,
)
from pdstack.specs import DeploymentSpec, NodeSpec

# vLLM's NIXL connector on CPU (NixlBaseConnectorWorker.__init__) moves each worker's main
# thread to the last core of every NUMA node it finds under this directory, so all NIXL
# engines of a node share that one core whatever their cpu_threads_bind.  A prefiller holding
# KV steps in a sched_yield busy loop; in its own container (cgroup) it starved the decoder's
# main thread on that core until its 30 s KV lease ran out: every P->D handoff in the lab took
# ~31 s, 0.05-0.7 s with this directory hidden (engines keep the cores they are bound to).
NUMA_SYSFS_MASK = "/sys/devices/system/node:ro,size=4k"

# A CPU engine's model runs inside its engine core (vLLM's "uni" executor; the environment
# variable is what makes vLLM's CPU platform take it): without both, vLLM CPU starts a third
# process for the one worker, which imports vLLM again: 5 s of every start on an idle core
# (host-native, tiny model: ready in 21-22 s vs 16-17 s, two runs each, greedy tokens
# identical), one process's memory fewer. The API server stays its own process (AsyncLLM).
# GPU engines already run one worker in the engine core at tensor-parallel size 1.
CPU_ENGINE_ONE_PROCESS_ARGS = ("--distributed-executor-backend", "uni")
CPU_ENGINE_ONE_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# vLLM hashes a prompt's first block with NONE_HASH, derived from PYTHONHASHSEED: vLLM 0.26
# draws it at random when the variable is unset (vllm/v1/core/kv_cache_utils.py
# init_none_hash), so no other process could compute the engine's block hashes. Every engine
# gets this seed; the proxy hashes requests with it (pdstack.proxy.kv_index).
KV_EVENTS_HASH_SEED = "0"

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


def generation_of(d: DeploymentSpec) -> str:
    return naming.generation(d.model.revision, d.engine_image)


def model_path(d: DeploymentSpec) -> str:
    """The model argument of ``vllm serve``: ``{revision}`` in the name is filled in, so a
    local model tree can hold one folder per revision (``/models/tiny/{revision}``)."""
    return d.model.name.replace("{revision}", d.model.revision)


def engine_service(
    d: DeploymentSpec, node: NodeSpec, ep: EnginePorts, proxy_addr: str,
    tier_gb: float | None = None,
) -> Service:
    """Engine ``ep`` of ``node`` (``tier_gb``: its native tier, none when None)."""
    eng = node.engines[ep.index]
    ktc = kv_transfer_config(d, ep, node.private_address, tier_gb)
    env, tmpfs = _engine_env(d, node, ep, proxy_addr)
    ports = named_ports(http=ep.http, kv_events_replay=ep.kv_events_replay,
                        nixl_side_channel=ep.nixl_side_channel)
    return Service(
        name=ep.name,
        kind="engine",
        role=eng.role,
        node=node.name,
        image=d.engine_image,
        command=_serve_command(d, node, ep, proxy_addr, ktc),
        env=env,
        ports=ports,
        gpu_ids=list(eng.gpus),
        bind_address=node.private_address,
        generation=generation_of(d),
        kv_transfer_config=ktc,
        healthcheck_url=f"http://{node.private_address}:{ep.http}/health",
        depends_on=["lmcache"] if ep.kv.lmcache_tier else [],
        tmpfs=tmpfs,
    )


def _serve_command(
    d: DeploymentSpec, node: NodeSpec, ep: EnginePorts, proxy_addr: str, ktc: dict | None
) -> list[str]:
    eng = node.engines[ep.index]
    m = d.model
    cmd = [
        "vllm", "serve", model_path(d),
        "--served-model-name", m.served_name,
        "--host", node.private_address,
        "--port", str(ep.http),
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
                json.dumps(kv_events_config(d, node, ep, proxy_addr), separators=(",", ":"))]
    if "{revision}" not in m.name and not m.name.startswith("/"):
        cmd += ["--revision", m.revision]
    if d.profile == "gpu":
        cmd += ["--tensor-parallel-size", str(engine_tp(d, eng))]
    else:
        cmd += CPU_ENGINE_ONE_PROCESS_ARGS
    if m.quantization:
        cmd += ["--quantization", m.quantization]
    if m.skip_tokenizer_init:
        cmd += ["--skip-tokenizer-init"]
    if m.trust_remote_code:
        cmd += ["--trust-remote-code"]
    if eng.kv_cache_bytes:
        cmd += ["--kv-cache-memory-bytes", str(eng.kv_cache_bytes)]
    if ktc is not None:
        cmd += ["--kv-transfer-config", json.dumps(ktc, separators=(",", ":"))]
    if d.observability.otlp_traces_endpoint:
        cmd += ["--otlp-traces-endpoint", d.observability.otlp_traces_endpoint]
    return [*cmd, *m.extra_args, *eng.extra_args]


def kv_events_config(d: DeploymentSpec, node: NodeSpec, ep: EnginePorts, proxy_addr: str) -> dict:
    """An engine's ``--kv-events-config``: its PUB *connects* to the proxy's SUB (vLLM 0.26
    and 0.32 bind a PUB endpoint only for ``*``, ``::`` or ipc, i.e. every interface, and
    connect to any other), topic = its backend name; replays are answered by a ROUTER bound
    on its private address (both versions bind the replay endpoint as given)."""
    assert ep.kv_events_replay is not None
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": zmq_tcp(proxy_addr, d.ports.kv_events),
        "replay_endpoint": zmq_tcp(node.private_address, ep.kv_events_replay),
        "topic": f"{node.name}/{ep.name}",
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


def kv_transfer_config(
    d: DeploymentSpec, ep: EnginePorts, lmcache_address: str, tier_gb: float | None = None
) -> dict | None:
    """The exact ``--kv-transfer-config`` of one engine: the connectors its KV mode implies
    (``ep.kv``), then its native tier (``tier_gb``); None: it runs none."""
    kv = ep.kv
    if kv.push is not None:
        # LMCache's legacy push; its settings travel as LMCACHE_* env (_lmcache_pd_env)
        return {
            "kv_connector": "LMCacheConnectorV1",
            "kv_role": kv.handoff_role,
            "kv_connector_extra_config": {"discard_partial_chunks": False},
        }
    cpu = d.profile == "cpu"
    connectors = []
    if kv.nixl:
        nixl: dict = {"kv_connector": "NixlConnector", "kv_role": kv.handoff_role}
        if cpu:
            nixl["kv_buffer_device"] = "cpu"
        connectors.append(nixl)
    if kv.lmcache_tier:
        connectors.append({
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": f"tcp://{lmcache_address}",
                "lmcache.mp.port": d.ports.lmcache_zmq,
                **(LMCACHE_MP_CPU_BUDGETS if cpu else {}),
            },
        })
    if tier_gb:
        connectors.append(native_tier_connector(tier_gb, d.kv_tier_store_threshold))
    if not connectors:
        return None
    config = connectors[0] if len(connectors) == 1 else {
        "kv_connector": "MultiConnector",
        "kv_role": kv.multi_role,
        "kv_connector_extra_config": {"connectors": connectors},
    }
    if kv.load_failure_policy is not None:
        # a top-level KVTransferConfig field: only the scheduler reads it (vLLM 0.26)
        config = {**config, "kv_load_failure_policy": kv.load_failure_policy}
    return config


def _engine_env(
    d: DeploymentSpec, node: NodeSpec, ep: EnginePorts, proxy_addr: str
) -> tuple[dict[str, str], list[str]]:
    """An engine's environment (no secrets: :mod:`pdstack.secrets`) and its tmpfs mounts."""
    env = {"VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false"}
    if d.kv_events:
        env["PYTHONHASHSEED"] = KV_EVENTS_HASH_SEED
    if ep.nixl_side_channel is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = node.private_address
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(ep.nixl_side_channel)
        if d.profile == "gpu":
            # UCX turns cuda_ipc GET off on GPUs without active NVLinks, and NIXL pulls
            # (READ): same-host KV then went over TCP, 63-83 MB/s (results/h200x1 run 1);
            # forced on: ~1 GB/s, TTFT P50 16.4 s -> 151 ms at 8 req/s (run 2)
            env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "y"
    tmpfs: list[str] = []
    if d.profile == "cpu":
        env["VLLM_CPU_OMP_THREADS_BIND"] = node.engines[ep.index].cpu_threads_bind
        env["NIXL_PTHR_DELAY_US"] = "1000"
        env |= CPU_ENGINE_ONE_PROCESS_ENV
        if ep.nixl_side_channel is not None:
            tmpfs.append(NUMA_SYSFS_MASK)
    if ep.kv.push is not None:
        env |= _lmcache_pd_env(d, node, ep, proxy_addr)
    if d.observability.otlp_traces_endpoint:
        # the endpoint is OTLP/HTTP (vLLM's exporter defaults to gRPC)
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    return env, tmpfs


def _lmcache_pd_env(
    d: DeploymentSpec, node: NodeSpec, ep: EnginePorts, proxy_addr: str
) -> dict[str, str]:
    """LMCache's PD settings (``LMCACHE_<KEY>`` = config key ``<key>``, LMCache 0.5.x
    ``lmcache/v1/config.py``); per-rank port lists are comma-separated (its
    ``_to_int_list`` env converter), indexed by the engine's TP rank."""
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
    if ep.kv.push == "sender":
        env |= {"LMCACHE_PD_ROLE": "sender", "LMCACHE_PD_PROXY_HOST": proxy_addr,
                "LMCACHE_PD_PROXY_PORT": str(lmcache_pd_notify_port(d))}
    else:
        env |= {
            "LMCACHE_PD_ROLE": "receiver",
            "LMCACHE_PD_PEER_HOST": node.private_address,
            "LMCACHE_PD_PEER_INIT_PORT": ",".join(map(str, ep.lmcache_pd_init)),
            "LMCACHE_PD_PEER_ALLOC_PORT": ",".join(map(str, ep.lmcache_pd_alloc)),
        }
    return env


def lmcache_service(
    d: DeploymentSpec, node: NodeSpec, ports: LmcachePorts, gpu_workers: int
) -> Service:
    """The node's LMCache MP server (``gpu_workers``: the node's engines that use it)."""
    lm = d.lmcache
    server = [
        "server",
        "--host", node.private_address,
        "--port", str(ports.zmq),
        "--l1-size-gb", str(lm.l1_size_gb),
        "--eviction-policy", lm.eviction_policy,
        "--chunk-size", str(lm.chunk_size),
        "--supported-transfer-mode", "engine_driven" if d.profile == "cpu" else "auto",
        # LMCache's deployment guide: one STORE/RETRIEVE worker per engine sharing the server
        # (each engine is bound to one worker thread; default 1)
        "--max-gpu-workers", str(max(1, gpu_workers)),
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
        ports={"zmq": ports.zmq, "metrics": ports.http},
        # the engines hand it KV over CUDA IPC: it must see every GPU they use
        gpu_ids=sorted({g for eng in node.engines for g in eng.gpus}),
        bind_address=node.private_address,
        healthcheck_url=f"tcp://{node.private_address}:{ports.zmq}",
    )
