"""``pdstack advise``: from measured ``pdstack bench`` curves to the topology that meets a
target rate under a TTFT SLO, as a table and as an inventory.

The model (README, "How many GPUs for N req/s"):

* A curve is one topology's ``pdstack bench`` JSON (one point per asked rate). Its **knee**
  is the highest asked rate whose TTFT P50 and P99 meet the SLO with served >= 95 % of
  asked. The knee is the measured unit's capacity; nothing past the last measured point
  is ever assumed.
* Replicas of the measured unit scale linearly behind one proxy (its measured overhead,
  ``benchmarks/results/proxy_overhead.json``, is added to every TTFT estimate).
* Colocated engines are independent: one engine's share of the knee is its capacity.
* P/D units may change their prefill:decode ratio where the curve proves it: a side is
  credited with a rate past the knee only at measured points where that side kept up
  (prefill: its proxy leg count covers >= 95 % of what was sent; decode: served >= 95 % of
  what the prefillers handed over), and only up to the first point where it did not. A
  side's extra load adds its leg's measured mean-time growth (``pdstack_proxy_leg_seconds``,
  interpolated between measured points) to the knee's TTFT P50/P99; the sum must meet the
  SLO. Skip-prefill proxies send work past the prefillers, so those curves scale as whole
  units only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdstack import kvmodes
from pdstack.bench.stats import cost_per_million_output_tokens
from pdstack.plan import make_plan
from pdstack.topology import (
    Topology,
    TopologyError,
    _group_vars,
    _read_yaml,
    load_topology,
)

EXIT_REFUSED = 2
SERVED_SHARE = 0.95  # served >= 95 % of asked for a point to count
DEFAULT_PROXY_OVERHEAD = (
    Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "proxy_overhead.json"
)
# before ``pdstack bench --scenario`` existed, its one workload was the seed's chat mix
LEGACY_SCENARIO = "seed"


class AdviseError(Exception):
    """Advice refused: the message says why (exit 2)."""


# --------------------------------------------------------------------------- reading


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


# --------------------------------------------------------------------------- analysis


@dataclass(frozen=True)
class Slo:
    p50_ms: float
    p99_ms: float


def misses(p: Point, slo: Slo) -> list[str]:
    """Why a point does not count (empty: it meets the SLO)."""
    why = []
    if p.p50 > slo.p50_ms:
        why.append(f"TTFT P50 {p.p50:.0f} ms > {slo.p50_ms:g} ms")
    if p.p99 > slo.p99_ms:
        why.append(f"TTFT P99 {p.p99:.0f} ms > {slo.p99_ms:g} ms")
    if p.served < SERVED_SHARE * p.rate:
        why.append(f"served {p.served:.1f} < 95 % of asked {p.rate:g} req/s")
    return why


def knee(curve: Curve, slo: Slo) -> Point | None:
    ok = [p for p in curve.points if not misses(p, slo)]
    return max(ok, key=lambda p: p.rate) if ok else None


@dataclass(frozen=True)
class ProxyOverhead:
    p50_ms: float
    p99_ms: float
    max_rate: float | None
    source: str


def proxy_overhead(doc: dict[str, Any] | None, source: str) -> ProxyOverhead:
    """The pdstack proxy's worst measured added TTFT and the highest rate it was measured at."""
    runs = [r for r in (doc or {}).get("runs", []) if r.get("target") == "pdstack"]
    if not runs:
        return ProxyOverhead(0.0, 0.0, None, "none given")
    return ProxyOverhead(
        p50_ms=max(0.0, *(float(r.get("delta_p50_ttft_ms") or 0) for r in runs)),
        p99_ms=max(0.0, *(float(r.get("delta_p99_ttft_ms") or 0) for r in runs)),
        max_rate=max(float(r.get("request_throughput") or 0) for r in runs),
        source=source,
    )


@dataclass
class Side:
    """What one P/D side was measured to carry, per engine, from the knee on."""

    xs: list[float]  # per-engine asked-rate equivalents, ascending; xs[0] = the knee's
    ms: list[float]  # the side's leg mean at each

    def delta(self, x: float) -> float | None:
        """Added leg time at per-engine load x vs the knee; None past the measured curve."""
        if x <= self.xs[0] + 1e-9:
            return 0.0
        for (x0, m0), (x1, m1) in zip(zip(self.xs, self.ms, strict=True),
                                      zip(self.xs[1:], self.ms[1:], strict=True), strict=False):
            if x0 < x <= x1 + 1e-9:
                m = m0 + (m1 - m0) * (x - x0) / (x1 - x0) if x1 > x0 else m1
                return max(0.0, m - self.ms[0])
        return None


