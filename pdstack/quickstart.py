"""What ``./quickstart`` needs beyond ``docker compose up``: a second stack beside the
first, a clear error when the stack's ports or compose project are taken, the CPU model's
files on the host (for ``vllm bench serve`` and other tokenizer-side clients), and the
commands it prints at the end.

    python -m pdstack.quickstart stack [--name N --port-offset K]   -> the stack directory
    python -m pdstack.quickstart check STACK_DIR                   -> exit 2 + what holds them
    python -m pdstack.quickstart model STACK_DIR DEST              -> the host copy's path
    python -m pdstack.quickstart bench-line STACK_DIR TOKENIZER    -> a `vllm bench serve` line
    python -m pdstack.quickstart url|served-model|engine-image STACK_DIR
    QUESTION=... python -m pdstack.quickstart ask STACK_DIR  -> streams the answer (sends the
                                                    first client key when keys are set)

Every failure is one line on stderr naming the next step (exit 2), never a traceback.

The default stack is the committed render ``compose/cpu`` (project ``pdstack-local-cpu``,
proxy on 8000). ``PDSTACK_QUICKSTART_NAME`` / ``PDSTACK_PORT_OFFSET`` (``stack --name`` /
``--port-offset``) render ``inventory/local-cpu`` again under another deployment name
(compose project ``pdstack-<name>``) with every port shifted, into
``build/quickstart/<name>/``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import yaml

from pdstack import sidecars

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_STACK = ROOT / "compose" / "cpu"
BASE_INVENTORY = ROOT / "inventory" / "local-cpu"
PORT_FIELDS = ("proxy", "engine_http_base", "nixl_side_channel_base", "lmcache_zmq",
               "lmcache_http", "lmcache_pd_base", "kv_events", "kv_events_replay_base")
OBSERVABILITY_PORTS = {"prometheus_port": 9090, "grafana_port": 3000}
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,40}$")


class QuickstartError(RuntimeError):
    """One clear sentence for the user (exit 2)."""


# ------------------------------------------------------------------ a second stack
def variant_stack(name: str, offset: int, out_root: Path | None = None) -> Path:
    """``inventory/local-cpu`` as deployment ``name`` with every port + ``offset``,
    rendered into ``build/quickstart/<name>/stack``; returns that directory."""
    from pdstack.plan import make_plan
    from pdstack.render import render_all, write_stacks
    from pdstack.topology import PortSpec, TopologyError, load_topology

    if not NAME_RE.match(name):
        raise QuickstartError(
            f"PDSTACK_QUICKSTART_NAME {name!r}: use lower-case letters, digits and '-'")
    if not 0 <= offset <= 50000:
        raise QuickstartError(f"PDSTACK_PORT_OFFSET {offset}: use 0..50000")
    base = out_root or ROOT / "build" / "quickstart" / name
    inv = base / "inventory"
    (inv / "group_vars").mkdir(parents=True, exist_ok=True)
    shutil.copy(BASE_INVENTORY / "hosts.yml", inv / "hosts.yml")
    allvars = yaml.safe_load((BASE_INVENTORY / "group_vars" / "all.yml").read_text())
    defaults = PortSpec()
    ports = {**{f: getattr(defaults, f) for f in PORT_FIELDS}, **allvars.get("pdstack_ports", {})}
    allvars["pdstack_deployment_name"] = name
    allvars["pdstack_ports"] = {k: v + offset if k in PORT_FIELDS else v
                                for k, v in ports.items()}
    obs = {**OBSERVABILITY_PORTS, **allvars.get("pdstack_observability", {})}
    allvars["pdstack_observability"] = {
        k: v + offset if k in OBSERVABILITY_PORTS else v for k, v in obs.items()}
    (inv / "group_vars" / "all.yml").write_text(
        "# written by pdstack.quickstart from inventory/local-cpu: do not edit\n"
        + yaml.safe_dump(allvars, sort_keys=False))
    try:
        topo = load_topology(inv)
    except TopologyError as exc:
        raise QuickstartError(f"the stack {name} (+{offset} ports) is invalid:\n{exc}") from None
    plan = make_plan(topo)
    stack = base / "stack"
    rendered = render_all(topo, plan)
    (node,) = rendered
    write_stacks(rendered, {node: stack})
    return stack


# ------------------------------------------------------------------ what holds a port
@dataclass(frozen=True)
class Holder:
    port: int
    process: str  # "python3 (pid 123)" or ""
    container: str  # docker container name, "" when none

    def describe(self) -> str:
        who = self.process or "an unknown process"
        if self.container:
            who += f" in container {self.container}"
        return f"port {self.port}: {who}"


def project_name(stack_dir: Path) -> str:
    m = re.search(r"^name:\s*(\S+)", (stack_dir / "compose.yaml").read_text(), re.M)
    return m.group(1) if m else stack_dir.name


def stack_ports(stack_dir: Path) -> list[int]:
    """Every host port the stack binds (its services all run with network_mode: host): the
    ``--port`` / ``--http-port`` arguments of their commands, and the LMCache metrics gate's
    (``python3 -m pdstack.sidecars.metrics_gate HOST PORT UPSTREAM``)."""
    services = yaml.safe_load((stack_dir / "compose.yaml").read_text())["services"]
    ports: set[int] = set()
    for svc in services.values():
        cmd = [str(a) for a in svc.get("command") or []]
        ports |= {int(v) for k, v in itertools.pairwise(cmd)
                  if k in ("--port", "--http-port") and v.isdigit()}
        if cmd[:3] == ["python3", "-m", sidecars.METRICS_GATE]:
            ports.add(int(cmd[4]))
    return sorted(ports)


def _listeners() -> dict[int, list[int]]:
    """Listening TCP port -> pids (from ``ss -ltnpH``; empty when ss is missing)."""
    try:
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=False,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found: dict[int, list[int]] = {}
    for line in out.splitlines():
        cols = line.split()
        if len(cols) < 4:
            continue
        m = re.search(r":(\d+)$", cols[3])
        if not m:
            continue
        pids = [int(p) for p in re.findall(r"pid=(\d+)", line)]
        found.setdefault(int(m.group(1)), []).extend(pids)
    return found


def _container_of(pid: int) -> str:
    try:
        cgroup = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""
    m = re.search(r"([0-9a-f]{64})", cgroup)
    if not m:
        return ""
    res = subprocess.run(["docker", "inspect", "-f", "{{.Name}}", m.group(1)],
                         capture_output=True, text=True, check=False)
    return res.stdout.strip().lstrip("/") if res.returncode == 0 else m.group(1)[:12]


def _process(pid: int) -> str:
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return f"pid {pid}"
    return f"{comm} (pid {pid})"


def port_holders(ports: list[int]) -> list[Holder]:
    listening = _listeners()
    out = []
    for port in ports:
        if port not in listening:
            continue
        pids = listening[port]
        pid = pids[0] if pids else None
        out.append(Holder(port, _process(pid) if pid else "",
                          _container_of(pid) if pid else ""))
    return out


def _project_containers(project: str) -> list[tuple[str, str]]:
    """(container name, its compose working dir) of every container of ``project``."""
    res = subprocess.run(
        ["docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={project}",
         "--format", '{{.Names}}\t{{.Label "com.docker.compose.project.working_dir"}}'],
        capture_output=True, text=True, check=False)
    rows = [line.split("\t", 1) for line in res.stdout.splitlines() if line.strip()]
    return [(r[0], r[1] if len(r) > 1 else "") for r in rows]


SECOND_STACK_HINT = (
    "To run a second stack beside it: PDSTACK_QUICKSTART_NAME=cpu2 PDSTACK_PORT_OFFSET=1000 "
    "./quickstart (compose project pdstack-cpu2, proxy on 9000)."
)


def check_free(stack_dir: Path) -> None:
    """Raise QuickstartError when the stack's compose project belongs to another
    directory, or its ports are held by anything but this stack's own containers."""
    stack_dir = stack_dir.resolve()
    project = project_name(stack_dir)
    containers = _project_containers(project)
    elsewhere = sorted({wd for _, wd in containers if wd and Path(wd).resolve() != stack_dir})
    if elsewhere:
        names = ", ".join(n for n, _ in containers)
        raise QuickstartError(
            f"compose project {project} is already used by the stack in {elsewhere[0]} "
            f"(containers {names}). Stop it there (./quickstart --down in that checkout, or "
            f"docker compose -p {project} down) or run this one beside it. {SECOND_STACK_HINT}")
    ours = {n for n, _ in containers}
    busy = [h for h in port_holders(stack_ports(stack_dir)) if h.container not in ours
            or not h.container]
    if busy:
        raise QuickstartError(
            f"the ports of {stack_dir} (project {project}) are taken: "
            + "; ".join(h.describe() for h in busy)
            + f". Stop what holds them, or run beside it. {SECOND_STACK_HINT}")


