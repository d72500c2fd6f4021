"""Reading ``pdstack bench`` JSONs as curves: one per topology label and workload (repeats of
a rate keep the worst of each number), each with the engine shape it measured (from its
inventory, ``config.topology`` or the proxy's backend counters); and the check that the
curves measured the target's workload."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdstack import kvmodes
from pdstack.topology import Topology, TopologyError, load_topology

# before ``pdstack bench --scenario`` existed, its one workload was the seed's chat mix
LEGACY_SCENARIO = "seed"


class AdviseError(Exception):
    """Advice refused: the message says why (exit 2)."""


@dataclass(frozen=True)
class Point:
    rate: float  # asked req/s
    served: float
    sent: float
    p50: float
    p99: float
    duration: float
    out_tokens_per_req: float | None
    legs: dict[str, tuple[float, float]] = field(default_factory=dict)  # leg -> (count, mean ms)
    skip_prefill: float = 0.0

    def leg_rate(self, leg: str) -> float | None:
        got = self.legs.get(leg)
        return got[0] / self.duration if got and self.duration else None

    def leg_ms(self, leg: str) -> float | None:
        got = self.legs.get(leg)
        return got[1] if got else None


@dataclass
class Shape:
    kv_mode: str | None
    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    tp: dict[str, int] = field(default_factory=dict)  # role -> GPUs per engine
    source: str = ""

    @property
    def pd(self) -> bool:
        return self.prefill > 0 and self.decode > 0

    def gpus(self) -> int:
        return sum(
            n * self.tp.get(role, 1)
            for role, n in (("prefill", self.prefill), ("decode", self.decode),
                            ("colocated", self.colocated))
        )

    def describe(self) -> str:
        if self.pd:
            return f"{self.prefill}P{self.decode}D"
        return f"{self.colocated} engine(s)"


@dataclass
class Curve:
    label: str
    files: list[str]
    model: str
    scenario: str
    workload: dict[str, Any]
    gpus: int
    shape: Shape
    points: list[Point]
    inventory: Path | None
    skip_prefill: bool


def _num(d: dict[str, Any], key: str) -> float:
    v = d.get(key)
    if not isinstance(v, int | float):
        raise ValueError(f"results[].{key} missing or not a number")
    return float(v)


def _point(r: dict[str, Any], duration: float) -> Point:
    pd = ((r.get("prometheus") or {}).get("total") or {}).get("pdstack") or {}
    legs: dict[str, tuple[float, float]] = {}
    for leg in ("prefill", "decode_first_byte", "decode"):
        c = pd.get(f"pdstack_proxy_leg_seconds_count{{leg={leg}}}")
        s = pd.get(f"pdstack_proxy_leg_seconds_sum{{leg={leg}}}")
        if c and s is not None:
            legs[leg] = (float(c), 1000.0 * float(s) / float(c))
    served = _num(r, "served_rate")
    tput = r.get("output_throughput")
    done = r.get("request_throughput") or served
    return Point(
        rate=_num(r, "request_rate"),
        served=served,
        sent=float(r.get("sent_rate") or r["request_rate"]),
        p50=_num(r, "p50_ttft_ms"),
        p99=_num(r, "p99_ttft_ms"),
        duration=float(r.get("duration") or duration),
        out_tokens_per_req=float(tput) / float(done) if tput and done else None,
        legs=legs,
        skip_prefill=float(pd.get("pdstack_proxy_skip_prefill_total") or 0.0),
    )


def _roles_from_counters(results: list[dict[str, Any]]) -> dict[str, set[str]]:
    """backend name by role, from the proxy's ``pdstack_proxy_backend_*`` gauges."""
    roles: dict[str, set[str]] = {}
    for r in results:
        for ep in ((r.get("prometheus") or {}).get("endpoints") or {}).values():
            for key in (ep.get("pdstack") or {}) if isinstance(ep, dict) else {}:
                if not key.startswith("pdstack_proxy_backend_healthy{"):
                    continue
                labels = dict(
                    kv.split("=", 1) for kv in key[key.index("{") + 1 : -1].split(",") if "=" in kv
                )
                if "role" in labels and "backend" in labels:
                    roles.setdefault(labels["role"], set()).add(labels["backend"])
    return roles


def _shape_from_topology(topo: Topology, source: str) -> Shape:
    shape = Shape(kv_mode=topo.deployment.kv_mode, source=source)
    for node in topo.nodes:
        for eng in node.engines:
            setattr(shape, eng.role, getattr(shape, eng.role) + 1)
            shape.tp[eng.role] = len(eng.gpus) or 1
    return shape


