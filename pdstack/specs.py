"""The topology's types: what an inventory says, as frozen pydantic models, and the
problems found in it.  Read by :mod:`pdstack.topology` (which loads and checks them) and by
:mod:`pdstack.ports` (which numbers a node's ports from them); both import this module
and neither the other for its types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdstack import kvmodes
from pdstack.proxy.wait_budget import BURST_GROWTH, TTFT_SLO_S

# pdstack_ttft_slo_s when unset, by profile: chat on GPUs; a CPU engine's first token takes
# seconds under load: at 2 req/s on 2 busy cores its TTFT P99 is 2.5-3 s, and with 6 s
# (4.5 s on the prediction) a flood of 300 at once is cut to what answers within ~3 s while
# a user arriving after it is answered within 5 s (benchmarks/cpu_faults.py; with 30 s the
# flood was admitted whole and everyone after it waited 8-16 s)
TTFT_SLO_DEFAULTS = {"gpu": TTFT_SLO_S, "cpu": 6.0}
# the proxy's --admission-burst-growth by profile: a CPU engine hardly batches, so a burst is
# not predicted to start faster than the requests it served one at a time (with 2, the first
# flood of 300 a CPU stack met was predicted at 39 first bytes a second and 175 admitted, TTFT
# P99 8.8 s; its floods are served at 14-21: benchmarks/cpu_faults.py)
BURST_GROWTH_DEFAULTS = {"gpu": BURST_GROWTH, "cpu": 1.0}

KvMode = Literal[
    "colocated", "colocated+l1", "lmcache-pd", "nixl", "nixl+l1", "shared-l1", "shared-l1+nixl"
]
KvTier = Literal["none", "native", "lmcache"]
Role = Literal["prefill", "decode", "colocated"]
Profile = Literal["gpu", "cpu"]
NODE_GROUP = "pdstack_nodes"


@dataclass(frozen=True)
class Problem:
    file: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.field}: {self.message}"


class TopologyError(Exception):
    """One or more problems in an inventory; ``str()`` lists one per line."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    """What every engine serves."""

    name: str = Field(description="local path (in the engine container) or Hugging Face id")
    revision: str = "main"
    served_name: str
    dtype: str = "auto"
    quantization: str | None = None
    max_model_len: int = Field(gt=0)
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    kv_bytes_per_token: int | None = Field(
        default=None, gt=0, description="KV size of one token (all layers); sizes receive buffers"
    )
    weight_bytes: int | None = Field(
        default=None, gt=0,
        description="bytes of the weights as loaded (all TP ranks together); with it the "
        "planner checks that the engines sharing a GPU fit in its memory",
    )
    extra_args: list[str] = Field(default_factory=list)


class EngineSpec(_Strict):
    role: Role
    gpus: list[int] = Field(default_factory=list)
    cpu_threads_bind: str = "nobind"
    kv_cache_bytes: int | None = Field(default=None, gt=0)
    # several engines on one GPU (measurement rigs with one GPU): each must fix its KV size
    share_gpu: bool = False
    # this engine's native KV tier in GiB of host RAM (overrides pdstack_kv_tier_size_gb)
    kv_tier_size_gb: float | None = Field(default=None, gt=0)
    extra_args: list[str] = Field(default_factory=list)
    # a warm standby (colocated or decode): planned and started like its role's others, but
    # the proxy routes to it only while an active engine of its role is out of service
    # (pdstack.proxy.standby), so a dead engine's share is back in seconds, not minutes
    standby: bool = False


class SshSpec(_Strict):
    host: str
    user: str = "root"
    port: int = 22
    key_file: str | None = None
    common_args: str | None = None
    connection: Literal["ssh", "paramiko", "local"] = "ssh"  # ansible_connection
    python: str | None = None  # ansible_python_interpreter (a path; "auto*" = find one)


class NodeSpec(_Strict):
    name: str
    private_address: str
    gpu_count: int = Field(ge=0)
    gpu_model: str | None = None
    mtu: int = Field(default=1500, ge=576, le=9216)
    rdma: bool = False
    proxy: bool = False
    host_memory_gb: int | None = Field(default=None, gt=0)
    engines: list[EngineSpec] = Field(default_factory=list)
    ssh: SshSpec


class PortSpec(_Strict):
    proxy: int = Field(default=8000, ge=1, le=65535)
    proxy_metrics_path: str = "/metrics"
    engine_http_base: int = Field(default=8100, ge=1, le=65535)
    nixl_side_channel_base: int = Field(default=5600, ge=1, le=65535)
    lmcache_zmq: int = Field(default=6000, ge=1, le=65535)
    lmcache_http: int = Field(default=6001, ge=1, le=65535)
    lmcache_pd_base: int = Field(default=7300, ge=1, le=65535)
    # vLLM KV events (pdstack.proxy.kv_events): every engine's ZMQ PUB connects to the
    # proxy's SUB on ``kv_events``; engine i of a node answers replays on
    # ``kv_events_replay_base + i``
    kv_events: int = Field(default=5557, ge=1, le=65535)
    kv_events_replay_base: int = Field(default=5500, ge=1, le=65535)


class LmcacheSpec(_Strict):
    image: str | None = None
    l1_size_gb: int = Field(default=20, gt=0)
    chunk_size: int = Field(default=256, gt=0)
    eviction_policy: str = "LRU"
    pd_buffer_size_gb: float = Field(default=4.0, gt=0, description="lmcache-pd receive buffer")


class ObservabilitySpec(_Strict):
    """``pdstack_observability``: the monitoring stack (Compose profile ``monitoring`` on the
    proxy's node, started by Ansible when ``pdstack_monitoring: true``) and tracing."""

    prometheus_port: int = Field(default=9090, ge=1, le=65535)
    grafana_port: int = Field(default=3000, ge=1, le=65535)
    prometheus_image: str = "prom/prometheus:v2.42.0"
    grafana_image: str = "grafana/grafana-oss:11.6.0"
    scrape_interval_s: int = Field(default=15, ge=1, le=300)
    retention: str = Field(default="15d", pattern=r"^[0-9]+[smhdwy]$")
    ttft_p50_slo_ms: float = Field(default=2000.0, gt=0)
    ttft_p99_slo_ms: float = Field(default=3500.0, gt=0)
    # OTLP/HTTP traces endpoint (http://collector:4318/v1/traces); None = no tracing. The
    # proxy exports its spans there and every engine gets ``--otlp-traces-endpoint``.
    otlp_traces_endpoint: str | None = Field(default=None, pattern=r"^https?://[^\s/]+(/\S*)?$")


class DeploymentSpec(_Strict):
    name: str
    profile: Profile = "gpu"
    kv_mode: KvMode
    model: ModelSpec
    engine_image: str
    proxy_image: str = "pdstack/proxy:dev"
    tensor_parallel: dict[Role, int] = Field(default_factory=dict)
    ports: PortSpec = PortSpec()
    lmcache: LmcacheSpec = LmcacheSpec()
    skip_prefill_threshold_tokens: int = Field(default=0, ge=0)
    proxy_bind_address: str | None = None
    shm_size: str = "16g"
    # the proxy's KV-aware admission (pdstack.proxy.admission); unset: ``kv``. On GPUs it
    # kept every measured mode off the preemption / eager-step cliff (results/h200x1); on
    # CPU, without it a flood of 300 streams drowned the engines (issue 54)
    proxy_admission: Literal["off", "kv"] | None = None
    # the TTFT (s, a P99) an interactive request should meet: with admission, one predicted
    # to wait past 3/4 of it is refused at arrival (pdstack.proxy.wait_budget); unset: the
    # profile's TTFT_SLO_DEFAULTS
    ttft_slo_s: float | None = Field(default=None, gt=0, le=3600)
    # every engine publishes its vLLM KV events to the proxy (pdstack.proxy.kv_events), which
    # routes by what each holds; false: none (a baseline "vLLM as its users start it")
    kv_events: bool = True
    # where engines keep reusable KV in host RAM (kvmodes.resolve_tier); unset: the measured
    # default of the mode and profile. kv_tier_size_gb: each native-tier engine's GiB (unset:
    # TIER_HOST_FRACTION of its node's pdstack_host_memory_gb, split over the node's engines)
    kv_tier: KvTier | None = None
    kv_tier_size_gb: float | None = Field(default=None, gt=0)
    # the native tier stores a block only once it was looked up this many times (vLLM 0.26's
    # OffloadingConnector ``store_threshold``; < 2 stores every new full block): unique
    # prompts then cost the tier no store. Unset: vLLM's default (0)
    kv_tier_store_threshold: int | None = Field(default=None, ge=0)
    monitoring: bool = False
    observability: ObservabilitySpec = ObservabilitySpec()

    @property
    def admission(self) -> Literal["off", "kv"]:
        """``pdstack_proxy_admission``, or its profile's default when unset."""
        if self.proxy_admission is not None:
            return self.proxy_admission
        return "kv"

    @property
    def ttft_slo(self) -> float:
        """``pdstack_ttft_slo_s``, or its profile's default when unset."""
        return self.ttft_slo_s if self.ttft_slo_s is not None else TTFT_SLO_DEFAULTS[self.profile]

    @property
    def burst_growth(self) -> float:
        """The profile's ``--admission-burst-growth`` (:data:`BURST_GROWTH_DEFAULTS`)."""
        return BURST_GROWTH_DEFAULTS[self.profile]

    @property
    def tier(self) -> str:
        """The KV tier: ``pdstack_kv_tier`` checked against the mode, or its default
        (a validated topology never raises here)."""
        return kvmodes.resolve_tier(kvmodes.get(self.kv_mode), self.kv_tier, self.profile)


class TenantSpec(_Strict):
    """``pdstack_tenants.<name>``: one tenant's share and limits at the proxy
    (:mod:`pdstack.proxy.tenants`); a limit left out is no limit. Its keys are in the
    node's secrets file (``PDSTACK_TENANT_KEYS``), never here."""

    weight: float = Field(default=1.0, gt=0, strict=True)
    priority: Literal["interactive", "batch"] = "interactive"
    max_concurrency: int | None = Field(default=None, gt=0, strict=True)
    max_queued: int | None = Field(default=None, gt=0, strict=True)
    rpm: int | None = Field(default=None, gt=0, strict=True)
    tpm: int | None = Field(default=None, gt=0, strict=True)


class Topology(_Strict):
    source: str
    deployment: DeploymentSpec
    nodes: list[NodeSpec]
    tenants: dict[str, TenantSpec] = Field(default_factory=dict)  # pdstack_tenants

    def node(self, name: str) -> NodeSpec:
        return next(n for n in self.nodes if n.name == name)
