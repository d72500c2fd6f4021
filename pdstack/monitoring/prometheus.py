"""Prometheus: the scrape config, recording rules and alerts of one deployment, from its plan.

Every expression lives here or in :mod:`pdstack.monitoring.dashboards` once; the dashboards
plot the recording rules' names where one exists. The e2e test runs every expression against
a real Prometheus scraping the CPU stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from pdstack import kvmodes
from pdstack.monitoring.targets import JOBS, MonitoringPlan
from pdstack.plan import Plan
from pdstack.topology import DeploymentSpec

ERROR_OUTCOMES = "upstream_error|stream_error|no_backend"
CLIENT_OUTCOMES = "client_error|bad_request|unauthorized|client_disconnect"


@dataclass(frozen=True)
class Features:
    """Which metric families the plan's services expose (panels and rules follow)."""

    pd: bool  # prefill/decode legs: the plan pairs prefillers with decoders
    connector: bool  # engines run a KV connector (vLLM's external prefix-cache metrics)
    lmcache: bool  # an LMCache MP server on some node
    nixl: bool  # some engine runs the NIXL connector
    lmcache_pd: bool  # LMCache's legacy push (the proxy's ProxyNotif socket)
    skip_prefill: bool  # the proxy's prefix index is on
    admission: bool  # the proxy's KV-aware admission gate (pdstack_proxy_admission: kv)
    native_tier: bool = False  # some engine runs vLLM's native CPU tier (vllm:kv_offload_*)
    tenants: bool = False  # pdstack_tenants: the proxy's per-tenant series

    @classmethod
    def of(cls, plan: Plan) -> Features:
        services = [s for n in plan.nodes.values() for s in n.services]
        table = plan.backend_table
        mode = kvmodes.get(plan.kv_mode)
        return cls(
            pd=bool(table.pairings),
            connector=any(s.kv_transfer_config for s in services if s.kind == "engine"),
            lmcache=any(s.kind == "lmcache" for s in services),
            nixl=any("nixl_side_channel" in s.ports for s in services),
            lmcache_pd=mode.lmcache_push,
            skip_prefill=table.skip_prefill_threshold_tokens > 0 and mode.skip_prefill,
            admission=any("--admission" in s.command and "off" not in s.command
                          for s in services if s.kind == "proxy"),
            native_tier=plan.kv_tier == kvmodes.NATIVE,
            tenants=bool(table.tenants),
        )


def _yaml(doc: Any) -> str:
    return yaml.safe_dump(doc, sort_keys=False, width=1000)


def prometheus_config(
    d: DeploymentSpec, mon: MonitoringPlan, scrape_interval_s: int | None = None
) -> dict[str, Any]:
    interval_s = scrape_interval_s or d.observability.scrape_interval_s
    interval = f"{interval_s}s"
    jobs: dict[str, dict[str, Any]] = {}
    for t in mon.targets:
        job = jobs.setdefault(
            t.job,
            {
                "job_name": t.job,
                "metrics_path": t.metrics_path,
                "static_configs": [],
            },
        )
        if t.job == JOBS["proxy"]:
            # the proxy's per-backend series carry the backend's own node/role/generation
            job["honor_labels"] = True
        job["static_configs"].append({"targets": [t.address], "labels": dict(t.labels)})
    return {
        "global": {
            "scrape_interval": interval,
            "evaluation_interval": interval,
            "scrape_timeout": f"{min(10, interval_s)}s",
            "external_labels": {"deployment": d.name},
        },
        "rule_files": ["rules.yml"],
        "scrape_configs": [jobs[j] for j in JOBS.values() if j in jobs],
    }


# --------------------------------------------------------------------------- recording rules