def sides(curve: Curve, kp: Point) -> tuple[Side, Side] | None:
    """(prefill, decode) sides, or None when the curve cannot split them (no leg timings,
    skip-prefill, no P/D)."""
    s = curve.shape
    if not s.pd or curve.skip_prefill:
        return None
    if any("prefill" not in p.legs or "decode_first_byte" not in p.legs
           for p in curve.points if p.rate >= kp.rate):
        return None
    pre = Side([kp.rate / s.prefill], [kp.leg_ms("prefill") or 0.0])
    dec = Side([kp.rate / s.decode], [kp.leg_ms("decode_first_byte") or 0.0])
    pre_open = dec_open = True
    for p in (q for q in curve.points if q.rate > kp.rate):
        handed = p.leg_rate("prefill") or 0.0
        kept_up = handed >= SERVED_SHARE * p.sent
        if pre_open and kept_up:
            pre.xs.append(p.rate / s.prefill)
            pre.ms.append(p.leg_ms("prefill") or 0.0)
        else:
            pre_open = False
        # what the decoders were handed, in asked req/s per decoder (less than asked when
        # the prefillers queued); a curve whose hand-over shrinks stops there
        x_d = p.rate * min(1.0, handed / p.sent) / s.decode if p.sent else 0.0
        if (dec_open and handed and p.served >= SERVED_SHARE * min(handed, p.sent)
                and x_d > dec.xs[-1]):
            dec.xs.append(x_d)
            dec.ms.append(p.leg_ms("decode_first_byte") or 0.0)
        else:
            dec_open = False
    return pre, dec


@dataclass
class Option:
    curve: Curve
    knee: Point
    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    est_p50: float = 0.0
    est_p99: float = 0.0
    capacity: float = 0.0
    nodes: list[list[tuple[str, int]]] = field(default_factory=list)
    how: str = ""

    @property
    def gpus(self) -> int:
        tp = self.curve.shape.tp
        return (self.prefill * tp.get("prefill", 1) + self.decode * tp.get("decode", 1)
                + self.colocated * tp.get("colocated", 1))

    def shape_text(self) -> str:
        if self.curve.shape.pd:
            return f"{self.prefill}P+{self.decode}D"
        return f"{self.colocated}x engine"

    def cross_node_pairs(self) -> int:
        """P/D pairs the proxy may route across nodes (shared-l1 keeps every pair in one)."""
        if not self.curve.shape.pd or same_node_only(self.curve.shape.kv_mode):
            return 0
        per = [(sum(r == "prefill" for r, _ in n), sum(r == "decode" for r, _ in n))
               for n in self.nodes]
        return self.prefill * self.decode - sum(p * d for p, d in per)

    def units(self) -> str:
        s = self.curve.shape
        if s.pd:
            u = self.prefill / s.prefill
            return f"{u:g}" if self.prefill * s.decode == self.decode * s.prefill else "-"
        return f"{self.colocated / s.colocated:g}"


def _estimate(
    curve: Curve, kp: Point, sd: tuple[Side, Side] | None, n_p: int, n_d: int, rate: float,
    ovh: ProxyOverhead,
) -> tuple[float, float] | None:
    """(TTFT P50, P99) estimate of n_p prefillers + n_d decoders at ``rate``; None when a side
    would run past its measured curve."""
    add = ovh.p50_ms, ovh.p99_ms
    if sd is None:  # whole units only
        s = curve.shape
        units = rate / kp.rate
        if n_p < math.ceil(units * s.prefill - 1e-9) or n_d < math.ceil(units * s.decode - 1e-9):
            return None
        return kp.p50 + add[0], kp.p99 + add[1]
    dp, dd = sd[0].delta(rate / n_p), sd[1].delta(rate / n_d)
    if dp is None or dd is None:
        return None
    return kp.p50 + dp + dd + add[0], kp.p99 + dp + dd + add[1]


