"""Preflight pieces that need no lab: address rules, ssh option parsing, CLI misuse (exit 2),
and the report's JSON against schema.json."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pfhelpers import REPO, validator

from pdstack.preflight import Check, NodeReport, PreflightReport, is_private_address
from pdstack.preflight.transport import _ssh_options


@pytest.mark.parametrize(("addr", "private"), [
    ("10.1.2.3", True), ("172.16.0.1", True), ("172.31.255.255", True), ("172.32.0.1", False),
    ("192.168.1.1", True), ("100.64.0.1", True), ("100.127.255.254", True), ("100.128.0.1", False),
    ("fd12:3456::1", True), ("fc00::1", True), ("8.8.8.8", False), ("198.51.100.3", False),
    ("127.0.0.1", False), ("169.254.1.1", False), ("fe80::1", False), ("2001:db8::1", False),
])
def test_private_address_rules(addr: str, private: bool) -> None:
    assert is_private_address(addr) is private


def test_ssh_options_from_ansible_common_args() -> None:
    opts = _ssh_options("-o UserKnownHostsFile=/a/kh -o StrictHostKeyChecking=yes "
                        "-oConnectTimeout=3 -o 'ProxyJump bastion'")
    assert opts == {"userknownhostsfile": "/a/kh", "stricthostkeychecking": "yes",
                    "connecttimeout": "3", "proxyjump": "bastion"}
    assert _ssh_options(None) == {}


def test_report_json_matches_schema() -> None:
    rep = PreflightReport(deployment="d", inventory="inv", timeout_s=3, ssh_timeout_s=5,
                          started_at="2026-01-01T00:00:00+00:00")
    rep.nodes["a"] = NodeReport(name="a", ssh_target="root@10.0.0.1:22")
    rep.checks.append(Check(kind="edge", status="fail", subject="a -> b 10.0.0.2:5600 (x)",
                            result="timed out", src="a", dst="b", dst_address="10.0.0.2",
                            port=5600, purpose="x", cause="timeout"))
    doc = rep.to_dict()
    validator().validate(doc)
    assert doc["ok"] is False and doc["exit_code"] == 1 and doc["summary"]["fail"] == 1
    assert doc["checks"][0]["message"] == "a -> b 10.0.0.2:5600 (x): timed out"
    # a failed edge without its cause or port does not validate
    bad = dict(doc["checks"][0], cause=None)
    with pytest.raises(Exception, match=r"None is not of type .string."):
        validator().validate(dict(doc, checks=[bad]))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdstack.cli", "preflight", *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def test_cli_misuse_exits_2(tmp_path: Path) -> None:
    res = cli("-i", str(tmp_path / "nowhere"))
    assert res.returncode == 2 and "inventory has no hosts.yml" in res.stderr
    res = cli("-i", "inventory/lab", "--timeout", "0")
    assert res.returncode == 2 and "--timeout" in res.stderr
    res = cli("-i", "inventory/lab", "--probe", str(tmp_path / "missing.py"))
    assert res.returncode == 2 and "probe script not readable" in res.stderr
    res = cli()  # -i is required
    assert res.returncode == 2
