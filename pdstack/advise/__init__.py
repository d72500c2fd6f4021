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

Reading the curves is :mod:`pdstack.advise.curves`, sizing one curve
:mod:`pdstack.advise.sizing`, the advised inventory :mod:`pdstack.advise.inventory`; this
module ranks the options and is the command.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdstack.advise.curves import (
    LEGACY_SCENARIO,
    AdviseError,
    Curve,
    Point,
    Shape,
    check_coverage,
    read_curves,
)
from pdstack.advise.inventory import inventory_docs, write_inventory
from pdstack.advise.sizing import (
    SERVED_SHARE,
    Option,
    ProxyOverhead,
    Side,
    Slo,
    advise_curve,
    knee,
    misses,
    place,
    proxy_overhead,
    sides,
)
from pdstack.bench.stats import cost_per_million_output_tokens

__all__ = [
    "DEFAULT_PROXY_OVERHEAD",
    "EXIT_REFUSED",
    "LEGACY_SCENARIO",
    "SERVED_SHARE",
    "Advice",
    "AdviseError",
    "Curve",
    "Option",
    "Point",
    "ProxyOverhead",
    "Shape",
    "Side",
    "Slo",
    "advise",
    "advise_curve",
    "check_coverage",
    "inventory_docs",
    "knee",
    "misses",
    "place",
    "proxy_overhead",
    "read_curves",
    "register",
    "render_table",
    "sides",
    "write_inventory",
]

EXIT_REFUSED = 2
DEFAULT_PROXY_OVERHEAD = (
    Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "proxy_overhead.json"
)


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