def _capacity(ok: Callable[[float], bool], target: float) -> float:
    """The highest rate >= target for which ok(rate) holds (ok is monotone)."""
    lo, hi = target, target * 2
    while ok(hi) and hi < target * 1e6:
        lo, hi = hi, hi * 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def same_node_only(kv_mode: str | None) -> bool:
    """Must every prefiller's decoders be on its node (shared-l1: the store is per node)?"""
    if kv_mode not in kvmodes.MODES:
        return False
    mode = kvmodes.get(kv_mode)
    return mode.disaggregated and not mode.cross_node


def place(
    engines: list[tuple[str, int]], gpus_per_node: int, kv_mode: str | None
) -> list[list[tuple[str, int]]] | None:
    """Engines (role, GPUs) onto the fewest nodes; prefillers and decoders spread evenly so that
    pairs stay local, and where the KV mode pairs only within a node (shared-l1) every node gets
    both."""
    total = sum(g for _, g in engines)
    if any(g > gpus_per_node for _, g in engines):
        return None
    order = sorted(engines, key=lambda e: (("prefill", "decode", "colocated").index(e[0]), -e[1]))
    for n in range(max(1, math.ceil(total / gpus_per_node)), len(engines) + 1):
        nodes: list[list[tuple[str, int]]] = [[] for _ in range(n)]
        free = [gpus_per_node] * n
        for role, g in order:
            fits = [i for i in range(n) if free[i] >= g]
            if not fits:
                break
            i = min(fits, key=lambda j: (sum(1 for r, _ in nodes[j] if r == role), -free[j]))
            nodes[i].append((role, g))
            free[i] -= g
        else:
            used = [nd for nd in nodes if nd]
            if same_node_only(kv_mode) and any(
                {r for r, _ in nd} != {"prefill", "decode"} for nd in used
            ):
                continue
            return used
    return None


def advise_curve(
    curve: Curve, slo: Slo, target: float, gpus_per_node: int, ovh: ProxyOverhead
) -> Option:
    kp = knee(curve, slo)
    if kp is None:
        raise AdviseError(
            f"{curve.label}: no measured point meets the SLO (TTFT P50 <= {slo.p50_ms:g} ms, "
            f"P99 <= {slo.p99_ms:g} ms, served >= 95 % of asked): "
            + "; ".join(f"at {p.rate:g} req/s {', '.join(misses(p, slo))}" for p in curve.points)
        )
    if kp.p50 + ovh.p50_ms > slo.p50_ms or kp.p99 + ovh.p99_ms > slo.p99_ms:
        raise AdviseError(f"{curve.label}: the knee at {kp.rate:g} req/s leaves no room for the "
                          f"proxy's measured overhead ({ovh.source})")
    s = curve.shape
    if not s.pd:
        return _advise_colocated(curve, kp, target, gpus_per_node, ovh)

    sd = sides(curve, kp)
    tp_p, tp_d = s.tp.get("prefill", 1), s.tp.get("decode", 1)
    units = math.ceil(target / kp.rate - 1e-9)
    if sd is None:
        cands = [(units * s.prefill, units * s.decode)]
    else:
        lo_p = math.ceil(target / sd[0].xs[-1] - 1e-9)
        lo_d = math.ceil(target / sd[1].xs[-1] - 1e-9)
        cands = [(a, b) for a in range(max(1, lo_p), units * s.prefill + 1)
                 for b in range(max(1, lo_d), units * s.decode + 1)]
    best: Option | None = None
    for n_p, n_d in cands:
        while True:  # shared-l1 needs a P and a D per node: grow the smaller side until it packs
            nodes = place([("prefill", tp_p)] * n_p + [("decode", tp_d)] * n_d,
                          gpus_per_node, s.kv_mode)
            if nodes is not None or max(tp_p, tp_d) > gpus_per_node:
                break
            if n_p <= n_d:
                n_p += 1
            else:
                n_d += 1
        if nodes is None:
            raise AdviseError(f"{curve.label}: an engine of {max(tp_p, tp_d)} GPUs does not fit "
                              f"{gpus_per_node}-GPU nodes")
        est = _estimate(curve, kp, sd, n_p, n_d, target, ovh)
        if est is None or est[0] > slo.p50_ms or est[1] > slo.p99_ms:
            continue

        def ok(rate: float, a: int = n_p, b: int = n_d) -> bool:
            e = _estimate(curve, kp, sd, a, b, rate, ovh)
            return e is not None and e[0] <= slo.p50_ms and e[1] <= slo.p99_ms

        opt = Option(curve, kp, prefill=n_p, decode=n_d, est_p50=est[0], est_p99=est[1],
                     capacity=_capacity(ok, target), nodes=nodes)
        if best is None or (opt.gpus, -opt.capacity) < (best.gpus, -best.capacity):
            best = opt
    if best is None:  # cannot happen: whole units always meet the knee's numbers
        raise AdviseError(f"{curve.label}: no prefill:decode split meets the SLO")
    best.how = _pd_how(best, curve, kp, sd, target)
    return best


