"""Stats: the proxy's Prometheus metrics (one registry per proxy instance).

Metric names (all prefixed ``pdstack_proxy_``):
- ``ttft_seconds`` histogram {route}: request arrival -> first byte written to the client
  (route: ``pd`` two legs, ``skip_prefill``, ``colocated``, ``decode_fallback``).
- ``leg_seconds`` histogram {leg}: ``prefill`` (whole leg), ``decode_first_byte``,
  ``decode`` (whole leg).
- ``requests_total`` counter {outcome}: ``ok``, ``client_error`` (4xx passed through),
  ``bad_request``, ``unauthorized``, ``rejected`` (429), ``no_backend`` (503),
  ``upstream_error`` (every try failed before the first byte), ``stream_error`` (upstream
  died, stalled or sent a 5xx error event mid-stream; the client got an error event),
  ``client_disconnect``.
- ``in_flight`` gauge; ``backend_in_flight`` / ``backend_healthy`` / ``backend_drained``
  gauges {backend, role, node, generation}; ``backend_in_rotation`` {backend}: warm standbys.
- ``skip_prefill_total`` counter.
- ``prefix_index_lookups_total``, ``prefix_index_hits_total`` counters and
  ``prefix_index_hit_ratio`` gauge (hits / lookups; a hit = some prefix cached).
- ``retries_total`` counter {leg}; ``ejections_total`` counter {backend, reason}: why each
  ejection happened (``refused``, ``unreachable``, ``health_failed``, ``engine_5xx``,
  ``wedged_no_progress``, ``error_rate``, ``half_open``, ``other``:
  :data:`pdstack.proxy.backends.EJECT_REASONS`).
- ``wedged_total`` counter {backend}: backends found wedged (a leg stuck with no progress,
  and a 1-token generation unanswered: :mod:`pdstack.proxy.progress`); ``backend_wedged``
  gauge {backend, role, node, generation}: 1 until it generates again.
- ``decode_fallback_total`` counter: requests a decoder served whole because no prefiller
  was usable (route ``decode_fallback`` in ``ttft_seconds``).
- ``migrations_total`` counter {reason, outcome}: streams whose leg failed mid-stream
  (reason ``cut``, ``frozen``, ``stall``, ``error_event``, ``ejected``) and what followed
  (outcome ``continued`` on another engine, ``failed``: the client got an error event);
  ``migration_gap_seconds`` histogram: the failed engine's last data (noticing a frozen
  one is part of it) -> the next engine's first event written to the client
  (:mod:`pdstack.proxy.migration`).
- KV-aware admission (``--admission kv``): ``admission_admitted_total`` counter {reason}
  (why a request went: ``idle`` engine, ``fits`` under the KV watermark, ``no_capacity``
  known), ``admission_held_total`` counter {reason} (why one waited: ``kv_full``,
  ``running_cap``, ``behind_queue``); ``admission_rejected_total`` counter {reason}
  (``queue_full``, ``timeout``: answered 503); ``admission_waited_total`` counter (requests
  that waited in the proxy's queue) and ``admission_wait_seconds_total``;
  ``admission_queued`` gauge; per gated engine {backend}: ``engine_kv_usage``,
  ``engine_requests_waiting``, ``engine_requests_running``, ``engine_preemptions`` (what the
  gate last read from it), ``engine_kv_capacity_tokens``, ``engine_projected_tokens`` (the
  gate's projection: the KV the engine will hold for what it has now),
  ``engine_base_scale`` (the engine's KV at its last scrape per token the gate estimated
  for the same requests: how far the gate's count is from the engine's),
  ``engine_preempt_caution`` and ``engine_proxy_requests`` (the proxy's requests there).
- Tenants (only when ``pdstack_tenants`` or client keys are configured; label ``tenant`` =
  a configured tenant's name, a plain key's ``key-...``, ``default``, or ``other`` past
  the first 64: bounded): ``tenant_requests_total`` {tenant, outcome} (the outcomes
  above), ``tenant_rejected_total`` {tenant, limit} (``max_concurrency``, ``max_queued``,
  ``rpm``, ``tpm``, admission's ``queue_full``, ``shed`` and ``queue_wait``, a batch
  tenant's ``timeout``: 429; an interactive tenant's ``timeout``: 503),
  ``tenant_tokens_total`` {tenant, kind} (``prompt``, ``completion``: the real usage
  where the answer carried it),
  ``tenant_queue_wait_seconds`` histogram {tenant} (time in KV admission's queue),
  ``tenant_in_flight`` / ``tenant_queued`` gauges {tenant}; with KV admission also
  ``tenant_engine_seconds_total`` {tenant} (engine time of its ended requests, admission
  to end: each tenant's share of engine time is its rate over the sum of all),
  ``tenant_running`` and ``tenant_prefill_tokens`` gauges {tenant} (requests on the
  engines, prompt tokens admitted with no first byte yet) and ``tenant_engine_share``
  gauge {tenant} (its weight's share of the engines while several tenants are active).
- ``pairs_total`` counter {prefill, decode, prefill_generation, decode_generation}: which
  prefiller/decoder pairs served requests (proves generations never mix).
- kv_mode ``lmcache-pd``: ``lmcache_pd_notify_total`` counter {outcome}: ``received`` (the
  decode leg went after LMCache's ProxyNotif), ``timeout`` (no ProxyNotif within
  ``--lmcache-pd-notify-timeout``: the decode leg went anyway and the decoder recomputes),
  ``no_receiver`` (decoder without receiver ports: no push asked), ``unmatched`` (a
  ProxyNotif nobody waits for: another TP rank's, or late), ``invalid`` (not a
  ProxyNotif); ``lmcache_pd_notify_wait_seconds`` histogram: how long the decode leg
  waited for it after the prefill leg answered.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pdstack.proxy import wait_budget
from pdstack.proxy.backends import BackendRegistry, BackendState
from pdstack.proxy.standby import collect_rotation

TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
QUEUE_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ROUTES = ("pd", "skip_prefill", "colocated", "decode_fallback")
OUTCOMES = (
    "ok", "client_error", "bad_request", "unauthorized", "rejected", "no_backend",
    "upstream_error", "stream_error", "client_disconnect",
)  # fmt: skip


class _BackendCollector(Collector):
    def __init__(self, backends: Callable[[], BackendRegistry], in_flight: Callable[[], int]):
        self._backends = backends
        self._in_flight = in_flight

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["backend", "role", "node", "generation"]
        in_flight = GaugeMetricFamily(
            "pdstack_proxy_backend_in_flight", "requests in flight per backend", labels=labels
        )
        healthy = GaugeMetricFamily(
            "pdstack_proxy_backend_healthy", "1 = passing health checks", labels=labels
        )
        drained = GaugeMetricFamily(
            "pdstack_proxy_backend_drained", "1 = drained (no new requests)", labels=labels
        )
        wedged = GaugeMetricFamily(
            "pdstack_proxy_backend_wedged", "1 = accepts requests, makes no progress",
            labels=labels,
        )
        for b in self._backends().backends.values():
            values = [b.name, b.role, b.node, b.generation]
            in_flight.add_metric(values, b.in_flight)
            healthy.add_metric(values, 1 if b.healthy else 0)
            drained.add_metric(values, 1 if b.drained else 0)
            wedged.add_metric(values, 1 if b.wedged else 0)
        total = GaugeMetricFamily("pdstack_proxy_in_flight", "client requests in flight")
        total.add_metric([], self._in_flight())
        yield from (in_flight, healthy, drained, wedged, total, collect_rotation(self._backends()))


def _counter(r: CollectorRegistry, name: str, doc: str, *labels: str) -> Counter:
    return Counter(f"pdstack_proxy_{name}", doc, labels, registry=r)


def _histogram(r: CollectorRegistry, name: str, doc: str, *labels: str) -> Histogram:
    return Histogram(f"pdstack_proxy_{name}", doc, labels, buckets=TTFT_BUCKETS, registry=r)


class ProxyMetrics:
    def __init__(
        self, backends: Callable[[], BackendRegistry], in_flight: Callable[[], int]
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = _histogram(r, "ttft_seconds", "proxy-observed time to first byte", "route")
        self.leg = _histogram(r, "leg_seconds", "per-leg latency", "leg")
        self.requests = _counter(r, "requests", "client requests by outcome", "outcome")
        self.skip_prefill = _counter(r, "skip_prefill", "requests sent straight to a decoder")
        self.index_lookups = _counter(r, "prefix_index_lookups", "prefix index lookups")
        self.index_hits = _counter(r, "prefix_index_hits", "lookups that found a cached prefix")
        self.index_hit_ratio = Gauge(
            "pdstack_proxy_prefix_index_hit_ratio", "prefix index hits / lookups", registry=r
        )
        self.retries = _counter(r, "retries", "retried legs", "leg")
        self.ejections = _counter(r, "ejections", "backends ejected, by why", "backend", "reason")
        self.wedged = _counter(
            r, "wedged", "backends found wedged (accepting requests, no progress)", "backend"
        )
        self.decode_fallback = _counter(
            r, "decode_fallback", "requests served whole by a decoder: no usable prefiller"
        )
        self.migrations = _counter(
            r, "migrations", "streams whose leg failed mid-stream, by why and what followed",
            "reason", "outcome",
        )
        self.migration_gap = _histogram(
            r, "migration_gap_seconds",
            "a migrated stream's gap: the failed engine's last data -> the next one's first event",
        )
        self.pairs = _counter(
            r, "pairs", "requests per prefiller/decoder pair",
            "prefill", "decode", "prefill_generation", "decode_generation",
        )
        self._mode_metrics(r)
        r.register(_BackendCollector(backends, in_flight))
        # pre-bound children: label lookups off the hot path
        self.outcome = {o: self.requests.labels(o) for o in OUTCOMES}
        self.ttft_route = {k: self.ttft.labels(k) for k in ROUTES}
        self.leg_prefill = self.leg.labels("prefill")
        self.leg_decode_first = self.leg.labels("decode_first_byte")
        self.leg_decode = self.leg.labels("decode")
        self._pair_children: dict[tuple[str, str, str, str], Any] = {}
        self._lookups = 0
        self._hits = 0

    def _mode_metrics(self, r: CollectorRegistry) -> None:
        """The series of one KV mode (lmcache-pd) or of KV-aware admission."""
        self.lmcache_pd_notify = _counter(
            r, "lmcache_pd_notify", "lmcache-pd ProxyNotif waits and messages by outcome",
            "outcome",
        )
        self.lmcache_pd_notify_wait = _histogram(
            r, "lmcache_pd_notify_wait_seconds",
            "lmcache-pd: wait for ProxyNotif after the prefill leg answered",
        )
        self.admission_rejected = _counter(
            r, "admission_rejected",
            "requests refused by KV-aware admission (503; 429 for a tenant's own share)", "reason",
        )

    def pair(self, prefill: BackendState, decode: BackendState) -> Any:
        key = (prefill.name, decode.name, prefill.generation, decode.generation)
        child = self._pair_children.get(key)
        if child is None:
            child = self._pair_children[key] = self.pairs.labels(*key)
        return child

    def index_lookup(self, hit: bool) -> None:
        self._lookups += 1
        self.index_lookups.inc()
        if hit:
            self._hits += 1
            self.index_hits.inc()
        self.index_hit_ratio.set(self._hits / self._lookups)

    def watch_admission(self, admission: Any) -> None:
        """Export the KV-aware admission gate's state (a collector reading it live)."""
        self.registry.register(_AdmissionCollector(admission))

    # ------------------------------------------------------------------ tenants
    def watch_tenants(self, tenants: Any, ledger: Any = None) -> None:
        """Per-tenant series (``tenants``: a :class:`pdstack.proxy.tenants.TenantTable`;
        ``ledger``: admission's :class:`pdstack.proxy.shares.TenantLedger`, or None)."""
        r = self.registry
        self._tenant_requests = Counter(
            "pdstack_proxy_tenant_requests", "client requests by tenant and outcome",
            ["tenant", "outcome"], registry=r,
        )  # fmt: skip
        self._tenant_rejected = Counter(
            "pdstack_proxy_tenant_rejected", "requests refused by a tenant limit (429) or by "
            "admission (503), by tenant and limit", ["tenant", "limit"], registry=r,
        )  # fmt: skip
        self._tenant_tokens = Counter(
            "pdstack_proxy_tenant_tokens", "tokens used by tenant (prompt, completion)",
            ["tenant", "kind"], registry=r,
        )  # fmt: skip
        self._tenant_wait = Histogram(
            "pdstack_proxy_tenant_queue_wait_seconds", "time in KV admission's queue",
            ["tenant"], buckets=QUEUE_BUCKETS, registry=r,
        )  # fmt: skip
        r.register(_TenantCollector(tenants))
        if ledger is not None:
            r.register(_ShareCollector(tenants, ledger))
        self._tenant_children: dict[tuple[str, ...], Any] = {}

    def _tenant_child(self, metric: Any, *labels: str) -> Any:
        key = (metric._name, *labels)
        child = self._tenant_children.get(key)
        if child is None:
            child = self._tenant_children[key] = metric.labels(*labels)
        return child

    def tenant_outcome(self, tenant: str, outcome: str) -> None:
        self._tenant_child(self._tenant_requests, tenant, outcome).inc()

    def tenant_rejected(self, tenant: str, limit: str) -> None:
        self._tenant_child(self._tenant_rejected, tenant, limit).inc()

    def tenant_tokens(self, tenant: str, prompt: int, completion: int) -> None:
        self._tenant_child(self._tenant_tokens, tenant, "prompt").inc(prompt)
        if completion > 0:
            self._tenant_child(self._tenant_tokens, tenant, "completion").inc(completion)

    def tenant_waited(self, tenant: Any, seconds: float) -> None:
        if tenant is not None:
            self._tenant_child(self._tenant_wait, tenant.label).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _AdmissionCollector(Collector):
    def __init__(self, admission: Any) -> None:
        self._admission = admission

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        a = self._admission
        queued = GaugeMetricFamily("pdstack_proxy_admission_queued", "requests waiting for KV")
        queued.add_metric([], a.queued)
        waited = CounterMetricFamily(
            "pdstack_proxy_admission_waited", "requests that waited for KV headroom"
        )
        waited.add_metric([], a.admitted_after_wait)
        wait_s = CounterMetricFamily(
            "pdstack_proxy_admission_wait_seconds", "seconds requests waited for KV headroom"
        )
        wait_s.add_metric([], a.wait_seconds_sum)
        admitted = CounterMetricFamily(
            "pdstack_proxy_admission_admitted", "requests the gate let go, by why",
            labels=["reason"],
        )  # fmt: skip
        held = CounterMetricFamily(
            "pdstack_proxy_admission_held", "requests the gate held, by why", labels=["reason"]
        )
        for family, counts in ((admitted, a.admitted), (held, a.held)):
            for reason, n in sorted(counts.items()):
                family.add_metric([reason], n)
        yield from (queued, waited, wait_s, admitted, held)
        yield from _budget_series(a.budget)
        yield from _engine_gauges(a)


