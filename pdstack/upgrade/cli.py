"""``pdstack upgrade``: rolling model / image upgrade of one node's engines.

The command line (``pdstack upgrade``, or standalone on a node: ``__main__``), its secrets
(the admin token, the engines' key) and the run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from pdstack.secrets import ADMIN_TOKEN_ENV
from pdstack.secrets import ENGINE_API_KEY_ENV as ENGINE_KEY_ENV
from pdstack.secrets import NODE_SECRETS_FILE as SECRETS_ENV_FILE
from pdstack.upgrade.admin import AdminClient
from pdstack.upgrade.common import UpgradeError, log
from pdstack.upgrade.compose import Compose
from pdstack.upgrade.upgrader import Upgrader

DESCRIPTION = __doc__.splitlines()[0] if __doc__ else "pdstack upgrade"


def read_admin_token(token_file: str | None) -> str:
    if token_file:
        for line in Path(token_file).read_text().splitlines():
            if line.strip().startswith(f"{ADMIN_TOKEN_ENV}="):
                return line.split("=", 1)[1].strip().strip("'\"")
        text = Path(token_file).read_text().strip()
        if text and "=" not in text:
            return text
        raise UpgradeError(f"{token_file}: no {ADMIN_TOKEN_ENV}= line")
    token = os.environ.get(ADMIN_TOKEN_ENV, "")
    if not token:
        raise UpgradeError(f"set {ADMIN_TOKEN_ENV} (or --admin-token-file) for the proxy admin API")
    return token


def read_engine_key(secrets_file: str | None) -> str | None:
    """The engines' ``VLLM_API_KEY``: the environment's, else the node's secrets file's
    (the engines read it from there; without one they take requests without a key)."""
    key = os.environ.get(ENGINE_KEY_ENV)
    if key:
        return key
    path = Path(secrets_file) if secrets_file else None
    if path is None or not path.is_file() or not os.access(path, os.R_OK):
        return None
    for line in path.read_text().splitlines():
        line = line.strip().removeprefix("export ").strip()
        if line.startswith(f"{ENGINE_KEY_ENV}="):
            return line.split("=", 1)[1].strip().strip("'\"") or None
    return None


def standalone(argv: list[str] | None = None) -> int:
    """``pdstack-upgrade ...`` on a node, without the ``pdstack`` command."""
    parser = argparse.ArgumentParser(prog="pdstack-upgrade", description=DESCRIPTION)
    add_arguments(parser)
    return main(parser.parse_args(argv))


def register(subparsers: Any, name: str, help_text: str) -> None:
    p = subparsers.add_parser(name, help=help_text, description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=main)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stack-dir", required=True, type=Path,
                   help="the node's rendered stack (compose.yaml + .env)")
    p.add_argument("--model-revision", help="the revision to run (default: keep)")
    p.add_argument("--engine-image", help="the engine image to run (default: keep)")
    p.add_argument("--model", dest="model_template",
                   help="model argument for the new revision; '{revision}' is filled in "
                        "(default: the old path with its revision segment replaced)")
    p.add_argument("--proxy", required=True, help="the proxy's base URL (admin API)")
    p.add_argument("--node", help="node name at the proxy (needed with several nodes)")
    p.add_argument("--project-name", help="docker compose project name (-p)")
    p.add_argument("--only", action="append", metavar="SERVICE",
                   help="upgrade only this service (repeatable)")
    p.add_argument("--admin-token-file",
                   help=f"file with {ADMIN_TOKEN_ENV}=... (default: the environment)")
    p.add_argument("--secrets-env", default=SECRETS_ENV_FILE,
                   help=f"the node's secrets file, for the engines' {ENGINE_KEY_ENV} when the "
                        "environment has none (default %(default)s)")
    p.add_argument("--drain-timeout", type=float, default=600.0)
    p.add_argument("--health-timeout", type=float, default=120.0)
    p.add_argument("--wait-timeout", type=int, default=900,
                   help="seconds for docker compose --wait")
    p.add_argument("--allow-capacity-gap", action="store_true",
                   help="proceed when an engine's restart leaves nothing serving")


def main(args: argparse.Namespace) -> int:
    try:
        if not args.model_revision and not args.engine_image:
            raise UpgradeError("nothing to do: give --model-revision and/or --engine-image")
        token = read_admin_token(args.admin_token_file)
        stack = args.stack_dir.resolve()
        if not (stack / ".env").is_file() or not (stack / "compose.yaml").is_file():
            raise UpgradeError(f"{stack}: not a rendered stack (compose.yaml + .env)")
        upgrader = Upgrader(
            admin=AdminClient(args.proxy, token),
            compose=Compose(stack, args.project_name, args.wait_timeout),
            stack_dir=stack,
            model_revision=args.model_revision,
            engine_image=args.engine_image,
            model_template=args.model_template,
            node=args.node,
            only=args.only,
            drain_timeout_s=args.drain_timeout,
            health_timeout_s=args.health_timeout,
            allow_capacity_gap=args.allow_capacity_gap,
            engine_key=read_engine_key(args.secrets_env),
        )
        t0 = time.monotonic()
        done = upgrader.run()
        print(json.dumps({"upgraded": done, "model_revision": args.model_revision,
                          "seconds": round(time.monotonic() - t0, 1)}))
        return 0
    except UpgradeError as exc:
        log(f"ERROR: {exc}")
        return 1
