"""The topology: an Ansible inventory read as pdstack's single model of a deployment.

``inventory/<name>/hosts.yml`` lists the nodes (group ``pdstack_nodes``) with their
private address, GPUs and engines; ``group_vars/all.yml`` (or ``group_vars/all/*.yml``)
holds the deployment: model, engine image, KV mode, ports, LMCache size.  Ansible reads
the very same files, so Ansible and the CLI never disagree.

Validation collects every problem (file + field + message) before raising, so a user
fixes a broken inventory in one pass: field by field here, then the rules that span fields
(:mod:`pdstack.topology_checks`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from pdstack import kvmodes

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
from pdstack.topology_checks import (
    ENGINE_GPU_OVERHEAD_BYTES,
    GPU_MEMORY_MIB,
    HOST_MEMORY_COMMIT,
    TIER_HOST_FRACTION,
    check_topology,
    native_tier_sizes,
    node_ports,
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
