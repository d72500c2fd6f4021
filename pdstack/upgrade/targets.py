"""What an upgrade is asked to do on one node: the engines it upgrades (from the proxy's
listing and the stack's ``.env``), each one's new ``.env`` values and generation, and the
refusal of a revision change that would share KV across revisions."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdstack import kvmodes
from pdstack.upgrade.common import UpgradeError
from pdstack.upgrade.engines import STANDIN_TAG, Engine, upgrade_order
from pdstack.upgrade.stackfiles import env_prefix, generation, new_model_arg


def node_engines(listing: dict[str, Any], values: dict[str, str], env_file: Path,
                 node: str | None, only: list[str] | None) -> list[Engine]:
    """The engines of ``node`` (the proxy's only node when None) to upgrade, in upgrade
    order; every one of the node's engines must have its lines in ``env_file``
    (``values``)."""
    backends = [b for b in listing["backends"] if STANDIN_TAG not in b["name"]]
    nodes = sorted({b["node"] for b in backends})
    if node is None:
        if len(nodes) != 1:
            raise UpgradeError(
                f"the proxy knows several nodes ({', '.join(nodes)}): pass --node"
            )
        node = nodes[0]
    out = []
    for b in backends:
        if b["node"] != node:
            continue
        service = b["name"].split("/", 1)[-1]
        if f"{env_prefix(service)}_MODEL" not in values:
            raise UpgradeError(
                f"backend {b['name']}: no {env_prefix(service)}_MODEL line in "
                f"{env_file} (is --stack-dir the stack of node {node}?)"
            )
        if only and service not in only:
            continue
        out.append(Engine(service, b["name"], b["role"], b["node"], b["url"]))
    if not out:
        raise UpgradeError(f"no engines of node {node} at the proxy")
    return upgrade_order(out)


@dataclass
class Target:
    """The new image, revision and model argument template (None: keep the engine's)."""

    model_revision: str | None
    engine_image: str | None = None
    model_template: str | None = None

    def values(self, values: dict[str, str], engine: Engine) -> tuple[dict[str, str], str]:
        """The new .env values of ``engine`` (its old ones are ``values``) and its new
        generation."""
        p = env_prefix(engine.service)
        old_model, old_rev = values[f"{p}_MODEL"], values.get(f"{p}_REVISION", "")
        image = self.engine_image or values[f"{p}_IMAGE"]
        rev = self.model_revision or old_rev
        model = new_model_arg(old_model, old_rev, rev, self.model_template)
        new = {f"{p}_IMAGE": image, f"{p}_MODEL": model, f"{p}_REVISION": rev}
        return new, generation(rev, image)

    def check_cache_isolation(self, kv_mode: str, values: dict[str, str],
                              engines: list[Engine]) -> None:
        """Refuse a revision change that keeps the LMCache namespace (the model arg)."""
        mode = kvmodes.get(kv_mode)
        if not (mode.lmcache_server or mode.lmcache_push):
            return
        for e in engines:
            p = env_prefix(e.service)
            new, _ = self.values(values, e)
            if (
                values.get(f"{p}_REVISION", "") != new[f"{p}_REVISION"]
                and new[f"{p}_MODEL"] == values[f"{p}_MODEL"]
            ):
                raise UpgradeError(
                    f"{e.service}: the model argument stays {values[f'{p}_MODEL']!r} across "
                    f"revisions {values.get(f'{p}_REVISION')!r} -> {new[f'{p}_REVISION']!r}, so "
                    "the node's LMCache store would hand KV of one revision to the other "
                    "(its cache key is the model argument). Use a per-revision model path "
                    "(model name with '{revision}') or pass --model with one."
                )