# ------------------------------------------------------------------ the model on the host
def stack_model(stack_dir: Path) -> tuple[str, str]:
    """(engine image, model directory inside it) of the stack's first engine."""
    env = {}
    for line in (stack_dir / ".env").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    model_keys = sorted(k for k in env if k.endswith("_MODEL") and k != "PDSTACK_MODEL_CACHE")
    if not model_keys:
        raise QuickstartError(f"{stack_dir}/.env names no engine model")
    key = model_keys[0]
    image = env.get(key[: -len("_MODEL")] + "_IMAGE") or env["PDSTACK_ENGINE_IMAGE"]
    return image, env[key]


def _image_id(image: str) -> str:
    res = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", image],
                         capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise QuickstartError(f"image {image} not found: run .ci/install-docker.sh")
    return res.stdout.strip()


def copy_model(stack_dir: Path, dest_root: Path) -> Path:
    """The stack's model folder (tokenizer, config, weights) copied out of its engine image
    into ``dest_root`` + the path it has in the image; skipped when the copy is of this
    image already. Returns the host directory."""
    image, src = stack_model(stack_dir)
    dest = dest_root / src.strip("/")
    stamp = dest / ".pdstack-image"
    want = _image_id(image)
    if stamp.is_file() and stamp.read_text().strip() == want:
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    cid = subprocess.run(["docker", "create", image], capture_output=True, text=True,
                         check=True).stdout.strip()
    try:
        subprocess.run(["docker", "cp", f"{cid}:{src}", str(tmp)], capture_output=True,
                       check=True)
    finally:
        subprocess.run(["docker", "rm", cid], capture_output=True, check=False)
    (tmp / ".pdstack-image").write_text(want + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


# ------------------------------------------------------------------ the first question
def client_key(files: Sequence[Path]) -> str | None:
    """The key the quickstart's request sends: the first of ``PDSTACK_API_KEYS``, else of
    ``PDSTACK_TENANT_KEYS`` (``TENANT:KEY,...``), from the first of ``files`` that exists
    (the proxy's own secrets file, then the node's); None when no key is set (the proxy
    then checks none)."""
    from pdstack.proxy.config import read_env_file
    from pdstack.secrets import API_KEYS_ENV, TENANT_KEYS_ENV

    for path in files:
        try:
            values = read_env_file(path)
        except OSError:
            continue
        for key in values.get(API_KEYS_ENV, "").split(","):
            if key.strip():
                return key.strip()
        for entry in values.get(TENANT_KEYS_ENV, "").split(","):
            _, sep, key = entry.partition(":")
            if sep and key.strip():
                return key.strip()
        return None
    return None


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        return " ".join(str(msg).split())[:200]
    except (ValueError, AttributeError):
        return " ".join(body.decode(errors="replace").split())[:200]


def ask(url: str, model: str, question: str, key: str | None, keys_from: str,
        out: TextIO = sys.stdout, timeout: float = 300.0) -> tuple[int, float | None, float]:
    """One streaming chat request through the proxy, the answer written to ``out`` as it
    streams, with ``Authorization: Bearer key`` when there is a key; returns (chunks, seconds
    to the first, seconds in all). Every failure is a QuickstartError of one line naming the
    next step (``keys_from``: where the key came from, for that line)."""
    body = {"model": model, "stream": True, "max_tokens": 48, "temperature": 0,
            "messages": [{"role": "system", "content": "You are a helpful assistant."},
                         {"role": "user", "content": question}]}
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers=headers)
    t0 = time.monotonic()
    ttft: float | None = None
    n = 0
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            out.write("\n  answer> ")
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if event.get("error"):
                    raise QuickstartError(
                        f"the answer stopped with an error: {_error_message(line[5:].encode())};"
                        " see the engines' logs: docker compose --project-directory <stack> logs")
                for choice in event.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        ttft = ttft if ttft is not None else time.monotonic() - t0
                        n += 1
                        out.write(piece)
                        out.flush()
    except urllib.error.HTTPError as exc:
        said = _error_message(exc.read())
        if exc.code in (401, 403) and key:
            raise QuickstartError(
                f"the proxy refused the client key from {keys_from} ({exc.code}: {said}); it"
                " holds the keys of its last start: run ./quickstart again to split the secrets"
                " and recreate it") from None
        if exc.code in (401, 403):
            raise QuickstartError(
                f"the proxy wants a client key ({exc.code}: {said}) and {keys_from} has none:"
                " put PDSTACK_API_KEYS=<key> in /etc/pdstack/secrets.env and run ./quickstart"
                " again (docs/tenants.md)") from None
        raise QuickstartError(
            f"the proxy answered {exc.code} ({said}); see its log: docker compose"
            " --project-directory <stack> logs proxy, then ./quickstart again") from None
    except (urllib.error.URLError, OSError) as exc:
        why = getattr(exc, "reason", None) or exc
        raise QuickstartError(
            f"no answer from the proxy at {url} ({why}); check the stack: docker compose"
            " --project-directory <stack> ps, then ./quickstart again") from None
    except ValueError as exc:
        raise QuickstartError(f"the proxy's stream was not OpenAI's ({exc}); see its log:"
                              " docker compose --project-directory <stack> logs proxy") from None
    return n, ttft, time.monotonic() - t0


