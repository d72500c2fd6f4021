"""The plan's types: what the planner (:mod:`pdstack.plan`) hands everything downstream
(renderer, proxy, preflight, Ansible, launch, upgrade, monitoring): frozen pydantic models,
``.model_dump(mode="json")``-able. No planning here."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from pdstack import kvmodes
from pdstack.backend_identity import BackendIdentity
from pdstack.specs import TenantSpec

KvPath = Literal["shared-l1", "nixl", "lmcache-pd"]
ServiceKind = Literal["engine", "lmcache", "proxy"]


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


def named_ports(**ports: int | None) -> dict[str, int]:
    """A service's ``ports`` (name -> port) from the ones it has (None: it has none), in the
    order given."""
    return {name: port for name, port in ports.items() if port is not None}


def _drop_none(data: dict, *keys: str) -> dict:
    for key in keys:
        if key in data and data[key] is None:
            del data[key]
    return data


def _drop_false(data: dict, *keys: str) -> dict:
    """``keys`` left out where empty or false (a table without them means the default)."""
    for key in keys:
        if not data.get(key):
            data.pop(key, None)
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


class Backend(_Model, BackendIdentity):
    """One engine in the table: name, role, node, url, generation and standby (the fields
    of :class:`pdstack.backend_identity.BackendIdentity`, the proxy's record has them too),
    then what only some engines have (omitted from the JSON when None): an lmcache-pd
    decoder's receiver, an engine's KV events source."""

    lmcache_pd: LmcachePdReceiver | None = None
    kv_events: KvEventsSource | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict:
        return _drop_false(_drop_none(handler(self), "lmcache_pd", "kv_events"), "standby")


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
    # ``priority`` from its tenant's class (pdstack.plan_proxy.engine_priority; omitted when
    # false)
    engine_priority: bool = False
    # every engine's KV events go there (omitted when none publish)
    kv_events: KvEventsListen | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler: SerializerFunctionWrapHandler) -> dict:
        data = _drop_none(handler(self), "lmcache_pd_notify", "kv_events")
        return _drop_false(data, "tenants", "engine_priority")

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

