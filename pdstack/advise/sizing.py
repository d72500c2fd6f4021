"""Sizing one curve for a target rate: its knee under the SLO, what each P/D side was measured
to carry past the knee, the TTFT estimate of a prefill:decode split, the engines placed on
nodes, and the cheapest option that meets the SLO (the model: :mod:`pdstack.advise`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdstack import kvmodes
from pdstack.advise.curves import AdviseError, Curve, Point

SERVED_SHARE = 0.95  # served >= 95 % of asked for a point to count


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