# ------------------------------------------------------------------ printed commands
def proxy_url(stack_dir: Path) -> str:
    text = (stack_dir / "compose.yaml").read_text()
    m = re.search(r'"pdstack", "proxy",[^\]]*"--host", "([^"]+)", "--port", "(\d+)"', text)
    if not m:
        raise QuickstartError(f"no proxy command in {stack_dir}/compose.yaml")
    return f"http://{m.group(1)}:{m.group(2)}"


def served_model(stack_dir: Path) -> str:
    table = json.loads((stack_dir / "backends.json").read_text())
    return str(table["served_model_name"]).split(",")[0].strip()


def bench_args(stack_dir: Path, tokenizer: str) -> list[str]:
    """``vllm bench serve`` arguments: a prefix-sharing run through the proxy (2 shared
    1 k-token prefixes, 16 prompts at 2 req/s)."""
    return ["bench", "serve", "--base-url", proxy_url(stack_dir),
            "--model", served_model(stack_dir), "--tokenizer", tokenizer,
            "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1024",
            "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "2",
            "--prefix-repetition-output-len", "16", "--num-prompts", "16",
            "--request-rate", "2"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdstack.quickstart", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("stack", help="print the stack directory (rendering a variant)")
    st.add_argument("--name", default="")
    st.add_argument("--port-offset", type=int, default=0)
    ck = sub.add_parser("check", help="exit 2 when the stack's project or ports are taken")
    ck.add_argument("stack_dir", type=Path)
    md = sub.add_parser("model", help="copy the stack's model out of its image")
    md.add_argument("stack_dir", type=Path)
    md.add_argument("dest_root", type=Path)
    bl = sub.add_parser("bench-line", help="print a `vllm bench serve` argument line")
    bl.add_argument("stack_dir", type=Path)
    bl.add_argument("tokenizer")
    sk = sub.add_parser("ask", help="stream the answer to $QUESTION through the proxy")
    sk.add_argument("stack_dir", type=Path)
    sk.add_argument("--secrets", type=Path, action="append", default=None,
                    help="where the client keys are (default: the proxy's secrets file, "
                         "then the node's)")
    for name, what in (("url", "the proxy's URL"), ("served-model", "the served model name"),
                       ("engine-image", "the first engine's image")):
        sub.add_parser(name, help=f"print {what}").add_argument("stack_dir", type=Path)
    a = ap.parse_args(argv)
    a.stack_dir_shown = getattr(a, "stack_dir", None) or "<stack>"
    try:
        if a.cmd == "stack":
            if not a.name and not a.port_offset:
                print(DEFAULT_STACK)
            else:
                print(variant_stack(a.name or f"cpu-{a.port_offset}", a.port_offset))
        elif a.cmd == "check":
            check_free(a.stack_dir)
        elif a.cmd == "model":
            print(copy_model(a.stack_dir, a.dest_root))
        elif a.cmd == "bench-line":
            print(" ".join(bench_args(a.stack_dir, a.tokenizer)))
        elif a.cmd == "url":
            print(proxy_url(a.stack_dir))
        elif a.cmd == "served-model":
            print(served_model(a.stack_dir))
        elif a.cmd == "ask":
            _ask(a.stack_dir, a.secrets)
        else:
            print(stack_model(a.stack_dir)[0])
    except QuickstartError as exc:
        print(f"quickstart: {str(exc).replace('<stack>', str(a.stack_dir_shown))}",
              file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
        print(f"quickstart: {a.cmd} failed: {exc.__class__.__name__}: {exc}; run ./quickstart"
              " again, or see docs/getting-started.md", file=sys.stderr)
        return 2
    return 0


def _ask(stack_dir: Path, files: list[Path] | None) -> None:
    from pdstack.secrets import NODE_SECRETS_FILE, service_file

    files = files or [Path(service_file("proxy") or NODE_SECRETS_FILE), Path(NODE_SECRETS_FILE)]
    key = client_key(files)
    where = next((str(f) for f in files if f.is_file()), str(files[-1]))
    question = os.environ.get("QUESTION") or "Explain in one sentence what a prefill node does."
    n, ttft, total = ask(proxy_url(stack_dir), served_model(stack_dir), question, key, where)
    print(f"\n\n  ({n} streamed chunks, first token after {1000 * (ttft or 0):.0f} ms,"
          f" {total:.1f} s total{', sent the first client key' if key else ''}; the model"
          " has random weights, so the words are gibberish by design)\n")


if __name__ == "__main__":
    raise SystemExit(main())
