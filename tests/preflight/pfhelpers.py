"""Fixtures for the preflight tests: the namespaced lab (tests/lab/lab.py) and helpers
that run ``pdstack preflight`` inside the lab's controller namespace."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdstack.testing import heavy

netns_lab = heavy.netns_lab()

lab, clean_lab = netns_lab.lab_fixtures("pdpf")
Lab = netns_lab.Lab

REPO = Path(__file__).resolve().parents[2]
SCHEMA = REPO / "pdstack" / "preflight" / "schema.json"


def validator() -> Any:
    try:
        import jsonschema
    except ImportError:  # a missing prerequisite fails, never skips
        pytest.fail("jsonschema is not installed in the project venv (pip install jsonschema)",
                    pytrace=False)
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def validate_def(name: str, doc: Any) -> None:
    """Validate ``doc`` against ``schema.json``'s ``$defs/<name>``."""
    schema = json.loads(SCHEMA.read_text())
    v = validator()
    sub = {"$ref": f"#/$defs/{name}", "$defs": schema["$defs"]}
    type(v)(sub).validate(doc)


@dataclass
class Run:
    rc: int
    wall_s: float
    stdout: str
    stderr: str
    report: dict[str, Any] | None

    def checks(self, **match: Any) -> list[dict[str, Any]]:
        assert self.report is not None
        return [c for c in self.report["checks"]
                if all(c.get(k) == v for k, v in match.items())]

    def failures(self) -> list[dict[str, Any]]:
        return self.checks(status="fail")

    def explain(self) -> str:
        return f"rc={self.rc} wall={self.wall_s:.1f}s\nstdout:\n{self.stdout[-4000:]}\n" \
               f"stderr:\n{self.stderr[-4000:]}"


def run_preflight_cli(the_lab: Any, inventory: Path | str, *args: str,
                      json_out: bool = True, limit: float = 60) -> Run:
    argv = [sys.executable, "-m", "pdstack.cli", "preflight", "-i", str(inventory), *args]
    if json_out:
        argv.append("--json")
    t0 = time.monotonic()
    proc = the_lab.ctl_run(argv, timeout=limit)
    wall = time.monotonic() - t0
    report = None
    if json_out and proc.stdout.strip().startswith("{"):
        report = json.loads(proc.stdout)
        validator().validate(report)
    return Run(proc.returncode, wall, proc.stdout, proc.stderr, report)


@pytest.fixture
def lab_inventory(clean_lab: Any, tmp_path: Path) -> Iterator[Path]:
    """inventory/lab rewritten for the test lab's keys."""
    yield clean_lab.write_inventory(tmp_path / "inv")
