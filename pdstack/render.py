"""Renderer: a Plan -> per-node ``compose.yaml`` + ``.env`` + ``backends.json``.

Everything is rendered in memory first; files are written only when every node rendered,
so a bad inventory never leaves a half-written ``build/``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import jinja2

from pdstack import monitoring, naming, secrets, sidecars
from pdstack.compose_yaml import yaml_list, yaml_map
from pdstack.plan import Plan, Service, model_path
from pdstack.topology import Topology

REPO = sidecars.PACKAGE.parent
TEMPLATE_DIR = REPO / "compose" / "templates"
STACK_FILES = ("compose.yaml", ".env", "backends.json")
# replaced as a whole; vllm-plugins: where stacks carried the vLLM plugins before pdstack/
STACK_DIRS = ("monitoring", "pdstack", "vllm-plugins")
# a stack rendered into this checkout's compose/ mounts the package from here; any other
# carries a copy of what its containers run (pdstack.sidecars.container_files) in pdstack/
IN_TREE = REPO / "compose"
CARRIED = "./pdstack"


def package_source(target: Path | None) -> str:
    """Where the stack written to ``target`` finds pdstack's package (the sidecars and the
    vLLM plugins), as a Compose bind-mount source: the package itself, relative to the stack
    (``../../pdstack``), for a stack in this checkout's ``compose/``; else the stack's own
    ``./pdstack`` (it may go to another machine: Ansible copies it)."""
    if target is not None and target.resolve().is_relative_to(IN_TREE.resolve()):
        return os.path.relpath(sidecars.PACKAGE, target.resolve())
    return CARRIED


def env_prefix(svc: Service) -> str:
    """``decode-1`` -> ``DECODE_1``: the .env prefix of one engine's image/model/GPU ids."""
    return naming.env_prefix(svc.name)


def engine_command(svc: Service, model_arg: str) -> list[str]:
    """The engine command with the model and revision taken from the node's .env, so a
    rolling upgrade changes one engine's line in .env and recreates that service only."""
    prefix = env_prefix(svc)
    cmd = list(svc.command)
    cmd[cmd.index(model_arg)] = f"${{{prefix}_MODEL}}"
    if "--revision" in cmd:
        cmd[cmd.index("--revision") + 1] = f"${{{prefix}_REVISION}}"
    return cmd


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.policies["json.dumps_kwargs"] = {"sort_keys": False}
    return env