def recording_rules(d: DeploymentSpec, f: Features) -> list[dict[str, str]]:
    """Recording rules (record -> expr); the dashboards plot these names."""
    rules = [
        # asked = arrivals the stack owes an answer (not the client's own faults: bad or
        # unauthorized requests, disconnects) = those finished + growth of what is in flight
        ("pdstack:asked_rps",
         f'sum(rate(pdstack_proxy_requests_total{{outcome!~"{CLIENT_OUTCOMES}"}}[1m]))'
         " + sum(delta(pdstack_proxy_in_flight[1m])) / 60"),
        ("pdstack:served_rps", 'sum(rate(pdstack_proxy_requests_total{outcome="ok"}[1m]))'),
        ("pdstack:error_ratio",
         f'sum(rate(pdstack_proxy_requests_total{{outcome=~"{ERROR_OUTCOMES}"}}[5m]))'
         " / sum(rate(pdstack_proxy_requests_total[5m]))"),
        ("pdstack:ttft_seconds:p50",
         "histogram_quantile(0.5, sum by (le) (rate(pdstack_proxy_ttft_seconds_bucket[5m])))"),
        ("pdstack:ttft_seconds:p99",
         "histogram_quantile(0.99, sum by (le) (rate(pdstack_proxy_ttft_seconds_bucket[5m])))"),
        ("pdstack:itl_seconds:p50",
         "histogram_quantile(0.5, sum by (le) "
         "(rate(vllm:inter_token_latency_seconds_bucket[5m])))"),
        ("pdstack:itl_seconds:p99",
         "histogram_quantile(0.99, sum by (le) "
         "(rate(vllm:inter_token_latency_seconds_bucket[5m])))"),
        ("pdstack:kv_cache_usage:max",
         "max by (node, service, role) (vllm:kv_cache_usage_perc)"),
        ("pdstack:prefix_cache_hit_ratio",
         "sum by (node, service) (rate(vllm:prefix_cache_hits_total[5m]))"
         " / sum by (node, service) (rate(vllm:prefix_cache_queries_total[5m]))"),
    ]
    if f.connector:
        rules.append(
            ("pdstack:external_prefix_cache_hit_ratio",
             "sum by (node, service) (rate(vllm:external_prefix_cache_hits_total[5m]))"
             " / sum by (node, service) (rate(vllm:external_prefix_cache_queries_total[5m]))")
        )
    if f.lmcache:
        capacity = d.lmcache.l1_size_gb * 2**30
        rules.append(
            ("pdstack:lmcache_l1_usage_ratio",
             f"max by (node) (lmcache_mp_l1_memory_usage_bytes) / {capacity}")
        )
    return [{"record": r, "expr": e} for r, e in rules]


# --------------------------------------------------------------------------- alerts


