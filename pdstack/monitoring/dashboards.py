"""Grafana dashboards as code (grafana-foundation-sdk), from the plan: overview, KV,
engines, proxy. Panels exist only for the metric families the plan's services expose
(no NIXL panel on a shared-l1 stack), so every panel query returns data on a live stack.

Written for Grafana 11.6 (dashboard schemaVersion 41, file provisioning apiVersion 1)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

from pdstack.monitoring.prometheus import Features
from pdstack.topology import DeploymentSpec

DATASOURCE_UID = "pdstack-prometheus"
DATASOURCE = DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)
GRAFANA_VERSION = "11.6"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: list[Query]
    kind: str = "timeseries"  # or "stat"
    description: str = ""
    width: int = 12


@dataclass(frozen=True)
class Board:
    uid: str
    title: str
    rows: list[tuple[str, list[Panel]]] = field(default_factory=list)


def _q(expr: str, legend: str) -> Query:
    return Query(expr, legend)


def _rate(by: str, counter: str, legend: str) -> Query:
    """The per-second rate of ``counter`` over 1 minute, summed by the labels ``by``."""
    return _q(f"sum by ({by}) (rate({counter}[1m]))", legend)


def _quantile(q: float, by: str, histogram: str, legend: str) -> Query:
    """Quantile ``q`` of ``histogram`` over 5 minutes, per the labels ``by``."""
    return _q(f"histogram_quantile({q:g}, sum by (le, {by}) (rate({histogram}_bucket[5m])))",
              legend)


def boards(d: DeploymentSpec, f: Features) -> list[Board]:
    return [_overview(d), _kv(d, f), _engines(d), _proxy(d, f)]


def _overview(d: DeploymentSpec) -> Board:
    o = d.observability
    p50, p99 = o.ttft_p50_slo_ms / 1000, o.ttft_p99_slo_ms / 1000
    return Board(
        "pdstack-overview",
        f"pdstack overview ({d.name})",
        [
            ("Traffic", [
                Panel("Asked vs served", "reqps", [
                    _q("pdstack:asked_rps", "asked"),
                    _q("pdstack:served_rps", "served"),
                ], description="asked = requests arriving at the proxy; served = answered OK"),
                Panel("Errors by outcome", "reqps", [
                    _q('sum by (outcome) (rate(pdstack_proxy_requests_total'
                       '{outcome!="ok"}[1m]))', "{{outcome}}"),
                ]),
            ]),
            ("Latency", [
                Panel("TTFT P50 / P99 (proxy) with the SLO", "s", [
                    _q("pdstack:ttft_seconds:p50", "P50"),
                    _q("pdstack:ttft_seconds:p99", "P99"),
                    _q(f"vector({p50:g})", "SLO P50"),
                    _q(f"vector({p99:g})", "SLO P99"),
                ]),
                Panel("Inter-token latency P50 / P99 (engines)", "s", [
                    _q("pdstack:itl_seconds:p50", "P50"),
                    _q("pdstack:itl_seconds:p99", "P99"),
                ]),
                Panel("Error ratio", "percentunit", [
                    _q("pdstack:error_ratio", "5xx from the proxy"),
                ], kind="stat", width=8),
                Panel("Targets up", "none", [
                    _q('sum(up{job=~"pdstack-.*"})', "up"),
                    _q('count(up{job=~"pdstack-.*"})', "configured"),
                ], kind="stat", width=8),
                Panel("Requests in flight (proxy)", "none", [
                    _q("sum(pdstack_proxy_in_flight)", "in flight"),
                ], kind="stat", width=8),
            ]),
        ],
    )


def _kv(d: DeploymentSpec, f: Features) -> Board:
    kv_panels = [
        Panel("Prompt tokens by source, per engine", "short", [
            _rate("service, source", "vllm:prompt_tokens_by_source_total",
                  "{{service}} {{source}}"),
        ], description="local_compute = computed here; local_cache_hit = GPU prefix cache; "
                       "external_kv_transfer = from LMCache / NIXL"),
        Panel("GPU prefix-cache hit ratio", "percentunit", [
            _q("pdstack:prefix_cache_hit_ratio", "{{service}}"),
        ]),
    ]
    if f.connector:
        kv_panels.append(Panel("External prefix-cache hit ratio (LMCache / NIXL)",
                               "percentunit", [
            _q("pdstack:external_prefix_cache_hit_ratio", "{{service}}"),
        ]))
    if f.nixl:
        kv_panels += [
            Panel("NIXL transfers", "ops", [
                _rate("service", "vllm:nixl_xfer_time_seconds_count", "{{service}}"),
            ]),
            Panel("NIXL transfer time P99", "s", [
                _quantile(0.99, "service", "vllm:nixl_xfer_time_seconds", "{{service}}"),
            ]),
        ]
    if f.native_tier:
        kv_panels += [
            # the names vLLM 0.26 exports once the tier moved a block (results/h200x1-tiers
            # JSONs, "kv_offload"); stores = GPU -> CPU, loads = prefix hits from host RAM
            Panel("Native KV tier: bytes stored (GPU -> CPU) / loaded (CPU -> GPU)", "Bps", [
                _rate("service", "vllm:kv_offload_store_bytes_total", "{{service}} stored"),
                _rate("service", "vllm:kv_offload_load_bytes_total", "{{service}} loaded"),
            ], description="vLLM's OffloadingConnector (pdstack_kv_tier: native)"),
            Panel("Native KV tier: copy time per second", "s", [
                _rate("service", "vllm:kv_offload_store_time_total", "{{service}} store"),
                _rate("service", "vllm:kv_offload_load_time_total", "{{service}} load"),
            ], description="seconds spent copying per second; near 1 = the copies are the "
                           "bottleneck"),
        ]
    if f.lmcache:
        kv_panels += [
            Panel("LMCache L1 use", "percentunit", [
                _q("pdstack:lmcache_l1_usage_ratio", "{{node}}"),
            ]),
            Panel("LMCache lookups: hit tokens / asked tokens", "short", [
                _rate("node", "lmcache_mp_lookup_hit_tokens_total", "{{node}} hit"),
                _rate("node", "lmcache_mp_lookup_requested_tokens_total", "{{node}} asked"),
            ]),
            Panel("LMCache L1 chunks written / read", "short", [
                _rate("node", "lmcache_mp_l1_write_chunks_total", "{{node}} written"),
                _rate("node", "lmcache_mp_l1_read_chunks_total", "{{node}} read"),
            ]),
        ]
    if f.lmcache_pd:
        kv_panels.append(Panel("lmcache-pd ProxyNotif by outcome", "ops", [
            _rate("outcome", "pdstack_proxy_lmcache_pd_notify_total", "{{outcome}}"),
        ]))
    return Board("pdstack-kv", f"pdstack KV ({d.name})", [("KV cache", kv_panels)])


def _engines(d: DeploymentSpec) -> Board:
    return Board(
        "pdstack-engines",
        f"pdstack engines ({d.name})",
        [
            ("Per engine", [
                Panel("Running requests", "none", [
                    _q("sum by (service, role) (vllm:num_requests_running)",
                       "{{service}} ({{role}})"),
                ]),
                Panel("Waiting requests", "none", [
                    _q("sum by (service, role) (vllm:num_requests_waiting)",
                       "{{service}} ({{role}})"),
                ]),
                Panel("KV cache usage", "percentunit", [
                    _q("pdstack:kv_cache_usage:max", "{{service}} ({{role}})"),
                ]),
                Panel("Engine TTFT P99", "s", [
                    _quantile(0.99, "service", "vllm:time_to_first_token_seconds", "{{service}}"),
                ]),
                Panel("Generated tokens", "short", [
                    _rate("service", "vllm:generation_tokens_total", "{{service}}"),
                ]),
                Panel("Engine up", "none", [
                    _q('up{job="pdstack-engine"}', "{{service}} ({{generation}})"),
                ]),
            ]),
        ],
    )


def _proxy(d: DeploymentSpec, f: Features) -> Board:
    proxy_panels = [
        Panel("Leg latency P50 / P99", "s", [
            _quantile(0.5, "leg", "pdstack_proxy_leg_seconds", "{{leg}} P50"),
            _quantile(0.99, "leg", "pdstack_proxy_leg_seconds", "{{leg}} P99"),
        ]),
        Panel("In flight per backend", "none", [
            _q("sum by (backend) (pdstack_proxy_backend_in_flight)", "{{backend}}"),
        ]),
        Panel("Retries", "ops", [
            # retries/ejections exist only after the first one: 0 until then
            _q("sum(rate(pdstack_proxy_retries_total[5m])) or vector(0)", "retries"),
        ]),
        Panel("Ejections", "short", [
            _q("sum(increase(pdstack_proxy_ejections_total[5m])) or vector(0)", "ejections"),
        ]),
        Panel("Backend healthy / drained", "none", [
            _q("sum by (backend) (pdstack_proxy_backend_healthy)", "{{backend}} healthy"),
            _q("sum by (backend) (pdstack_proxy_backend_drained)", "{{backend}} drained"),
        ]),
        Panel("Outcomes", "reqps", [
            _rate("outcome", "pdstack_proxy_requests_total", "{{outcome}}"),
        ]),
    ]
    if f.pd:
        proxy_panels.append(Panel("Requests per prefiller/decoder pair", "reqps", [
            _rate("prefill, decode", "pdstack_proxy_pairs_total", "{{prefill}} -> {{decode}}"),
        ]))
    if f.skip_prefill:
        proxy_panels += [
            Panel("Skip-prefill requests", "reqps", [
                _q("sum(rate(pdstack_proxy_skip_prefill_total[1m]))", "skip prefill"),
            ]),
            Panel("Prefix-index hit ratio", "percentunit", [
                _q("max(pdstack_proxy_prefix_index_hit_ratio)", "hit ratio"),
            ]),
        ]
    if f.admission:
        proxy_panels += [
            Panel("KV admission: queued / waited", "none", [
                _q("sum(pdstack_proxy_admission_queued)", "queued now"),
                _q("sum(rate(pdstack_proxy_admission_waited_total[1m]))", "waited /s"),
            ]),
            Panel("KV admission: held / admitted by reason", "reqps", [
                # or vector(0): a gate that never held (the CPU stack's, below its budget)
                # has no held series at all
                _q("sum by (reason) (rate(pdstack_proxy_admission_held_total[5m]))"
                   " or vector(0)", "held: {{reason}}"),
                _q("sum by (reason) (rate(pdstack_proxy_admission_admitted_total[5m]))",
                   "went: {{reason}}"),
            ], description="why the gate held requests (kv_full, running_cap, tenant_share, "
                           "interactive_first, behind_queue) and why it let them go (idle, "
                           "fits, no_capacity)"),
            Panel("KV admission: rejected (503) by reason", "reqps", [
                _q("sum by (reason) (rate(pdstack_proxy_admission_rejected_total[5m]))"
                   " or vector(0)", "{{reason}}"),
            ]),
            Panel("KV usage the gate reads, per engine", "percentunit", [
                _q("max by (backend) (pdstack_proxy_engine_kv_usage)", "{{backend}}"),
            ]),
        ]
    rows = [("Proxy", proxy_panels)]
    if f.tenants:
        rows.append(("Tenants", _tenant_panels()))
    return Board("pdstack-proxy", f"pdstack proxy ({d.name})", rows)


def _tenant_panels() -> list[Panel]:
    """pdstack_tenants: who is served, who is refused and why, who waits."""
    return [
        Panel("Tenants: served per tenant", "reqps", [
            _q('sum by (tenant) (rate(pdstack_proxy_tenant_requests_total{outcome="ok"}[1m]))',
               "{{tenant}}"),
        ], description="answered OK; under saturation the shares follow the weights"),
        Panel("Tenants: refused by limit", "reqps", [
            _q("sum by (tenant, limit) (rate(pdstack_proxy_tenant_rejected_total[5m]))"
               " or vector(0)", "{{tenant}} {{limit}}"),
        ], description="429 (max_concurrency, max_queued, rpm, tpm; admission's queue_full "
                       "and shed, a batch tenant's timeout) and admission's 503 (timeout); "
                       "alert PdstackTenantThrottled"),
        Panel("Tenants: queue wait P99", "s", [
            _quantile(0.99, "tenant", "pdstack_proxy_tenant_queue_wait_seconds", "{{tenant}}"),
        ], description="time in KV admission's queue (fair queuing releases by weight)"),
        Panel("Tenants: tokens per second", "short", [
            _rate("tenant, kind", "pdstack_proxy_tenant_tokens_total", "{{tenant}} {{kind}}"),
        ]),
        Panel("Tenants: in flight / queued", "none", [
            _q("sum by (tenant) (pdstack_proxy_tenant_in_flight)", "{{tenant}} in flight"),
            _q("sum by (tenant) (pdstack_proxy_tenant_queued)", "{{tenant}} queued"),
        ]),
        Panel("Tenants: share of engine time", "percentunit", [
            _q("sum by (tenant) (rate(pdstack_proxy_tenant_engine_seconds_total[5m])) / "
               "ignoring (tenant) group_left sum(rate("
               "pdstack_proxy_tenant_engine_seconds_total[5m]))", "{{tenant}}"),
        ], description="engine time (admission to end) of each tenant's requests over all "
                       "tenants'; while several are active each is held to its weight's share "
                       "of running requests and prefill tokens (KV admission)"),
    ]


def build(board: Board) -> dict[str, Any]:
    """One board as Grafana dashboard JSON (a dict)."""
    b = (
        dashboard.Dashboard(board.title)
        .uid(board.uid)
        .tags(["pdstack"])
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
    )
    panel_id = 1
    for row_title, panels in board.rows:
        b = b.with_row(dashboard.Row(row_title).id(panel_id))
        panel_id += 1
        for p in panels:
            builder: Any = timeseries.Panel() if p.kind == "timeseries" else stat.Panel()
            builder = (
                builder.id(panel_id).title(p.title).description(p.description)
                .datasource(DATASOURCE).unit(p.unit).height(8).span(p.width)
            )
            for i, q in enumerate(p.queries):
                builder = builder.with_target(
                    prometheus.Dataquery()
                    .expr(q.expr)
                    .legend_format(q.legend)
                    .ref_id(chr(ord("A") + i))
                    .datasource(DATASOURCE)
                )
            b = b.with_panel(builder)
            panel_id += 1
    doc: dict[str, Any] = json.loads(JSONEncoder(sort_keys=True).encode(b.build()))
    return doc


def render_dashboards(d: DeploymentSpec, f: Features) -> dict[str, str]:
    """``<name>.json`` per board (name = uid without the ``pdstack-`` prefix)."""
    return {
        f"{bd.uid.removeprefix('pdstack-')}.json": json.dumps(build(bd), indent=2, sort_keys=True)
        + "\n"
        for bd in boards(d, f)
    }
