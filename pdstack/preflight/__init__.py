"""Network preflight: prove every path a plan needs (``pdstack preflight``).

Library use (the Ansible ``private_network`` role, scripts)::

    from pdstack.plan import make_plan
    from pdstack.topology import load_topology
    from pdstack.preflight import run_preflight

    report = run_preflight(make_plan(load_topology("inventory/lab")), timeout=3.0)
    for failure in report.failures:
        print(failure.message)          # names src, dst, port, purpose and cause
    report.to_dict()                    # the JSON of ``--json`` (schema.json)
"""

from pathlib import Path

from pdstack.preflight.report import Check, NodeReport, PreflightReport, is_private_address
from pdstack.preflight.runner import default_probe_path, run_preflight

SCHEMA_PATH = Path(__file__).with_name("schema.json")

__all__ = [
    "SCHEMA_PATH",
    "Check",
    "NodeReport",
    "PreflightReport",
    "default_probe_path",
    "is_private_address",
    "run_preflight",
]
