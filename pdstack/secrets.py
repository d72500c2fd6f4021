"""Which secret each service reads: the one home of that fact (issue 38).

The operator keeps every secret of a node in one file, :data:`NODE_SECRETS_FILE` (mode
0600, ``KEY=value`` lines; Ansible sets ``stack_secrets`` there). No service reads it.
Each service kind reads its own file, :func:`service_file` (``/etc/pdstack/secrets/<kind>.env``,
0600), which holds only the names :data:`SERVICE_SECRETS` gives that kind, copied line by
line from the node's file: by Ansible's stack role (its template selects lines by the same
rule as :func:`split_lines`, the names from the plan's ``NodePlan.secret_files``), by
``pdstack secrets split`` where there is no Ansible (``./quickstart`` runs it), and in memory
by ``pdstack launch`` (:func:`for_kind`). So an engine's environment never holds the admin
token or the client keys, the proxy's never the model token, and the LMCache server, its
metrics gate and Prometheus hold none. (The engine watchdog runs in the engine's container
and uses its ``VLLM_API_KEY``.)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

NODE_SECRETS_FILE = "/etc/pdstack/secrets.env"
SERVICE_SECRETS_DIR = "/etc/pdstack/secrets"

HF_TOKEN_ENV = "HF_TOKEN"  # gated Hugging Face models (vLLM / huggingface_hub read it)
ENGINE_API_KEY_ENV = "VLLM_API_KEY"  # every engine route needs it (vllm_engine_auth)
LEGACY_ENGINE_API_KEY_ENV = "PDSTACK_ENGINE_API_KEY"  # the proxy's older name for it
ADMIN_TOKEN_ENV = "PDSTACK_ADMIN_TOKEN"  # the proxy's admin API
API_KEYS_ENV = "PDSTACK_API_KEYS"  # client keys (tenant "default")
TENANT_KEYS_ENV = "PDSTACK_TENANT_KEYS"  # named client keys, TENANT:KEY,...
GRAFANA_PASSWORD_ENV = "GF_SECURITY_ADMIN_PASSWORD"

# service kind -> the secrets it reads; a kind not here reads none (and gets no file)
SERVICE_SECRETS: dict[str, tuple[str, ...]] = {
    "engine": (HF_TOKEN_ENV, ENGINE_API_KEY_ENV),
    "proxy": (ADMIN_TOKEN_ENV, API_KEYS_ENV, TENANT_KEYS_ENV, ENGINE_API_KEY_ENV,
              LEGACY_ENGINE_API_KEY_ENV),
    "grafana": (GRAFANA_PASSWORD_ENV,),
}
ALL_SECRETS: tuple[str, ...] = tuple(dict.fromkeys(
    name for names in SERVICE_SECRETS.values() for name in names))


def names_for(kind: str) -> tuple[str, ...]:
    """The secrets a service of ``kind`` reads (``()``: none)."""
    return SERVICE_SECRETS.get(kind, ())


def service_file(kind: str) -> str | None:
    """The env file a service of ``kind`` reads its secrets from (None: it reads none)."""
    return f"{SERVICE_SECRETS_DIR}/{kind}.env" if names_for(kind) else None


def for_kind(kind: str, secrets: Mapping[str, str]) -> dict[str, str]:
    """The part of ``secrets`` (the node's, parsed) a service of ``kind`` is given."""
    wanted = names_for(kind)
    return {k: v for k, v in secrets.items() if k in wanted}


_KEY = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=")


def split_lines(text: str, kind: str) -> str:
    """The lines of a node secrets file (``text``) that a service of ``kind`` reads, verbatim
    (quoting as the operator wrote it, which Compose's env_file then reads the same way)."""
    wanted = names_for(kind)
    out = [line for line in text.splitlines()
           if (m := _KEY.match(line)) and m.group(1) in wanted]
    return "".join(f"{line}\n" for line in out)


class Split(NamedTuple):
    """What ``split_file`` did to one service's file: ``names`` set in it now (None: the file
    was removed), ``dropped`` the names it held before and no longer does."""

    path: Path
    names: list[str] | None
    dropped: list[str]


def _names(text: str) -> list[str]:
    return [m.group(1) for line in text.splitlines() if (m := _KEY.match(line))]


def split_file(node_file: Path, out_dir: Path) -> list[Split]:
    """Write each service kind's own file into ``out_dir`` (folder 0700, files 0600, each
    replaced whole) from the node's secrets file. Without that file (the operator removed
    it) the services' files are removed instead, so a recreated service no longer holds
    what was in it. The stack role does the same on a node with Ansible; this is for a stack
    without it (``./quickstart``, a hand-run ``docker compose up``)."""
    text = node_file.read_text() if node_file.is_file() else None
    out: list[Split] = []
    for kind in SERVICE_SECRETS:
        target = out_dir / f"{kind}.env"
        try:
            before = _names(target.read_text())
        except (FileNotFoundError, NotADirectoryError):
            before = None
        if text is None:
            if before is not None:
                target.unlink()
                out.append(Split(target, None, before))
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        out_dir.chmod(0o700)
        lines = split_lines(text, kind)
        tmp = target.with_name(f".{target.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(lines)
        os.replace(tmp, target)
        names = _names(lines)
        out.append(Split(target, names, [n for n in before or () if n not in names]))
    return out


def register(subparsers: Any, name: str, help_text: str) -> None:
    p = subparsers.add_parser(name, help=help_text, description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["split"],
                   help="split: write each service's own secrets file from the node's")
    p.add_argument("--node-file", type=Path, default=Path(NODE_SECRETS_FILE),
                   help="the node's secrets file (default %(default)s)")
    p.add_argument("--dir", type=Path, default=Path(SERVICE_SECRETS_DIR),
                   help="where the services' files go (default %(default)s)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    node: Path = args.node_file
    try:
        done = split_file(node, args.dir)
    except OSError as exc:
        print(f"pdstack secrets split: {exc}", file=sys.stderr)
        return 1
    if not node.is_file():
        print(f"{node}: no such file; the services get no secrets")
    for path, names, dropped in done:  # names only, never a value
        gone = f" (removed: {', '.join(dropped)})" if dropped else ""
        if names is None:
            print(f"{path}: removed the file{gone}")
        else:
            print(f"{path}: {', '.join(names) or '(none set)'}{gone}")
    if any(d.dropped for d in done):
        print("recreate the services so they no longer hold what was removed: "
              "docker compose up -d (./quickstart does it)")
    elif not done:
        print("no secrets to split (the services run without any)")
    return 0
