"""The real processes: ``pdstack proxy`` (CLI) in front of FakeEngine test-double processes.

Acceptance: 1,000 concurrent streaming requests through the proxy complete without error
on this 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from pdstack.testing.http import wait_http
from pdstack.testing.ports import free_port
from pdstack.testing.proxy_harness import completion_text, stream_completion

REPO = Path(__file__).resolve().parents[2]
PDSTACK = [sys.executable, "-m", "pdstack.cli"]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[dict[str, str]]:
    """1 prefiller + 2 decoders (fake engine processes) + the proxy process, nixl mode."""
    procs: list[subprocess.Popen] = []
    ports = {name: free_port() for name in ("p0", "d0", "d1", "proxy")}
    env = {**os.environ, "PDSTACK_ADMIN_TOKEN": "cli-test-token"}
    try:
        for name in ("p0", "d0", "d1"):
            cmd = [
                sys.executable,
                "-m",
                "pdstack.testing.fake_engine",
                "--port",
                str(ports[name]),
                "--name",
                name,
                "--no-record",
                "--output-tokens",
                "16",
                "--ttft-ms",
                "20" if name.startswith("d") else "5",
                "--itl-ms",
                "10",
            ]
            log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=log, cwd=REPO))
        cmd = [
            *PDSTACK,
            "proxy",
            "--kv-mode",
            "nixl",
            "--prefill",
            f"http://127.0.0.1:{ports['p0']}",
            "--decode",
            f"http://127.0.0.1:{ports['d0']}",
            f"http://127.0.0.1:{ports['d1']}",
            "--port",
            str(ports["proxy"]),
            "--log-level",
            "WARNING",
        ]
        log = open(tmp_path / "proxy.log", "w")  # noqa: SIM115
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=log, cwd=REPO, env=env))
        for name in ("p0", "d0", "d1"):
            wait_http(f"http://127.0.0.1:{ports[name]}/health", timeout=30.0)
        wait_http(f"http://127.0.0.1:{ports['proxy']}/health", timeout=30.0)
        yield {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


async def test_cli_proxy_thousand_concurrent_streams(stack: dict[str, str]) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=180)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.monotonic()
        results = await asyncio.gather(
            *(
                stream_completion(session, stack["proxy"], f"system prompt {i % 5} user {i}")
                for i in range(1000)
            )
        )
        elapsed = time.monotonic() - started
        async with session.get(f"{stack['proxy']}/metrics") as resp:
            metrics = await resp.text()
        async with session.get(
            f"{stack['proxy']}/admin/backends", headers={"Authorization": "Bearer cli-test-token"}
        ) as resp:
            admin = await resp.json()
    problems = Counter(
        (r.status, r.error_events[0]["message"] if r.error_events else r.text[:200])
        for r in results
        if r.status != 200 or r.events[-1] != "[DONE]" or r.error_events
    )
    assert not problems, problems.most_common(5)
    assert all(len(completion_text(r.events).split()) == 16 for r in results)
    assert 'pdstack_proxy_requests_total{outcome="ok"} 1000.0' in metrics
    served = {b["name"]: b["served"] for b in admin["backends"]}
    assert served["local/decode-0"] + served["local/decode-1"] == 1000
    assert min(served["local/decode-0"], served["local/decode-1"]) > 300
    print(f"1000 streams through the proxy in {elapsed:.1f}s; decoders served {served}")


async def test_cli_rejects_missing_sources() -> None:
    proc = await asyncio.create_subprocess_exec(
        *PDSTACK,
        "proxy",
        "--port",
        "1",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=REPO,
    )
    out, _ = await proc.communicate()
    assert proc.returncode != 0
    assert b"exactly one of -i, --backends, --prefill/--decode" in out


def _parse(argv: list[str]) -> argparse.Namespace:
    from pdstack.cli import build_parser

    return build_parser(only="proxy").parse_args(["proxy", *argv])


def test_cli_backend_sources(tmp_path: Path) -> None:
    from pdstack.plan import make_plan
    from pdstack.proxy.backends import BackendRegistry
    from pdstack.proxy.cli import backend_table_from_args, config_from_args
    from pdstack.topology import load_topology

    inv = REPO / "inventory" / "sample"
    from_inventory = backend_table_from_args(_parse(["-i", str(inv)]))
    assert from_inventory == make_plan(load_topology(inv)).backend_table
    registry = BackendRegistry.from_table(from_inventory)
    assert registry.kv_mode == from_inventory.kv_mode
    assert set(registry.backends) == {b.name for b in from_inventory.backends}

    path = tmp_path / "backends.json"
    path.write_text(from_inventory.model_dump_json())
    assert backend_table_from_args(_parse(["--backends", str(path)])) == from_inventory

    adhoc = backend_table_from_args(
        _parse(
            [
                "--prefill",
                "http://127.0.0.1:1",
                "--decode",
                "http://127.0.0.1:2",
                "http://127.0.0.1:3",
                "--kv-mode",
                "shared-l1",
            ]
        )
    )
    assert [b.role for b in adhoc.backends] == ["prefill", "decode", "decode"]
    assert len(adhoc.pairings) == 2

    env_file = tmp_path / "secrets.env"
    env_file.write_text("PDSTACK_ADMIN_TOKEN=from-file\n")
    args = _parse(
        [
            "--prefill",
            "http://x:1",
            "--decode",
            "http://x:2",
            "--kv-mode",
            "nixl",
            "--env-file",
            str(env_file),
            "--max-concurrency",
            "7",
        ]
    )
    config = config_from_args(args)
    assert config.max_concurrency == 7 and config.host == "127.0.0.1"
    assert config.admin_token == (os.environ.get("PDSTACK_ADMIN_TOKEN") or "from-file")
    # no flag takes a secret
    assert not {"admin_token", "token", "api_key", "api_keys", "engine_api_key"} & set(vars(args))
