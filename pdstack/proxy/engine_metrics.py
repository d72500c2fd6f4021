"""An engine's ``/metrics``, read for the gate: the proxy's one parser of vLLM's series.

:func:`parse_engine_metrics` picks the few series the gate (:mod:`pdstack.proxy.kv_gate`) and
the progress watch (:mod:`pdstack.proxy.progress`) use; :func:`scrape` reads one engine into
its :class:`~pdstack.proxy.kv_gate.EngineLoad` (the base the gate's projection starts from).
"""

from __future__ import annotations

import asyncio
import math
import time

import aiohttp

from pdstack.proxy.kv_gate import EngineLoad


def parse_engine_metrics(text: str) -> dict[str, float]:
    """The few vLLM series the gate (and the proxy's progress watch,
    :mod:`pdstack.proxy.progress`) reads. Request counts are summed over label sets (an API
    server fronting data-parallel engines lists one per engine); KV usage is the fullest
    engine's (a fraction per engine: summing would pass 1 and read as percent); ``progress``
    is the sum of the engine's progress counters (prompt and generated tokens, finished
    requests: what the engine container's watchdog reads, :mod:`pdstack.sidecars.watchdog`), absent
    when it exports none. A value that is not a finite number is skipped."""
    out: dict[str, float] = {}
    wanted = {
        "vllm:kv_cache_usage_perc": "kv_usage",
        "vllm:gpu_cache_usage_perc": "kv_usage",
        "vllm:num_requests_waiting": "waiting",
        "vllm:num_requests_running": "running",
        "vllm:num_preemptions_total": "preemptions",
        "vllm:prompt_tokens_total": "progress",
        "vllm:generation_tokens_total": "progress",
        "vllm:request_success_total": "progress",
    }
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        head, _, raw_value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        if name == "vllm:cache_config_info":
            capacity, block = _capacity(rest)
            if capacity:
                out["capacity_tokens"] = float(capacity)
                out["block_size"] = float(block)
            continue
        key = wanted.get(name)
        if key is None:
            continue
        try:
            value = float(raw_value)
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        if key == "kv_usage":
            out[key] = max(out.get(key, 0.0), value)
        else:
            out[key] = out.get(key, 0.0) + value
    return out


def _capacity(rest: str) -> tuple[int, int]:
    """The engine's KV in tokens and its block size (0, 0: not read)."""
    labels = _labels(rest)
    try:
        blocks = int(float(labels.get("num_gpu_blocks", "0")))
        size = int(float(labels.get("block_size", "0")))
    except ValueError:
        return 0, 0
    return blocks * size, size


def _labels(rest: str) -> dict[str, str]:
    body = rest.split("}", 1)[0]
    labels: dict[str, str] = {}
    for part in body.split('",'):
        key, _, value = part.partition("=")
        if key:
            labels[key.strip()] = value.strip().strip('"')
    return labels



async def scrape(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    load: EngineLoad,
    timeout_s: float,
) -> bool:
    """Read one engine's ``/metrics`` into ``load`` (True when it was read). A failed or
    foreign scrape changes nothing: its last numbers age until they are stale."""
    started, streamed = time.monotonic(), load.streamed_now()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(f"{url}/metrics", headers=headers) as resp:
                if resp.status != 200:
                    return False
                text = await resp.text()
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False
    values = parse_engine_metrics(text)
    if "kv_usage" not in values:
        return False
    usage = values["kv_usage"]
    load.waiting = values.get("waiting", 0.0)
    load.running = values.get("running", 0.0)
    if "preemptions" in values:
        load.saw_preemptions(values["preemptions"], started)
    usage = usage / 100.0 if usage > 1.0 else usage
    load.rebase(
        usage,
        int(values.get("capacity_tokens", 0)),
        started,
        streamed,
        values.get("waiting"),
        int(values.get("block_size", 0)),
    )
    return True