def _advise_colocated(curve: Curve, kp: Point, target: float, gpus_per_node: int,
                      ovh: ProxyOverhead) -> Option:
    """Independent engines: as many as the knee rate per engine asks for."""
    s = curve.shape
    per = kp.rate / s.colocated
    n = math.ceil(target / per - 1e-9)
    opt = Option(curve, kp, colocated=n, est_p50=kp.p50 + ovh.p50_ms,
                 est_p99=kp.p99 + ovh.p99_ms,
                 how=f"{n} independent engines at <= {per:.3g} req/s each "
                     f"(the knee {kp.rate:g} req/s over {s.colocated})")
    nodes = place([("colocated", s.tp.get("colocated", 1))] * n, gpus_per_node, s.kv_mode)
    if nodes is None:
        raise AdviseError(f"{curve.label}: an engine of {s.tp.get('colocated', 1)} GPUs "
                          f"does not fit {gpus_per_node}-GPU nodes")
    opt.nodes = nodes
    opt.capacity = opt.colocated * per
    return opt


def _pd_how(best: Option, curve: Curve, kp: Point, sd: tuple[Side, Side] | None,
            target: float) -> str:
    """Why this prefill:decode split, in one line."""
    s = curve.shape
    r_p, r_d = target / best.prefill, target / best.decode
    if sd is None:
        why = ("whole units: skip-prefill sends work past the prefillers" if curve.skip_prefill
               else "whole units: no proxy leg timings to split prefill from decode")
        return f"{best.units()}x the measured {s.describe()} unit ({why})"
    if best.prefill * s.decode == best.decode * s.prefill:
        return (f"{best.units()}x the measured {s.describe()} unit; the curve shows no side "
                f"with room past the knee ({kp.rate:g} req/s)")
    side = "decode" if best.decode * s.prefill > best.prefill * s.decode else "prefill"
    other = "prefill" if side == "decode" else "decode"
    return (f"{side}-bound: past the knee ({kp.rate:g} req/s) the {other} side kept up "
            f"to {(sd[0] if other == 'prefill' else sd[1]).xs[-1]:.3g} req/s per engine; "
            f"{r_p:.3g} req/s per prefiller, {r_d:.3g} per decoder")


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


# --------------------------------------------------------------------------- inventory


