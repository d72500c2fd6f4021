"""The engines of an upgrade and the decisions made from the proxy's listing: their order,
which generations still serve, the stand-in that keeps one serving; and an engine's own
view (its busy gauges, its served model)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pdstack import kvmodes, naming
from pdstack.upgrade.common import UpgradeError, _http, log

STANDIN_TAG = "-standin-"


@dataclass
class Engine:
    service: str
    backend: str  # the proxy's name, "<node>/<service>"
    role: str
    node: str
    url: str


def upgrade_order(engines: list[Engine]) -> list[Engine]:
    """One decoder, then every prefiller, then the other decoders (colocated: as is)."""
    return naming.upgrade_order(engines, lambda e: e.role)


def serving_generations(listing: dict[str, Any], excluded: Iterable[str] = ()) -> set[str]:
    """Generations that still have a usable path for a request, ignoring ``excluded``
    backends and any backend whose URL is an excluded backend's URL (its stand-ins)."""
    skip = set(excluded)
    backends = {b["name"]: b for b in listing["backends"]}
    skip_urls = {backends[n]["url"] for n in skip if n in backends}

    def usable(name: str) -> bool:
        b = backends.get(name)
        return (
            b is not None and b["state"] == "healthy" and name not in skip
            and b["url"] not in skip_urls
        )

    if not kvmodes.get(listing["kv_mode"]).disaggregated:
        return {b["generation"] for n, b in backends.items() if usable(n)}
    out: set[str] = set()
    for pair in listing.get("pairings", []):
        p, d = pair["prefill"], pair["decode"]
        if usable(p) and usable(d) and backends[p]["generation"] == backends[d]["generation"]:
            out.add(backends[p]["generation"])
    return out


def standin_for(
    listing: dict[str, Any], engine: Engine, prefer_generation: str
) -> dict[str, Any] | None:
    """A stand-in backend that keeps one generation serving while ``engine`` is out, or
    None when none is possible (not shared-l1, or no same-node partner)."""
    mode = kvmodes.get(listing["kv_mode"])
    if mode.same_node_path != kvmodes.SHARED_L1 or engine.role not in ("prefill", "decode"):
        return None
    other = "decode" if engine.role == "prefill" else "prefill"
    candidates = [
        b for b in listing["backends"]
        if b["role"] == other and b["state"] == "healthy" and b["node"] == engine.node
        and b["url"] != engine.url and STANDIN_TAG not in b["name"]
    ]
    if not candidates:
        return None
    candidates.sort(key=lambda b: (b["generation"] != prefer_generation, b["name"]))
    target = candidates[0]
    # pair only with same-node engines of the target's generation (shared-l1 path)
    partners = [
        b["name"] for b in listing["backends"]
        if b["role"] == other and b["node"] == engine.node
        and b["generation"] == target["generation"] and b["state"] == "healthy"
        and STANDIN_TAG not in b["name"]
    ]
    short = target["name"].split("/", 1)[-1]
    return {
        "name": f"{engine.node}/{engine.role}{STANDIN_TAG}{short}",
        "role": engine.role,
        "node": engine.node,
        "url": target["url"],
        "generation": target["generation"],
        "pairs_with": partners,
    }



def engine_busy(metrics_text: str) -> float:
    """Requests the engine itself still runs or queues (vLLM's ``num_requests_running`` +
    ``num_requests_waiting`` gauges): the proxy's in-flight count misses work that reached
    the engine under another backend name (an upgrade stand-in) or from another client."""
    busy = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            try:
                busy += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return busy



def verify_and_warm(engine: Engine, model: str, engine_key: str | None) -> None:
    """Check that ``engine`` serves ``model`` (``/v1/models`` ``root``) and warm it with one
    real request straight to it (with the engines' key when they have one)."""
    auth = {"Authorization": f"Bearer {engine_key}"} if engine_key else {}
    status, models = _http("GET", f"{engine.url}/v1/models", headers=auth, timeout=30)
    if status != 200 or not isinstance(models, dict) or not models.get("data"):
        raise UpgradeError(f"{engine.service}: /v1/models answered {status}: {models}")
    entry = models["data"][0]
    root = entry.get("root") or entry.get("id")
    if root != model:
        raise UpgradeError(f"{engine.service}: serves {root!r}, expected {model!r}")
    body = {"model": entry["id"], "prompt": "pdstack warm-up", "max_tokens": 2,
            "temperature": 0}
    status, answer = _http(
        "POST", f"{engine.url}/v1/completions", body, headers=auth, timeout=300
    )
    if status != 200:
        raise UpgradeError(f"{engine.service}: warm-up request answered {status}: {answer}")
    log(f"{engine.service}: serves {model}, warm")