def _budget_series(b: Any) -> Iterator[Any]:
    """The wait budget's calibration (:mod:`pdstack.proxy.wait_budget`)."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    rate = GaugeMetricFamily(
        "pdstack_proxy_admission_first_byte_rate",
        "first bytes per busy second over the last window (0: unknown), the wait budget's rate",
    )
    rate.add_metric([], b.rate())
    prefill = GaugeMetricFamily(
        "pdstack_proxy_admission_in_prefill", "admitted requests with no first byte yet"
    )
    prefill.add_metric([], b.in_prefill)
    sums = []
    for key, value, text in (
        ("predicted", b.predicted_sum, "time to first byte the gate predicted at arrival"),
        ("actual", b.actual_sum, "actual time to first byte (arrival to first byte), of the "
         "same requests"),
    ):  # fmt: skip
        family = CounterMetricFamily(f"pdstack_proxy_admission_ttft_{key}_seconds", text)
        family.add_metric([], value)
        sums.append(family)
    ratio = HistogramMetricFamily(
        "pdstack_proxy_admission_ttft_ratio",
        "actual / predicted time to first byte of each request with a prediction",
    )
    cumulative, buckets = 0, []
    for bound, n in zip(wait_budget.RATIO_BUCKETS, b.ratio_counts, strict=True):
        cumulative += n
        buckets.append(("+Inf" if math.isinf(bound) else f"{bound:g}", cumulative))
    ratio.add_metric([], buckets, sum_value=b.ratio_sum)
    yield from (rate, prefill, *sums, ratio)


_ENGINE_GAUGES = (
    ("kv_usage", "KV usage the gate last read from the engine (0..1)"),
    ("requests_waiting", "requests waiting in the engine, as the gate last read"),
    ("requests_running", "requests running in the engine, as the gate last read"),
    ("preemptions", "the engine's preemptions so far, as the gate last read"),
    ("preempt_caution", "1 while the gate counts every output at once on the engine: it "
     "preempted within the last preempt_caution_s"),
    ("kv_capacity_tokens", "the engine's KV capacity in tokens"),
    ("kv_mark", "the gate's KV watermark on the engine now (kv_high, or above it while the "
     "engine's first bytes are fast: --admission-kv-learn-max)"),
    ("first_byte_seconds", "the engine's own time to first byte lately (the final leg's "
     "send to its first byte, EWMA)"),
    ("projected_tokens", "KV tokens the gate projects the engine will hold for what it has"),
    ("base_scale", "the engine's KV at its last scrape per token the gate estimated for the "
     "same requests (above 1: the gate undercounts; NaN: no request in that scrape)"),
    ("proxy_requests", "the proxy's requests on the engine (sent or held for it)"),
)


def _engine_gauges(a: Any) -> Iterator[Any]:
    now = time.monotonic()
    families = {
        key: GaugeMetricFamily(f"pdstack_proxy_engine_{key}", text, labels=["backend"])
        for key, text in _ENGINE_GAUGES
    }
    for name, load in a.loads.items():
        fresh = now - load.scraped_at <= a.config.stale_after_s
        mark = a.mark(name)
        values = {
            "kv_usage": load.kv_usage, "requests_waiting": load.waiting,
            "requests_running": load.running, "preemptions": load.preemptions,
            "preempt_caution": float(load.cautious(now, a.config.preempt_caution_s)),
            "kv_capacity_tokens": load.capacity_tokens, "kv_mark": mark.value,
            "first_byte_seconds": mark.first_byte_s,
            "projected_tokens": load.projected(fresh), "proxy_requests": load.active,
            "base_scale": load.base_scale if load.base else math.nan,
        }  # fmt: skip
        for key, family in families.items():
            family.add_metric([name], values[key])
    yield from families.values()


class _TenantCollector(Collector):
    def __init__(self, tenants: Any) -> None:
        self._tenants = tenants

    def collect(self) -> Iterator[Any]:
        in_flight = GaugeMetricFamily(
            "pdstack_proxy_tenant_in_flight", "requests in the proxy by tenant (queued or "
            "running)", labels=["tenant"],
        )  # fmt: skip
        queued = GaugeMetricFamily(
            "pdstack_proxy_tenant_queued", "requests in KV admission's queue by tenant",
            labels=["tenant"],
        )  # fmt: skip
        active: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for state in self._tenants.states.values():
            active[state.label] = active.get(state.label, 0) + state.active
            waiting[state.label] = waiting.get(state.label, 0) + state.queued
        for label in sorted(active):
            in_flight.add_metric([label], active[label])
            queued.add_metric([label], waiting[label])
        yield from (in_flight, queued)


class _ShareCollector(Collector):
    """What each tenant holds of the engines (KV admission's ledger), by metrics label."""

    def __init__(self, tenants: Any, ledger: Any) -> None:
        self._tenants = tenants
        self._ledger = ledger

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        ledger = self._ledger
        seconds = CounterMetricFamily(
            "pdstack_proxy_tenant_engine_seconds", "engine time of the tenant's ended "
            "requests (admission to end)", labels=["tenant"],
        )  # fmt: skip
        families = {
            "running": GaugeMetricFamily(
                "pdstack_proxy_tenant_running", "the tenant's requests on the engines",
                labels=["tenant"],
            ),
            "prefill": GaugeMetricFamily(
                "pdstack_proxy_tenant_prefill_tokens",
                "the tenant's prompt tokens admitted with no first byte yet", labels=["tenant"],
            ),
            "share": GaugeMetricFamily(
                "pdstack_proxy_tenant_engine_share", "the tenant's share of the engines while "
                "several tenants are active (1 alone)", labels=["tenant"],
            ),
        }  # fmt: skip
        sources = {
            "seconds": ledger.engine_seconds, "running": ledger.count,
            "prefill": ledger.prefill, "share": ledger.shares(),
        }  # fmt: skip
        totals: dict[str, dict[str, float]] = {k: {} for k in sources}
        states = self._tenants.states
        for kind, values in sources.items():
            for name, value in values.items():
                state = states.get(name)
                label = state.label if state is not None else name
                totals[kind][label] = totals[kind].get(label, 0.0) + value
        for label, value in sorted(totals.pop("seconds").items()):
            seconds.add_metric([label], value)
        yield seconds
        for kind, family in families.items():
            for label, value in sorted(totals[kind].items()):
                family.add_metric([label], value)
            yield family