def _find_inventory(label: str, path: Path, roots: list[Path]) -> Path | None:
    """``inventory/<dir>-<label>`` for a results folder ``.../<dir>/`` (or a folder above it:
    results/h200x2/session2/x.json finds inventory/h200x2-x), as results/h200x2 names them."""
    for parent in path.resolve().parents:
        for root in roots:
            cand = root / "inventory" / f"{parent.name}-{label}"
            if (cand / "hosts.yml").is_file():
                return cand
    return None


def read_curves(
    paths: list[Path], mapping: dict[str, Path], roots: list[Path]
) -> tuple[list[Curve], dict[str, Any] | None]:
    """Every bench JSON as a curve (files of one label and workload merged, worst point per
    rate), and the proxy-overhead document if one of the files is one."""
    by_key, proxy_doc = _group_bench_docs(paths)
    curves = [
        _curve(label, model, wl_json, docs, mapping, roots)
        for (label, model, wl_json), docs in sorted(by_key.items())
    ]
    return curves, proxy_doc


_Docs = list[tuple[Path, dict[str, Any]]]


def _group_bench_docs(
    paths: list[Path],
) -> tuple[dict[tuple[str, str, str], _Docs], dict[str, Any] | None]:
    """The bench JSONs by (label, model, scenario + workload), and the proxy-overhead doc."""
    proxy_doc: dict[str, Any] | None = None
    by_key: dict[tuple[str, str, str], _Docs] = {}
    for path in paths:
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise AdviseError(f"{path}: not readable JSON ({exc})") from exc
        if isinstance(doc, dict) and doc.get("benchmark") == "proxy_overhead":
            proxy_doc = doc
            continue
        if not isinstance(doc, dict) or doc.get("tool") != "pdstack bench":
            raise AdviseError(f'{path}: not a `pdstack bench` JSON (no "tool": "pdstack bench")')
        cfg = doc.get("config") or {}
        label = str(doc.get("label") or cfg.get("label") or path.stem)
        model = str(doc.get("model_id") or cfg.get("model") or "?")
        scenario = str(cfg.get("scenario") or doc.get("scenario") or LEGACY_SCENARIO)
        wl = {k: v for k, v in (cfg.get("workload") or {}).items() if k != "seed"}
        key = (label, model, json.dumps([scenario, wl], sort_keys=True))
        by_key.setdefault(key, []).append((path, doc))
    return by_key, proxy_doc


def _curve(label: str, model: str, wl_json: str, docs: _Docs, mapping: dict[str, Path],
           roots: list[Path]) -> Curve:
    """One curve from the bench docs of one label and workload."""
    scenario, wl = json.loads(wl_json)
    first_path, first = docs[0]
    files = [str(p) for p, _ in docs]
    gpus_seen = {d.get("config", {}).get("gpus") for _, d in docs}
    if len(gpus_seen) != 1 or not isinstance(next(iter(gpus_seen)), int):
        raise AdviseError(
            f"{', '.join(files)}: config.gpus must be one integer for label {label!r} "
            f"(got {sorted(map(str, gpus_seen))}); rerun pdstack bench with --gpus N"
        )
    gpus = int(next(iter(gpus_seen)))
    results = [r for _, d in docs for r in d.get("results") or []]
    if not results:
        raise AdviseError(f"{', '.join(files)}: no results[]")
    try:
        raw = [_point(r, float(d["config"].get("duration") or 0)) for _, d in docs
               for r in d.get("results") or []]
    except (ValueError, KeyError, TypeError) as exc:
        raise AdviseError(f"{', '.join(files)}: {exc}") from exc
    points = _merge_worst(raw)

    topo_field = first.get("config", {}).get("topology")
    inv = _inventory_for(label, topo_field, first_path, mapping, roots)
    shape = _shape_for(label, inv, topo_field, results, gpus, first_path)
    return Curve(label=label, files=files, model=model, scenario=scenario, workload=wl,
                 gpus=gpus, shape=shape, points=points, inventory=inv,
                 skip_prefill=any(p.skip_prefill > 0 for p in raw))


def _inventory_for(label: str, topo_field: Any, first_path: Path, mapping: dict[str, Path],
                   roots: list[Path]) -> Path | None:
    """The inventory of a label: --topology, else config.topology as a path, else by name."""
    inv = mapping.get(label)
    if inv is None and isinstance(topo_field, str):
        for root in roots:
            for cand in (Path(topo_field), root / topo_field, root / "inventory" / topo_field):
                if (cand / "hosts.yml").is_file():
                    inv = cand
                    break
            if inv:
                break
    if inv is None:
        inv = _find_inventory(label, first_path, roots)
    return inv