def render_node(topo: Topology, plan: Plan, node_name: str,
                target: Path | None = None) -> dict[str, str]:
    """The files of one node's stack, by file name, for a stack written to ``target``
    (:func:`package_source`; None: a stack that carries the package's files)."""
    d = topo.deployment
    node = plan.nodes[node_name]
    env = _environment()
    env.filters["yaml_list"] = yaml_list
    env.filters["yaml_map"] = yaml_map
    model_arg = model_path(d)
    wedge_s = sidecars.engine_wedge_s(d.profile)
    source = package_source(target)
    ctx = {
        "plan": plan,
        "node": node,
        "source": f"inventory/{Path(topo.source).name}",
        "node_secrets_file": secrets.NODE_SECRETS_FILE,
        "secrets_dir": secrets.SERVICE_SECRETS_DIR,
        "grafana_secrets_file": secrets.service_file("grafana"),
        "engine_image": d.engine_image,
        "proxy_image": d.proxy_image,
        "model_name": model_arg,
        "model_revision": d.model.revision,
        "model_cache": "/var/lib/pdstack/hf-cache" if d.profile == "gpu" else "./.hf-cache",
        "shm_size": d.shm_size,
        "engine_start_period": "1800s" if d.profile == "gpu" else "600s",
        # while an engine starts (before its first passing check, within start_period) Docker
        # checks it this often, then every interval (10 s): a restarted engine is "healthy"
        # within ~1 s of its /health, not up to 5 s later (issue 38 item 6). Docker >= 25:
        # 20.10 (Debian 12's docker.io) drops start_interval and checks every interval
        "engine_start_interval": "1s",
        "env_prefix": env_prefix,
        # the node's LMCache data port is a socket in a volume only it and the engines mount
        "engine_command": lambda svc: sidecars.engine_on_data_socket(
            engine_command(svc, model_arg)),
        "engine_env": lambda svc: {**svc.env, "PYTHONPATH": sidecars.ENGINE_PYTHONPATH},
        "package_source": source,
        "package_mount": sidecars.CONTAINER_PACKAGE,
        "sidecar_env": {"PYTHONPATH": sidecars.CONTAINER_PYTHONPATH},
        "engine_wedge_s": wedge_s,
        "engine_healthcheck": lambda svc: sidecars.engine_healthcheck(
            (svc.healthcheck_url or "").removesuffix("/health"), wedge_s, svc.name,
            d.model.served_name,
        ),
        "metrics_gate": lambda svc: sidecars.metrics_gate_command(
            svc.bind_address, svc.ports["metrics"], f"unix:{sidecars.LMCACHE_API_SOCKET}"
        ),
        "lmcache_api_dir": os.path.dirname(sidecars.LMCACHE_API_SOCKET),
        "lmcache_env": lambda svc: {**svc.env,
                                    sidecars.LMCACHE_DATA_ENV: sidecars.LMCACHE_DATA_SOCKET,
                                    "PYTHONPATH": sidecars.CONTAINER_PYTHONPATH},
        "lmcache_data_dir": os.path.dirname(sidecars.LMCACHE_DATA_SOCKET),
        "lmcache_data_path": lambda svc: sidecars.lmcache_data_endpoint(
            svc.ports["zmq"]).removeprefix("ipc://"),
    }
    has_proxy = any(s.kind == "proxy" for s in node.services)
    # the monitoring profile (Prometheus + Grafana) lives on the proxy's node
    ctx["monitoring"] = monitoring.compose_context(d, plan) if has_proxy else None
    files = {
        "compose.yaml": env.get_template("node-compose.yaml.j2").render(ctx),
        ".env": env.get_template("node.env.j2").render(ctx),
    }
    if source == CARRIED:
        files |= {f"pdstack/{rel}": text for rel, text in sidecars.container_files().items()}
    if has_proxy:
        files["backends.json"] = plan.backend_table.model_dump_json(indent=2) + "\n"
        files |= monitoring.render_monitoring(d, plan)
    return files


def render_all(topo: Topology, plan: Plan,
               dirs: dict[str, Path] | None = None) -> dict[str, dict[str, str]]:
    """Every node's files, for stacks written to ``dirs`` (:func:`output_dirs`; None: stacks
    that carry the package's files)."""
    return {name: render_node(topo, plan, name, (dirs or {}).get(name)) for name in plan.nodes}


def output_dirs(plan: Plan, out: Path | None) -> dict[str, Path]:
    """``build/<node>/`` by default; with ``-o DIR`` a single-node stack goes straight into
    DIR (``compose/cpu``), several nodes into ``DIR/<node>/``."""
    if out is None:
        return {n: Path("build") / n for n in plan.nodes}
    if len(plan.nodes) == 1:
        return {next(iter(plan.nodes)): out}
    return {n: out / n for n in plan.nodes}


def write_stacks(rendered: dict[str, dict[str, str]], dirs: dict[str, Path]) -> list[Path]:
    """Write every node's files; each directory is replaced as a whole (rename into place)."""
    written: list[Path] = []
    staged: list[tuple[Path, Path]] = []
    for node, files in rendered.items():
        target = dirs[node]
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        for fname, text in files.items():
            (tmp / fname).parent.mkdir(parents=True, exist_ok=True)
            (tmp / fname).write_text(text)
            written.append(target / fname)
        staged.append((tmp, target))
    for tmp, target in staged:
        if target.exists():
            # keep files we do not own (e.g. a local .hf-cache or README) in place
            for fname in STACK_FILES:
                (target / fname).unlink(missing_ok=True)
            for dname in STACK_DIRS:
                shutil.rmtree(target / dname, ignore_errors=True)
            for f in tmp.iterdir():
                os.replace(f, target / f.name)
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, target)
    return written
