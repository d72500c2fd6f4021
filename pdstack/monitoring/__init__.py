"""Monitoring generated from the plan: Prometheus scrape config, recording rules and alerts,
Grafana dashboards and provisioning, for the Compose profile ``monitoring`` on the proxy's
node (see :mod:`pdstack.monitoring.targets`, :mod:`~.prometheus`, :mod:`~.dashboards`)."""

from __future__ import annotations

from typing import Any

import yaml

from pdstack.monitoring.dashboards import DATASOURCE_UID, GRAFANA_VERSION, render_dashboards
from pdstack.monitoring.prometheus import Features, render_prometheus
from pdstack.monitoring.targets import MonitoringPlan, monitoring_plan
from pdstack.plan import Plan
from pdstack.topology import DeploymentSpec

MONITORING_DIR = "monitoring"
DASHBOARDS_IN_CONTAINER = "/var/lib/pdstack-dashboards"

__all__ = ["MONITORING_DIR", "MonitoringPlan", "compose_context", "monitoring_plan",
           "render_monitoring"]


def _provisioning(mon: MonitoringPlan) -> dict[str, str]:
    head = f"# Rendered by `pdstack render`; Grafana {GRAFANA_VERSION} file provisioning.\n"
    datasources = {
        "apiVersion": 1,
        "datasources": [{
            "name": "pdstack Prometheus",
            "uid": DATASOURCE_UID,
            "type": "prometheus",
            "access": "proxy",
            "url": mon.prometheus_url,
            "isDefault": True,
            "editable": False,
        }],
    }
    providers = {
        "apiVersion": 1,
        "providers": [{
            "name": "pdstack",
            "folder": "pdstack",
            "type": "file",
            "disableDeletion": True,
            "allowUiUpdates": False,
            "options": {"path": DASHBOARDS_IN_CONTAINER},
        }],
    }
    dump = lambda doc: head + yaml.safe_dump(doc, sort_keys=False)  # noqa: E731
    return {
        "grafana/provisioning/datasources/pdstack.yaml": dump(datasources),
        "grafana/provisioning/dashboards/pdstack.yaml": dump(providers),
    }


def render_monitoring(
    d: DeploymentSpec, plan: Plan, scrape_interval_s: int | None = None
) -> dict[str, str]:
    """The proxy node's ``monitoring/`` files, by path relative to the stack directory.
    ``scrape_interval_s`` overrides the inventory's (tests scrape every second)."""
    mon = monitoring_plan(d, plan)
    files = render_prometheus(d, plan, mon, scrape_interval_s)
    files |= _provisioning(mon)
    files |= {
        f"grafana/dashboards/{name}": text
        for name, text in render_dashboards(d, Features.of(plan)).items()
    }
    return {f"{MONITORING_DIR}/{k}": v for k, v in files.items()}


def compose_context(d: DeploymentSpec, plan: Plan) -> dict[str, Any]:
    """What the compose template's ``monitoring`` profile needs."""
    mon = monitoring_plan(d, plan)
    o = d.observability
    return {
        "prometheus_image": o.prometheus_image,
        "grafana_image": o.grafana_image,
        "prometheus_url": mon.prometheus_url,
        "grafana_url": mon.grafana_url,
        "prometheus_command": [
            "--config.file=/etc/prometheus/prometheus.yml",
            "--storage.tsdb.path=/prometheus",
            f"--storage.tsdb.retention.time={o.retention}",
            f"--web.listen-address={mon.address}:{mon.prometheus_port}",
        ],
        "grafana_env": {
            "GF_SERVER_HTTP_ADDR": mon.address,
            "GF_SERVER_HTTP_PORT": str(mon.grafana_port),
            "GF_ANALYTICS_REPORTING_ENABLED": "false",
            "GF_ANALYTICS_CHECK_FOR_UPDATES": "false",
            "GF_USERS_ALLOW_SIGN_UP": "false",
            "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH":
                f"{DASHBOARDS_IN_CONTAINER}/overview.json",
        },
    }