def _node_vars(template: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(all.vars + pdstack_nodes.vars, the first node's vars) of the template's hosts.yml."""
    doc = _read_yaml(template / "hosts.yml", [])
    all_ = doc.get("all") or {}
    group = (all_.get("children") or {}).get("pdstack_nodes") or {}
    hosts = group.get("hosts") or {}
    shared = {**(all_.get("vars") or {}), **(group.get("vars") or {})}
    return shared, dict(next(iter(hosts.values())) or {}) if hosts else {}


def inventory_docs(opt: Option, name: str, gpus_per_node: int) -> tuple[str, str]:
    """(hosts.yml, group_vars/all.yml) text of the advised deployment."""
    tmpl = opt.curve.inventory
    assert tmpl is not None
    topo = load_topology(tmpl)
    engine_extra: dict[str, dict[str, Any]] = {}
    for node in topo.nodes:
        for eng in node.engines:
            spec = eng.model_dump(exclude_defaults=True)
            spec.pop("role", None)
            spec.pop("gpus", None)
            engine_extra.setdefault(eng.role, spec)
    shared_vars, first = _node_vars(tmpl)
    keep = {k: v for k, v in first.items()
            if k in ("pdstack_gpu_model", "pdstack_host_memory_gb", "pdstack_rdma", "pdstack_mtu")}
    hosts: dict[str, Any] = {}
    single = len(opt.nodes) == 1
    for i, engines in enumerate(opt.nodes):
        hv: dict[str, Any] = {}
        if single:
            for k in ("ansible_host", "ansible_connection", "pdstack_private_address"):
                if k in first:
                    hv[k] = first[k]
        if "pdstack_private_address" not in hv:
            hv["ansible_host"] = f"10.0.0.{11 + i}"
            hv["pdstack_private_address"] = f"10.0.0.{11 + i}"
        hv["pdstack_gpu_count"] = gpus_per_node
        hv.update(keep)
        if i == 0:
            hv["pdstack_proxy"] = True
        gpu = 0
        listed = []
        for role, g in engines:
            listed.append({"role": role, "gpus": list(range(gpu, gpu + g)),
                           **engine_extra.get(role, {})})
            gpu += g
        hv["pdstack_engines"] = listed
        hosts[f"node{i + 1}"] = hv
    group: dict[str, Any] = {"hosts": hosts}
    if shared_vars:
        group["vars"] = shared_vars
    c = opt.curve
    head = (f"# Advised by `pdstack advise` for {opt.shape_text()} ({c.label}, knee "
            f"{opt.knee.rate:g} req/s), from {', '.join(c.files)};\n"
            f"# template inventory {tmpl}."
            + ("" if single else " Node addresses are placeholders: put in your nodes'.")
            + "\n")
    hosts_text = head + yaml.safe_dump({"all": {"children": {"pdstack_nodes": group}}},
                                       sort_keys=False, default_flow_style=None, width=100)
    gvars, _ = _group_vars(tmpl, [])
    gvars["pdstack_deployment_name"] = name
    gv_text = ("---\n# Deployment settings as measured (copied from " + str(tmpl) + ").\n"
               + yaml.safe_dump(gvars, sort_keys=False, width=100))
    return hosts_text, gv_text


def write_inventory(opt: Option, out: Path, gpus_per_node: int, force: bool) -> Topology:
    """Write the inventory to ``out`` only once it validates (the code of ``pdstack validate``)."""
    if opt.curve.inventory is None:
        raise AdviseError(
            f"cannot write an inventory for {opt.curve.label!r}: no template inventory (its shape "
            f"came from {opt.curve.shape.source}); pass --topology {opt.curve.label}=INVENTORY"
        )
    if (out / "hosts.yml").exists() and not force:
        raise AdviseError(f"{out}/hosts.yml exists; pass --force to replace it")
    hosts_text, gv_text = inventory_docs(opt, out.name, gpus_per_node)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "group_vars").mkdir()
        (tmp / "hosts.yml").write_text(hosts_text)
        (tmp / "group_vars" / "all.yml").write_text(gv_text)
        try:
            topo = load_topology(tmp)
            make_plan(topo)
        except TopologyError as err:
            raise AdviseError(f"the advised inventory does not validate (nothing written):\n{err}"
                              ) from err
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return load_topology(out)


# --------------------------------------------------------------------------- command


@dataclass
class Advice:
    target: float
    slo: Slo
    options: list[Option]
    skipped: list[str]
    warnings: list[str]
    price: float | None
    ovh: ProxyOverhead

    def cost_h(self, o: Option) -> float | None:
        return None if self.price is None else o.gpus * self.price

    def cost_1m(self, o: Option) -> float | None:
        """At the target rate, with the knee's output tokens per request."""
        tok = o.knee.out_tokens_per_req
        if self.price is None or not tok:
            return None
        return cost_per_million_output_tokens(self.target * tok, self.price, o.gpus)

    def to_json(self) -> dict[str, Any]:
        return {
            "target_rps": self.target,
            "slo": {"ttft_p50_ms": self.slo.p50_ms, "ttft_p99_ms": self.slo.p99_ms},
            "proxy_overhead": {"p50_ms": self.ovh.p50_ms, "p99_ms": self.ovh.p99_ms,
                               "max_measured_rps": self.ovh.max_rate, "source": self.ovh.source},
            "options": [
                {"label": o.curve.label, "kv_mode": o.curve.shape.kv_mode,
                 "measured_unit": o.curve.shape.describe(), "knee_rps": o.knee.rate,
                 "knee_gpus": o.curve.gpus, "rps_per_gpu_at_knee": o.knee.rate / o.curve.gpus,
                 "prefill": o.prefill, "decode": o.decode, "colocated": o.colocated,
                 "gpus": o.gpus, "nodes": len(o.nodes), "capacity_rps": o.capacity,
                 "cross_node_pairs": o.cross_node_pairs(),
                 "placement": [[r for r, _ in nd] for nd in o.nodes],
                 "headroom": o.capacity / self.target - 1,
                 "est_ttft_p50_ms": o.est_p50, "est_ttft_p99_ms": o.est_p99,
                 "cost_per_hour": self.cost_h(o), "cost_per_1m_output_tokens": self.cost_1m(o),
                 "how": o.how, "files": o.curve.files,
                 "inventory_template": str(o.curve.inventory) if o.curve.inventory else None}
                for o in self.options
            ],
            "not_eligible": self.skipped,
            "warnings": self.warnings,
        }


def advise(
    paths: list[Path], target: float, slo: Slo, gpus_per_node: int = 8,
    price: float | None = None, mapping: dict[str, Path] | None = None,
    model: str | None = None, scenario: str | None = None,
    proxy_overhead_file: Path | None = DEFAULT_PROXY_OVERHEAD, roots: list[Path] | None = None,
    min_headroom: float = 0.0,
) -> Advice:
    """Rank every curve's cheapest option for ``target`` req/s; ``min_headroom`` (a fraction)
    sizes for ``target * (1 + min_headroom)``."""
    if target <= 0 or gpus_per_node < 1 or min_headroom < 0:
        raise AdviseError("--target-rps must be > 0, --gpus-per-node >= 1, --headroom >= 0")
    roots = roots or [Path.cwd(), DEFAULT_PROXY_OVERHEAD.parents[2]]
    curves, pdoc = read_curves(paths, mapping or {}, roots)
    if not curves:
        raise AdviseError("no `pdstack bench` JSON among --results")
    source = "a --results file"
    if pdoc is None and proxy_overhead_file is not None and proxy_overhead_file.is_file():
        pdoc = json.loads(proxy_overhead_file.read_text())
        try:
            source = str(proxy_overhead_file.resolve().relative_to(Path.cwd()))
        except ValueError:
            source = str(proxy_overhead_file)
    ovh = proxy_overhead(pdoc, source)
    curves = check_coverage(curves, model, scenario)
    options, skipped = [], []
    for c in curves:
        try:
            options.append(advise_curve(c, slo, target * (1 + min_headroom), gpus_per_node, ovh))
        except AdviseError as err:
            skipped.append(str(err))
    if not options:
        raise AdviseError("no topology meets the target:\n  " + "\n  ".join(skipped))
    options.sort(key=lambda o: (o.gpus, len(o.nodes), -o.capacity, o.est_p99))
    warnings = []
    if ovh.max_rate is not None and target > ovh.max_rate:
        warnings.append(f"one proxy was measured up to {ovh.max_rate:.1f} req/s ({ovh.source}); "
                        f"{target:g} req/s through one proxy is past that measurement")
    best = options[0]
    if best.cross_node_pairs():
        warnings.append(
            f"{best.cross_node_pairs()} of the best option's {best.prefill * best.decode} P/D "
            f"pairs cross nodes (KV over NIXL on the network); its measured unit ran on one node"
        )
    return Advice(target, slo, options, skipped, warnings, price, ovh)


def render_table(adv: Advice) -> str:
    rows = [("#", "topology", "KV mode", "knee/unit", "engines", "units", "GPUs", "nodes",
             "headroom", "est P50/P99 ms", "cost/h", "cost/1M out")]
    for i, o in enumerate(adv.options, 1):
        ch, cm = adv.cost_h(o), adv.cost_1m(o)
        rows.append((
            str(i), o.curve.label, o.curve.shape.kv_mode or "?",
            f"{o.knee.rate:g}/{o.curve.shape.describe()}", o.shape_text(), o.units(),
            str(o.gpus), str(len(o.nodes)), f"{100 * (o.capacity / adv.target - 1):+.0f} %",
            f"{o.est_p50:.0f}/{o.est_p99:.0f}",
            "-" if ch is None else f"{ch:.2f}", "-" if cm is None else f"{cm:.3f}",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if j < 3 else c.rjust(w)
                       for j, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    best = adv.options[0]
    out = [f"target {adv.target:g} req/s at TTFT P50 <= {adv.slo.p50_ms:g} ms, "
           f"P99 <= {adv.slo.p99_ms:g} ms (served >= 95 % of asked)", *lines, ""]
    out.append(f"best: {best.curve.label} as {best.shape_text()} on {best.gpus} GPUs "
               f"({len(best.nodes)} node(s)): fewest GPUs that meet the SLO at the target; "
               f"{best.how}")
    for i, nd in enumerate(best.nodes, 1):
        count: dict[str, int] = {}
        for r, _ in nd:
            count[r] = count.get(r, 0) + 1
        out.append(f"  node{i}: " + ", ".join(f"{n} {r}" for r, n in count.items())
                   + f" ({sum(g for _, g in nd)} GPUs)")
    out.append(f"proxy overhead added to every estimate: +{adv.ovh.p50_ms:.2f} ms P50, "
               f"+{adv.ovh.p99_ms:.2f} ms P99 ({adv.ovh.source})")
    out += [f"not eligible: {s}" for s in adv.skipped]
    out += [f"warning: {w}" for w in adv.warnings]
    return "\n".join(out)


def _mapping(items: list[str]) -> dict[str, Path]:
    out = {}
    for item in items:
        label, sep, inv = item.partition("=")
        if not sep or not label or not inv:
            raise AdviseError(f"--topology {item!r}: use LABEL=INVENTORY_DIR")
        out[label] = Path(inv)
    return out


def cmd_advise(args: argparse.Namespace) -> int:
    try:
        slo = Slo(args.slo_ttft_p50_ms, args.slo_ttft_p99_ms)
        adv = advise(
            [Path(p) for p in args.results], args.target_rps, slo,
            gpus_per_node=args.gpus_per_node, price=args.gpu_hour_price,
            mapping=_mapping(args.topology), model=args.model, scenario=args.scenario,
            proxy_overhead_file=Path(args.proxy_overhead) if args.proxy_overhead else None,
            min_headroom=args.headroom / 100,
        )
        if args.json:
            print(json.dumps(adv.to_json(), indent=2))
        else:
            print(render_table(adv))
        if args.inventory_out:
            out = Path(args.inventory_out)
            topo = write_inventory(adv.options[0], out, args.gpus_per_node, args.force)
            roles = [e.role for n in topo.nodes for e in n.engines]
            print(f"wrote {out}/ (validated: {len(topo.nodes)} node(s), "
                  + ", ".join(f"{roles.count(r)} {r}" for r in dict.fromkeys(roles))
                  + f"); check it with: pdstack plan -i {out}", file=sys.stderr)
    except AdviseError as err:
        print(f"pdstack advise: {err}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


def register(sub: argparse._SubParsersAction, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text, description=__doc__.split("\n\n")[0])
    p.add_argument("--results", nargs="+", required=True, metavar="JSON",
                   help="pdstack bench JSON files (a proxy_overhead.json among them is used "
                        "as the proxy's measured overhead)")
    p.add_argument("--target-rps", type=float, required=True, help="target request rate")
    p.add_argument("--slo-ttft-p50-ms", type=float, default=2000.0)
    p.add_argument("--slo-ttft-p99-ms", type=float, default=3500.0)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--headroom", type=float, default=0.0, metavar="PCT",
                   help="size for this much more than --target-rps (default 0: the knee itself)")
    p.add_argument("--gpu-hour-price", type=float, default=None, help="price of one GPU-hour")
    p.add_argument("--model", default=None, help="the target's model (the bench's model_id)")
    p.add_argument("--scenario", default=None,
                   help=f"the target's bench scenario (files without one: {LEGACY_SCENARIO})")
    p.add_argument("--topology", action="append", default=[], metavar="LABEL=INVENTORY",
                   help="the inventory a label measured (default: inventory/<results dir>-<label>)")
    p.add_argument("--proxy-overhead", default=str(DEFAULT_PROXY_OVERHEAD),
                   help="proxy_overhead.json (benchmarks/proxy_overhead.py); '' for none")
    p.add_argument("--inventory-out", default=None, metavar="DIR",
                   help="write the best option's inventory here (validated first)")
    p.add_argument("--force", action="store_true", help="replace an existing --inventory-out")
    p.add_argument("--json", action="store_true", help="the advice as JSON")
    p.set_defaults(func=cmd_advise)