def alert_rules(d: DeploymentSpec, f: Features) -> list[dict[str, Any]]:
    o = d.observability
    p50, p99 = o.ttft_p50_slo_ms / 1000, o.ttft_p99_slo_ms / 1000
    alerts: list[tuple[str, str, str, str, str]] = [
        # name, expr, for, severity, summary
        ("PdstackTargetDown", 'up{job=~"pdstack-.*"} == 0', "2m", "critical",
         "{{ $labels.service }} on {{ $labels.node }} does not answer /metrics"),
        ("PdstackTtftP50OverSlo", f"pdstack:ttft_seconds:p50 > {p50:g}", "5m", "warning",
         f"TTFT P50 {{{{ $value | humanizeDuration }}}} over the SLO ({p50:g} s)"),
        ("PdstackTtftP99OverSlo", f"pdstack:ttft_seconds:p99 > {p99:g}", "5m", "warning",
         f"TTFT P99 {{{{ $value | humanizeDuration }}}} over the SLO ({p99:g} s)"),
        ("PdstackServedBelowAsked",
         "pdstack:served_rps < 0.95 * pdstack:asked_rps and pdstack:asked_rps > 0", "5m",
         "warning", "the stack serves less than 95 % of the requests it is asked"),
        ("PdstackErrorRatioHigh", "pdstack:error_ratio > 0.01", "5m", "critical",
         "{{ $value | humanizePercentage }} of the requests fail (502/503 from the proxy)"),
        ("PdstackBackendEjected", "increase(pdstack_proxy_ejections_total[5m]) > 0", "0s",
         "warning", "the proxy ejected {{ $labels.backend }} (failed health checks or legs)"),
        ("PdstackBackendUnhealthy", "pdstack_proxy_backend_healthy == 0", "1m", "critical",
         "{{ $labels.backend }} fails the proxy's health checks"),
        ("PdstackKvCacheFull", "vllm:kv_cache_usage_perc > 0.95", "5m", "warning",
         "{{ $labels.service }} on {{ $labels.node }} uses {{ $value | humanizePercentage }}"
         " of its KV cache"),
    ]
    if f.lmcache:
        alerts.append(
            ("PdstackLmcacheL1Full", "pdstack:lmcache_l1_usage_ratio > 0.95", "10m", "warning",
             "LMCache L1 on {{ $labels.node }} is {{ $value | humanizePercentage }} full"
             " (evicting: raise pdstack_lmcache.l1_size_gb)")
        )
    if f.connector:
        alerts.append(
            ("PdstackExternalPrefixHitRatioDropping",
             "pdstack:external_prefix_cache_hit_ratio"
             " < 0.5 * avg_over_time(pdstack:external_prefix_cache_hit_ratio[1h] offset 10m)",
             "10m", "warning",
             "{{ $labels.service }} on {{ $labels.node }}: external prefix-cache hit ratio fell"
             " below half its last hour"))
    alerts += _tenant_alerts(f)
    if f.pd:
        alerts += [
            # most of its prompt tokens computed locally (not GPU prefix-cache hits) and
            # none from a prefiller
            ("PdstackDecoderNotReceivingKv",
             'sum by (node, service) (rate(vllm:prompt_tokens_by_source_total'
             '{role="decode",source="local_compute"}[10m]))'
             ' > 0.5 * sum by (node, service) (rate(vllm:prompt_tokens_by_source_total'
             '{role="decode"}[10m]))'
             ' unless sum by (node, service) (rate(vllm:prompt_tokens_by_source_total'
             '{role="decode",source="external_kv_transfer"}[10m])) > 0',
             "10m", "critical",
             "decoder {{ $labels.service }} on {{ $labels.node }} computes prompts itself:"
             " no KV arrives from the prefillers"),
        ]
    return [
        {
            "alert": name,
            "expr": expr,
            "for": for_,
            "labels": {"severity": severity},
            "annotations": {"summary": summary},
        }
        for name, expr, for_, severity, summary in alerts
    ]


TENANT_THROTTLED_RATIO = 0.1


def _tenant_alerts(f: Features) -> list[tuple[str, str, str, str, str]]:
    """A tenant refused (429 by its limits, or 503 by admission) for over 10 % of its
    requests for 10 minutes: its limits are too tight, or it floods."""
    if not f.tenants:
        return []
    return [
        ("PdstackTenantThrottled",
         "sum by (tenant) (rate(pdstack_proxy_tenant_rejected_total[10m]))"
         f" > {TENANT_THROTTLED_RATIO:g}"
         " * sum by (tenant) (rate(pdstack_proxy_tenant_requests_total[10m]))",
         "10m", "warning",
         "tenant {{ $labels.tenant }}: {{ $value | printf \"%.2f\" }} requests/s refused by its"
         " limits or by admission (over 10 % of what it sends)"),
    ]


def rules_doc(d: DeploymentSpec, f: Features, interval_s: int | None = None) -> dict[str, Any]:
    interval = f"{interval_s or d.observability.scrape_interval_s}s"
    return {
        "groups": [
            {"name": "pdstack-recording", "interval": interval,
             "rules": recording_rules(d, f)},
            {"name": "pdstack-alerts", "interval": interval, "rules": alert_rules(d, f)},
        ]
    }


def render_prometheus(
    d: DeploymentSpec, plan: Plan, mon: MonitoringPlan, scrape_interval_s: int | None = None
) -> dict[str, str]:
    f = Features.of(plan)
    head = (f"# Rendered by `pdstack render` for deployment {d.name}; do not edit "
            "(change the inventory and render again).\n")
    return {
        "prometheus.yml": head + _yaml(prometheus_config(d, mon, scrape_interval_s)),
        "rules.yml": head + _yaml(rules_doc(d, f, scrape_interval_s)),
    }