def _shape_for(label: str, inv: Path | None, topo_field: Any, results: list[dict[str, Any]],
               gpus: int,
               first_path: Path) -> Shape:
    """The engine shape of a curve: from its inventory, config.topology or the counters."""
    shape: Shape
    if inv is not None:
        try:
            shape = _shape_from_topology(load_topology(inv), f"inventory {inv}")
        except TopologyError as err:
            raise AdviseError(
                f"inventory {inv} for label {label!r} is invalid:\n{err}"
            ) from err
        if shape.gpus() != gpus:
            raise AdviseError(
                f"label {label!r}: inventory {inv} has {shape.gpus()} GPUs in engines but "
                f"{first_path} says config.gpus = {gpus}; pass --topology {label}=INVENTORY"
            )
    elif isinstance(topo_field, dict):
        shape = Shape(
            kv_mode=topo_field.get("kv_mode"),
            prefill=int(topo_field.get("prefill", 0)),
            decode=int(topo_field.get("decode", 0)),
            colocated=int(topo_field.get("colocated", 0)),
            source="config.topology",
        )
    else:
        roles = _roles_from_counters(results)
        shape = Shape(
            kv_mode=label if label in kvmodes.MODES else None,
            prefill=len(roles.get("prefill", ())),
            decode=len(roles.get("decode", ())),
            colocated=len(roles.get("colocated", ())),
            source="the proxy's backend counters",
        )
        if not (shape.pd or shape.colocated):  # no proxy in front: one opaque unit
            shape = Shape(kv_mode=None, colocated=1, tp={"colocated": gpus},
                          source="config.gpus (no proxy counters)")
    engines = shape.prefill + shape.decode + shape.colocated
    if not shape.tp and engines and gpus % engines == 0:
        per = gpus // engines
        shape.tp = {r: per for r in ("prefill", "decode", "colocated")}
    if shape.gpus() != gpus:
        raise AdviseError(
            f"label {label!r}: cannot tell how its {gpus} GPUs split into engines "
            f"({shape.describe()} from {shape.source}); pass --topology {label}=INVENTORY"
        )
    return shape


def _merge_worst(points: list[Point]) -> list[Point]:
    """One point per asked rate; repeats of a rate keep the worst of each number."""
    out: list[Point] = []
    for rate in sorted({p.rate for p in points}):
        same = [p for p in points if p.rate == rate]
        if len(same) == 1:
            out.append(same[0])
            continue
        legs: dict[str, tuple[float, float]] = {}
        for leg in {k for p in same for k in p.legs}:
            got = [p.legs[leg] for p in same if leg in p.legs]
            legs[leg] = (min(c for c, _ in got), max(m for _, m in got))
        worst = min(same, key=lambda p: p.served / p.sent if p.sent else 0.0)
        tok = [p.out_tokens_per_req for p in same if p.out_tokens_per_req]
        out.append(Point(rate=rate, served=worst.served, sent=worst.sent,
                         p50=max(p.p50 for p in same), p99=max(p.p99 for p in same),
                         duration=min(p.duration for p in same),
                         out_tokens_per_req=max(tok) if tok else None, legs=legs,
                         skip_prefill=max(p.skip_prefill for p in same)))
    return out


def check_coverage(curves: list[Curve], model: str | None, scenario: str | None) -> list[Curve]:
    """The curves that measured the target's workload; refuse when none or a mix."""
    measured = sorted({f"model {c.model}, scenario {c.scenario}" for c in curves})
    keep = [c for c in curves
            if (model is None or c.model == model) and (scenario is None or c.scenario == scenario)]
    want = ", ".join(f"{k} {v}" for k, v in (("model", model), ("scenario", scenario)) if v)
    if not keep:
        raise AdviseError(f"the results do not cover the target's workload ({want}): they "
                          f"measured {'; '.join(measured)}")
    groups: dict[str, list[str]] = {}
    for c in keep:
        desc = (f"model {c.model}, scenario {c.scenario}, system_len "
                f"{c.workload.get('system_len')}, output_len {c.workload.get('output_len')}")
        groups.setdefault(desc, []).append(c.label)
    if len(groups) > 1:
        raise AdviseError(
            "the results measured different workloads, so their curves do not compare: "
            + "; ".join(f"{', '.join(labels)} ({desc})" for desc, labels in groups.items())
            + "; pick one with --model / --scenario or pass only one workload's files"
        )
    return keep
