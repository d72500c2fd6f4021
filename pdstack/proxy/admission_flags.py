"""``pdstack proxy``'s KV-aware admission flags (:class:`AdmissionConfig` fields as
``--admission-FIELD``), their checks, and the flags that are gone (one clear error each)."""

from __future__ import annotations

import argparse

from pdstack.proxy import kv_mark
from pdstack.proxy.admission_config import AdmissionConfig
from pdstack.proxy.flags import Flag, add_fields, dest

# AdmissionConfig fields, as --admission-FIELD
_ADMISSION = (
    Flag(
        "kv_high",
        "watermark on an engine's projected peak KV (prompts held, and the expected output "
        "of each request until it ends) over its capacity; above 1 the engine may preempt "
        "(cheap while preempted prompts stay in its prefix cache; at most 2) (default "
        "%(default)s)",
        metavar="RATIO",
    ),
    Flag(
        "kv_learn_max",
        "let each engine's watermark rise from kv-high up to this while the engine's own "
        f"time to first byte stays under {kv_mark.FAST} x the TTFT SLO (it falls back above "
        f"{kv_mark.SLOW} x); 0 or <= kv-high: a fixed watermark (default %(default)s)",
        metavar="RATIO",
    ),
    Flag(
        "preempt_caution_s",
        "after an engine preempts, count every request's whole output at once there (no "
        "credit for requests ending first) for this long; 0 = never (default %(default)s)",
        metavar="S",
    ),
    Flag(
        "output_tokens",
        "a request's expected output, at most its max_tokens (default %(default)s)",
        metavar="N",
    ),
    Flag(
        "max_running",
        "the proxy's requests active on one engine at most; 0 = no cap (default %(default)s)",
        metavar="N",
    ),
    Flag(
        "prefill_tokens",
        "prompt tokens in prefill at once per engine, shared by weight among active "
        "tenants; 0 = no prefill share (default %(default)s)",
        metavar="N",
    ),
    Flag(
        "scrape_interval_s",
        "engine /metrics read interval near the KV watermark or while requests wait: a "
        "correction, not the gate (default %(default)s)",
        metavar="S",
    ),
    Flag(
        "scrape_idle_interval_s",
        "engine /metrics read interval while the engine is far below the watermark (under "
        "half of it) and nobody waits: each read costs the engine's loop a few ms "
        "(default %(default)s)",
        metavar="S",
    ),
    Flag(
        "queue_max",
        "requests the proxy holds at most; more: the tenant holding the most gets 429 "
        "(no tenants: 503; default %(default)s)",
        metavar="N",
    ),
    Flag(
        "queue_timeout_s",
        "longest wait in the queue; then 503 (429 to a batch tenant); also a batch "
        "request's wait budget (default %(default)s)",
        metavar="S",
    ),
    Flag(
        "ttft_slo_s",
        "the time to first token an interactive request should meet (P99): one predicted "
        "to wait past 3/4 of it is refused at arrival (503, or 429 while other tenants "
        "share the engines; Retry-After); 0 = no budget (default %(default)s)",
        metavar="S",
    ),
    Flag(
        "burst_growth",
        "a burst past the concurrency the engines served lately is predicted to start at "
        "most this x as fast (an engine that batches: 2; a CPU engine: 1) (default "
        "%(default)s)",
        metavar="X",
    ),
)
# float flags that must lie in [lo, hi]; int flags that must be >= 0
_ADMISSION_RANGES = {
    "kv_high": (0.05, 2.0),
    "kv_learn_max": (0.0, 2.0),
    "preempt_caution_s": (0.0, 3600.0),
    "scrape_interval_s": (0.01, 10.0),
    "scrape_idle_interval_s": (0.01, 60.0),
    "queue_timeout_s": (0.0, 3600.0),
    "ttft_slo_s": (0.0, 3600.0),
    "burst_growth": (1.0, 16.0),
}
_ADMISSION_NONNEGATIVE = ("output_tokens", "max_running", "prefill_tokens", "queue_max")
# flags that are gone, and why (each is one clear error, not silently ignored)
_ADMISSION_REMOVED = {
    "--admission-max-waiting": "the gate no longer reads the engine's waiting gauge; it holds "
    "only what would overfill KV or pass the running cap: drop the flag",
}


def add_admission_flags(p: argparse.ArgumentParser, a: AdmissionConfig) -> None:
    adm = p.add_argument_group(
        "KV-aware admission",
        "hold requests in the proxy while every decoder / colocated engine is near its KV "
        "limit (read from the engines' own /metrics), instead of pushing them into preemption",
    )
    adm.add_argument(
        "--admission",
        choices=("off", "kv"),
        default="kv" if a.enabled else "off",
        help="off (default) or kv",
    )
    add_fields(adm, a, _ADMISSION, prefix="admission-")
    adm.add_argument(
        "--admission-fairness",
        choices=("on", "off"),
        default="on" if a.fairness else "off",
        help="on (default): the queue is fair across tenants (weights, priority classes); "
        "off: one FIFO in arrival order",
    )
    adm.add_argument(
        "--admission-interactive-first",
        choices=("on", "off"),
        default="on" if a.interactive_first else "off",
        help="on (default): while an interactive tenant's request waits for its first byte, "
        "a batch tenant's request is not sent (at most 0.5 s a hold); off: classes act in "
        "the queue only",
    )
    for flag in _ADMISSION_REMOVED:
        adm.add_argument(flag, default=None, help=argparse.SUPPRESS)


def admission_from_args(args: argparse.Namespace) -> AdmissionConfig:
    for flag, why in _ADMISSION_REMOVED.items():
        if getattr(args, dest(flag), None) is not None:
            raise SystemExit(f"pdstack proxy: {flag} was removed: {why}")
    flags = {f.field: f.name("admission-") for f in _ADMISSION}
    values = {field: getattr(args, dest(flag)) for field, flag in flags.items()}
    for field, (lo, hi) in _ADMISSION_RANGES.items():
        if not lo <= values[field] <= hi:
            raise SystemExit(
                f"pdstack proxy: {flags[field]} must be within [{lo:g}, {hi:g}], "
                f"got {values[field]}"
            )
    for field in _ADMISSION_NONNEGATIVE:
        if values[field] < 0:
            raise SystemExit(f"pdstack proxy: {flags[field]} must be >= 0, got {values[field]}")
    fair = getattr(args, "admission_fairness", "on") == "on"
    first = getattr(args, "admission_interactive_first", "on") == "on"
    return AdmissionConfig(
        enabled=args.admission == "kv", fairness=fair, interactive_first=first, **values
    )
