"""Issue 14: no client or backend can stall the proxy, every error of its own is OpenAI
error JSON, usage tells the cache story. Fault tests against FakeEngine TEST DOUBLES
(pdstack.testing.fake_engine), one group per item of the issue:

1. slow clients (slow bodies, slow heads) cannot lock anyone out;
2. a hung backend costs a request its leg budget at most; ejection re-routes;
3. bad requests (engine 4xx/5xx with a passing /health) never eject a backend;
4. request bodies: size limit, bytes held at once, RSS bound, /health stays fast;
5. error shapes and input checks;
6. engine key on both legs, /health without names, admin failures rate limited;
plus usage.prompt_tokens_details.cached_tokens from the prefill leg.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from pdstack.proxy.config import ProxyConfig, load_secrets
from pdstack.proxy.routing import stable_hash
from pdstack.testing import proxy_harness as ph
from pdstack.testing.fake_engine import Faults
from pdstack.testing.vllm_engines import free_port

REPO = Path(__file__).resolve().parents[2]


def assert_openai_error(data: Any, status: int) -> dict:
    """The reply parses as OpenAI error JSON with ``code`` = the status."""
    if isinstance(data, bytes | str):
        data = json.loads(data)
    assert set(data) == {"error"}, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["code"] == status, err
    return err


async def wait_health(url: str, tries: int) -> None:
    """Poll ``url``/health every 0.1 s, at most ``tries`` times, until it answers 200."""
    async with aiohttp.ClientSession() as s:
        for _ in range(tries):
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)


async def raw_request(
    port: int, head: bytes, body: bytes = b"", timeout: float = 10.0
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 exchange over a raw socket (for what aiohttp's client will not send)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()  # may fail: it answered (and closed) before the whole body
        async with asyncio.timeout(timeout):
            status_line = await reader.readline()
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            data = await reader.readexactly(length) if length else b""
        return int(status_line.split()[1]), headers, data
    finally:
        writer.close()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


# ---------------------------------------------------------------------- 1. slow clients
async def test_slow_body_flood_does_not_lock_out_normal_requests() -> None:
    """More slow-body connections than admission slots: normal requests are still
    served (P99 < 1 s) while the flood lasts, and the flood is cut at the body timeout."""
    async with ph.engines("p0", "d0", output_tokens=4) as e:
        cfg = {"max_concurrency": 40, "body_timeout_s": 3.0}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), **cfg) as rp:
            port = port_of(rp.url)
            head = (
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000\r\n\r\n{"
            )
            flood = []
            for _ in range(100):  # 100 > 40 slots
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(head)
                flood.append((reader, writer))
            await asyncio.sleep(0.3)
            assert rp.proxy.in_flight == 0  # no slot is held by a body still arriving
            latencies = []
            for i in range(20):
                started = time.monotonic()
                res = await ph.stream_completion(rp.session, rp.url, f"normal {i}", max_tokens=4)
                latencies.append(time.monotonic() - started)
                assert res.status == 200 and res.events[-1] == "[DONE]", res.text
            latencies.sort()
            assert latencies[-1] < 1.0, latencies  # P99 of 20 = the max
            # the flood is still connected (it is within its body timeout) ...
            assert sum(1 for _, w in flood if not w.is_closing()) == 100
            # ... and is cut at the body timeout with a 408 OpenAI error
            statuses = []
            for reader, writer in flood:
                async with asyncio.timeout(10):
                    line = await reader.readline()
                statuses.append(int(line.split()[1]))
                writer.close()
            assert statuses == [408] * 100


async def test_slow_request_heads_are_closed_at_the_header_timeout() -> None:
    async with ph.engines("p0", "d0") as e:
        cfg = {"header_timeout_s": 1.0}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), **cfg) as rp:
            port = port_of(rp.url)
            conns = []
            for _ in range(50):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never ends
                conns.append((reader, writer))
            started = time.monotonic()
            for _ in range(4):  # one more header byte every 0.3 s: never a complete head
                await asyncio.sleep(0.3)
                for _, writer in conns:
                    if not writer.is_closing():
                        writer.write(b"X")
            for reader, writer in conns:
                async with asyncio.timeout(10):
                    # closed by the proxy (a reset, or a broken pipe when our last byte
                    # was written after the close: seen once on a loaded 2-core machine)
                    with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                        assert await reader.read() == b""
                writer.close()
            assert time.monotonic() - started < 6.0
            res = await ph.stream_completion(rp.session, rp.url, "still fine", max_tokens=2)
            assert res.status == 200


async def test_head_timeout_spares_bodies_streams_and_kept_alive_connections() -> None:
    """The head timeout covers the head only: a body sent in pieces, a stream that
    outlasts the timeout and a kept-alive connection between requests are untouched."""
    async with ph.engines("p0", "d0", output_tokens=8, itl_ms=200) as e:
        cfg = {"header_timeout_s": 0.5, "idle_timeout_s": 30.0}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), **cfg) as rp:
            reader, writer = await asyncio.open_connection("127.0.0.1", port_of(rp.url))
            body = json.dumps(
                {"model": "fake", "prompt": "p " * 50_000, "stream": True, "max_tokens": 8}
            ).encode()
            for _ in range(2):  # two requests on one connection
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(body)
                )
                for i in range(0, len(body), 20_000):  # the body in pieces, 0.1 s apart
                    writer.write(body[i : i + 20_000])
                    await writer.drain()
                    await asyncio.sleep(0.1)
                async with asyncio.timeout(20):
                    assert (await reader.readline()).startswith(b"HTTP/1.1 200")
                    text = b""
                    while not text.endswith(b"0\r\n\r\n"):  # ~1.6 s of stream, > 0.5 s
                        chunk = await reader.read(65536)
                        assert chunk, "connection closed mid-stream"
                        text += chunk
                    assert b"data: [DONE]" in text
                await asyncio.sleep(1.0)  # idle between requests: longer than the head timeout
            writer.close()


async def test_idle_keepalive_connection_closed() -> None:
    async with (
        ph.engines("p0", "d0") as e,
        ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), idle_timeout_s=0.5) as rp,
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(rp.url))
        async with asyncio.timeout(10):
            assert await reader.read() == b""  # nothing sent: closed at the idle timeout
        writer.close()


# ---------------------------------------------------------------------- 2. hung backends
async def test_hung_prefiller_requests_succeed_elsewhere_within_budget() -> None:
    """p0 accepts and never answers (its /health still passes): a request routed there
    waits at most its budget, then p1 serves it; after eject_after timeouts p0 is out
    and its other pending requests are re-routed at once."""
    async with ph.engines("p0", "p1", "d0", output_tokens=3) as e:
        e["p0"].faults = Faults(hang=True)
        cfg = {"leg_budget_base_s": 1.5, "leg_budget_per_1k_tokens_s": 0.0, "eject_after": 3}
        async with ph.running_proxy(ph.pd_table(e, ["p0", "p1"], ["d0"]), **cfg) as rp:

            async def one(i: int) -> float:
                started = time.monotonic()
                res = await ph.stream_completion(rp.session, rp.url, f"prompt {i}", max_tokens=3)
                assert res.status == 200 and res.events[-1] == "[DONE]", res.text
                return time.monotonic() - started

            latencies = await asyncio.gather(*(one(i) for i in range(16)))
            text = await rp.metrics()
    assert len(e["p0"].seen()) >= 3  # some requests did go to the hung prefiller
    assert ph.metric_value(text, "pdstack_proxy_ejections_total", backend="p0") == 1
    assert max(latencies) < 1.5 + 2.0, latencies  # the budget + generous service margin
    assert len(e["p1"].seen()) == 16


async def test_frozen_prefiller_ejected_at_first_timeout_and_pending_rerouted(tmp_path) -> None:
    """A SIGSTOPped prefiller: the first timed-out request makes it suspected, its
    /health fails, it is ejected at once, and the requests waiting on it are re-routed
    then (well before their own budget ends)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdstack.testing.fake_engine", "--port", str(port), "--name", "p0"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        async with ph.engines("p1", "d0", output_tokens=3) as e:
            url = f"http://127.0.0.1:{port}"
            await wait_health(url, tries=100)
            t = ph.table(
                "nixl",
                [
                    {"name": "p0", "role": "prefill", "node": "n1", "url": url, "generation": "g1"},
                    ph.backend("p1", "prefill", e["p1"]),
                    ph.backend("d0", "decode", e["d0"]),
                ],
            )
            budget = 4.0
            cfg = {
                "leg_budget_base_s": budget,
                "leg_budget_per_1k_tokens_s": 0.0,
                "health_interval_s": 60.0,
                "health_timeout_s": 0.5,
                "eject_after": 100,
            }
            async with ph.running_proxy(t, **cfg) as rp:
                # prompts that the affinity ring sends to p0
                pick = rp.proxy._pick_affinity
                prompts = [
                    f"q{i}"
                    for i in range(400)
                    if getattr(pick("prefill", stable_hash(f"q{i}"), set()), "name", "") == "p0"
                ][:6]
                assert len(prompts) == 6
                os.kill(proc.pid, signal.SIGSTOP)

                async def one(prompt: str, delay: float) -> float:
                    await asyncio.sleep(delay)
                    started = time.monotonic()
                    res = await ph.stream_completion(rp.session, rp.url, prompt, max_tokens=3)
                    assert res.status == 200 and res.events[-1] == "[DONE]", res.text
                    return time.monotonic() - started

                first = asyncio.ensure_future(one(prompts[0], 0.0))
                later = [asyncio.ensure_future(one(p, budget - 1.5)) for p in prompts[1:]]
                first_latency = await first
                later_latencies = await asyncio.gather(*later)
                ejected = not rp.registry.backends["p0"].healthy
                text = await rp.metrics()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(10)
    assert ejected
    assert ph.metric_value(text, "pdstack_proxy_ejections_total", backend="p0") == 1
    assert budget <= first_latency < budget + 3.0
    # started 2.5 s before the eject, re-routed then: well below their own 4 s budget
    assert max(later_latencies) < budget - 0.5, later_latencies


async def test_hung_only_decoder_answers_504_within_budget() -> None:
    async with ph.engines("p0", "d0") as e:
        e["d0"].faults = Faults(hang=True)
        cfg = {"leg_budget_base_s": 1.0, "leg_budget_per_1k_tokens_s": 0.0}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), **cfg) as rp:
            started = time.monotonic()
            res = await ph.stream_completion(rp.session, rp.url, "hello")
            elapsed = time.monotonic() - started
    assert res.status == 504
    err = assert_openai_error(res.text, 504)
    assert "timed out after 1s" in err["message"]
    assert elapsed < 1.0 + 2.0


def test_leg_budget_grows_with_the_prompt() -> None:
    from pdstack.proxy.limits import LegBudget

    budget = LegBudget()
    six_k = budget.for_chars(6000 * 4)
    assert budget.for_chars(0) == 15.0
    assert 20.0 < six_k <= 60.0  # seconds, not minutes
    assert budget.for_chars(100_000 * 4) > six_k


# ---------------------------------------------------------------------- 3. bad requests
async def test_bad_requests_never_eject_a_backend() -> None:
    """100 requests that make engines answer 500 (prefill leg) or 400 (decode leg) while
    their /health passes: each goes back to its client as the engine answered, never
    retried, no ejection; the 50 good requests meanwhile all succeed."""
    async with ph.engines("p0", "p1", "d0", "d1", output_tokens=3) as e:
        for name in ("p0", "p1"):
            e[name].faults = Faults(poison="POISON500", poison_status=500)
        for name in ("d0", "d1"):
            e[name].faults = Faults(poison="POISON400", poison_status=400)
        async with ph.running_proxy(ph.pd_table(e, ["p0", "p1"], ["d0", "d1"])) as rp:
            sem = asyncio.Semaphore(10)

            async def one(i: int) -> tuple[str, int, str]:
                kind = ("POISON500", "POISON400", "good")[i % 3]
                async with sem:
                    res = await ph.stream_completion(
                        rp.session, rp.url, f"{kind} {i}", max_tokens=3
                    )
                return kind, res.status, res.text

            results = await asyncio.gather(*(one(i) for i in range(150)))
            text = await rp.metrics()
            healthy = all(b.healthy for b in rp.registry.backends.values())
    by_kind: dict[str, list[tuple[int, str]]] = {}
    for kind, status, body in results:
        by_kind.setdefault(kind, []).append((status, body))
    assert [s for s, _ in by_kind["POISON500"]] == [500] * 50
    assert [s for s, _ in by_kind["POISON400"]] == [400] * 50
    for status, body in by_kind["POISON500"] + by_kind["POISON400"]:
        assert "poisoned request at" in assert_openai_error(body, status)["message"]
    assert [s for s, _ in by_kind["good"]] == [200] * 50
    assert healthy
    assert ph.metric_value(text, "pdstack_proxy_ejections_total") == 0
    assert ph.metric_value(text, "pdstack_proxy_retries_total") == 0
    assert len(e["p0"].seen()) + len(e["p1"].seen()) == 150  # each tried once
    assert len(e["d0"].seen()) + len(e["d1"].seen()) == 100


async def test_engine_4xx_passes_through_uncounted() -> None:
    async with (
        ph.engines("p0", "d0") as e,
        ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), eject_after=1) as rp,
    ):
        e["d0"].faults = Faults(poison="bad", poison_status=400)
        for _ in range(5):
            res = await ph.stream_completion(rp.session, rp.url, "bad input")
            assert res.status == 400
            assert_openai_error(res.text, 400)
        assert rp.registry.backends["d0"].healthy
        assert rp.registry.backends["d0"].consecutive_failures == 0
    assert len(e["d0"].seen()) == 5


# ---------------------------------------------------------------------- 4. big bodies
def _rss_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(key)


async def test_big_bodies_bounded_memory_and_health_stays_fast() -> None:
    """3 x 60 MB bodies at once against a proxy process: each is refused (413, over
    --max-body-mb) without being held, the proxy's peak RSS stays within its documented
    bound (idle + 4 x --max-body-held-mb), and /health answers in < 100 ms meanwhile."""
    async with ph.engines("p0", "d0") as e:
        port = free_port()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdstack.cli",
                "proxy",
                "--prefill",
                e["p0"].url,
                "--decode",
                e["d0"].url,
                "--kv-mode",
                "nixl",
                "--port",
                str(port),
                "--max-body-held-mb",
                "24",
                "--env-file",
                os.devnull,
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            await wait_health(url, tries=200)
            async with aiohttp.ClientSession() as s:
                idle = _rss_kib(proc.pid, "VmRSS")
                body = b'{"model":"fake","prompt":"' + b"w " * 30_000_000 + b'"}'
                assert len(body) > 60_000_000
                health_ms: list[float] = []
                stop = asyncio.Event()

                async def poll_health() -> None:
                    while not stop.is_set():
                        started = time.monotonic()
                        async with s.get(url + "/health") as r:
                            assert r.status == 200
                            await r.read()
                        health_ms.append((time.monotonic() - started) * 1000)
                        await asyncio.sleep(0.01)

                async def big(chunked: bool) -> tuple[int, bytes]:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    framing = (
                        b"Transfer-Encoding: chunked"
                        if chunked
                        else b"Content-Length: %d" % len(body)
                    )
                    writer.write(
                        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Type: application/json\r\n" + framing + b"\r\n\r\n"
                    )

                    async def send() -> None:
                        with_size = (
                            (lambda c: b"%x\r\n%b\r\n" % (len(c), c)) if chunked else (lambda c: c)
                        )
                        for i in range(0, len(body), 1 << 20):
                            writer.write(with_size(body[i : i + (1 << 20)]))
                            await writer.drain()

                    sender = asyncio.ensure_future(send())
                    try:
                        async with asyncio.timeout(60):
                            status = int((await reader.readline()).split()[1])
                            rest = await reader.read()
                    finally:
                        sender.cancel()
                        writer.close()
                    return status, rest.split(b"\r\n\r\n", 1)[1]

                # the same polling without the bodies first: what this host's load alone costs
                poller = asyncio.ensure_future(poll_health())
                await asyncio.sleep(2.0)
                stop.set()
                await poller
                quiet_ms, health_ms = sorted(health_ms), []
                stop.clear()
                poller = asyncio.ensure_future(poll_health())
                results = await asyncio.gather(big(False), big(False), big(True))
                stop.set()
                await poller
                peak = _rss_kib(proc.pid, "VmHWM")
        finally:
            proc.terminate()
            proc.wait(10)
    assert [status for status, _ in results] == [413, 413, 413]
    for _, rest in results:
        err = assert_openai_error(rest, 413)
        assert err["param"] == "body"
    # < 100 ms (P99), or, on a host so loaded that polling alone exceeds that, at most
    # 50 ms above what the same polling measured without the bodies; and never near the
    # old stall (564 ms per 60 MB body)
    health_ms.sort()
    assert len(health_ms) >= 20 and len(quiet_ms) >= 20
    p99 = health_ms[int(len(health_ms) * 0.99) - 1]
    quiet_p99 = quiet_ms[int(len(quiet_ms) * 0.99) - 1]
    assert p99 < max(100.0, quiet_p99 + 50.0), (p99, quiet_p99, health_ms[-5:])
    assert health_ms[-1] < 400.0, health_ms[-5:]
    assert peak - idle < 4 * 24 * 1024, (idle, peak)


async def test_bytes_held_at_once_are_capped_with_503_retry_after() -> None:
    async with ph.engines("p0", "d0", output_tokens=2) as e:
        cfg = {"max_body_bytes": 8 << 20, "max_body_bytes_held": 6 << 20}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), **cfg) as rp:
            port = port_of(rp.url)
            # one 3 MiB body arriving slowly holds half of the budget
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            part = b"x" * (3 << 20)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Length: %d\r\n\r\n" % (len(part) + 1000) + part
            )
            await writer.drain()
            for _ in range(100):
                if rp.proxy.body_budget.held >= 3 << 20:
                    break
                await asyncio.sleep(0.05)
            assert rp.proxy.body_budget.held >= 3 << 20
            # a second 4 MiB one does not fit: 503 + Retry-After, OpenAI JSON
            big = json.dumps({"model": "fake", "prompt": "y " * (2 << 20)}).encode()
            async with rp.session.post(
                rp.url + "/v1/completions", data=big, headers={"Content-Type": "application/json"}
            ) as resp:
                assert resp.status == 503
                assert resp.headers["Retry-After"] == "1"
                assert_openai_error(await resp.read(), 503)
            # small requests still fit
            res = await ph.stream_completion(rp.session, rp.url, "small", max_tokens=2)
            assert res.status == 200
            writer.close()
            for _ in range(100):
                if rp.proxy.body_budget.held == 0:
                    break
                await asyncio.sleep(0.05)
            assert rp.proxy.body_budget.held == 0  # given back when the request ends


# ---------------------------------------------------------------------- 5. error shapes
async def test_every_error_reply_is_openai_json() -> None:
    async with ph.engines("p0", "d0", output_tokens=2) as e:
        cfg = {"api_keys": frozenset({"client-key"}), "max_body_bytes": 1 << 20}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), **cfg) as rp:
            port = port_of(rp.url)
            auth = b"Authorization: Bearer client-key\r\n"

            def post(body: bytes, extra: bytes = b"") -> bytes:
                return (
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    + auth
                    + extra
                    + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                )

            good = json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 2}).encode()
            # a non-ASCII request id: served, with a fresh id
            status, headers, data = await raw_request(
                port, post(good, "X-Request-Id: abc\u20ac\r\n".encode()), good
            )
            assert status == 200 and headers["x-request-id"] != "abc\u20ac"
            assert len(headers["x-request-id"]) <= 128
            # an 8,000-character id: not forwarded, not echoed
            status, headers, _ = await raw_request(
                port, post(good, b"X-Request-Id: " + b"a" * 8000 + b"\r\n"), good
            )
            assert status == 200 and len(headers["x-request-id"]) <= 128
            assert all(len(r.request_id or "") <= 128 for r in e["d0"].seen())
            # a valid id is kept on both legs and the response
            status, headers, _ = await raw_request(
                port, post(good, b"X-Request-Id: my-id-1\r\n"), good
            )
            assert headers["x-request-id"] == "my-id-1"
            assert e["p0"].seen()[-1].request_id == e["d0"].seen()[-1].request_id == "my-id-1"

            cases: list[tuple[int, bytes, bytes, str | None]] = [
                (400, post(b"{not json"), b"{not json", None),
                (400, post(b"[1]"), b"[1]", None),
                (413, post(b"x" * (2 << 20)), b"x" * (2 << 20), "body"),
                (
                    401,
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n",
                    b"{}",
                    None,
                ),
                (404, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", b"", None),
                (405, b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", b"", None),
                (400, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", b"", None),
                (403, b"GET /admin/backends HTTP/1.1\r\nHost: x\r\n\r\n", b"", None),
            ]
            for field, value in (
                ("stream", "false"),
                ("max_tokens", "5"),
                ("max_tokens", 0),
                ("prompt", 5),
                ("model", 3),
            ):
                body = json.dumps({"model": "fake", "prompt": "hi", field: value}).encode()
                cases.append((400, post(body), body, field))
            chat = json.dumps({"model": "fake", "messages": "hi"}).encode()
            cases.append(
                (
                    400,
                    post(chat).replace(b"/v1/completions", b"/v1/chat/completions"),
                    chat,
                    "messages",
                )
            )
            unknown = json.dumps({"model": "gpt-4", "prompt": "hi"}).encode()
            cases.append((404, post(unknown), unknown, "model"))
            rp.proxy.config.admin_token = None
            for want, head, body, param in cases:
                status, headers, data = await raw_request(port, head, body)
                assert status == want, (head[:60], status, data[:200])
                assert headers["content-type"].startswith("application/json"), head[:60]
                err = assert_openai_error(data, want)
                if param is not None:
                    assert err["param"] == param, err
                    if want == 400:
                        assert f"'{param}'" in err["message"]
            status, _, data = await raw_request(port, post(unknown), unknown)
            assert json.loads(data)["error"]["message"] == "The model `gpt-4` does not exist."
    # nothing invalid reached an engine
    assert all(r.body and r.body.get("model") == "fake" for r in e["p0"].seen())


async def test_429_502_503_are_openai_json() -> None:
    async with (
        ph.engines("p0", "d0", output_tokens=2) as e,
        ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), max_concurrency=0) as rp,
    ):
        res = await ph.stream_completion(rp.session, rp.url, "x")
        assert res.status == 429 and res.headers["Retry-After"] == "1"
        assert_openai_error(res.text, 429)
        rp.proxy.config.max_concurrency = 10
        e["d0"].faults = Faults(close_after_chunks=0)
        res = await ph.stream_completion(rp.session, rp.url, "x")
        assert res.status == 502
        assert_openai_error(res.text, 502)
        rp.registry.backends["d0"].drained = True
        res = await ph.stream_completion(rp.session, rp.url, "x")
        assert res.status == 503
        assert_openai_error(res.text, 503)


# ---------------------------------------------------------------------- 6. keys, /health
async def test_engine_key_sent_on_both_legs_and_engines_refuse_without_it() -> None:
    config = load_secrets(ProxyConfig(), None, {"VLLM_API_KEY": "engine-secret"})
    assert config.engine_api_key == "engine-secret"
    assert "engine-secret" not in repr(config)
    async with ph.engines("p0", "d0", output_tokens=2, api_key="engine-secret") as e:
        async with aiohttp.ClientSession() as s:
            body = {"model": "fake", "prompt": "hi"}
            async with s.post(e["d0"].url + "/v1/completions", json=body) as r:
                assert r.status == 401  # the private network alone is not enough
        async with ph.running_proxy(
            ph.pd_table(e, ["p0"], ["d0"]), engine_api_key="engine-secret"
        ) as rp:
            res = await ph.stream_completion(rp.session, rp.url, "hi", max_tokens=2)
            assert res.status == 200 and res.events[-1] == "[DONE]"
            async with rp.session.get(rp.url + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "fake"
    for name in ("p0", "d0"):
        assert e[name].seen()[-1].headers["authorization"] == "Bearer engine-secret"


async def test_health_hides_backends_and_admin_failures_are_rate_limited() -> None:
    async with ph.engines("p0", "d0") as e:
        cfg = {"admin_auth_failures_per_min": 5}
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"]), **cfg) as rp:
            async with rp.session.get(rp.url + "/health") as r:
                assert r.status == 200 and await r.json() == {"status": "ok"}
            async with rp.session.get(rp.url + "/health", headers=rp.admin_headers()) as r:
                full = await r.json()
            assert full["status"] == "ok" and set(full["backends"]) == {"p0", "d0"}
            e["d0"].faults.health_status = 503  # the only decoder: nothing routable
            for _ in range(50):
                async with rp.session.get(rp.url + "/health") as r:
                    if r.status == 503:
                        assert await r.json() == {"status": "degraded"}
                        break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("never degraded")
            bad = {"Authorization": "Bearer wrong"}
            for _ in range(5):
                async with rp.session.get(rp.url + "/admin/backends", headers=bad) as r:
                    assert r.status == 401
                    assert_openai_error(await r.read(), 401)
            for headers in (bad, rp.admin_headers()):  # blocked, even with the right token
                async with rp.session.get(rp.url + "/admin/backends", headers=headers) as r:
                    assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
                    assert_openai_error(await r.read(), 429)
            rp.proxy.admin_failures._failures.clear()  # the window passes
            async with rp.session.get(
                rp.url + "/admin/backends", headers={"Authorization": f"Bearer {ph.ADMIN_TOKEN}"}
            ) as r:
                assert r.status == 200


# ---------------------------------------------------------------------- usage
async def test_cached_tokens_come_from_the_prefill_leg() -> None:
    async with (
        ph.engines("p0", "d0", output_tokens=2) as e,
        ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"])) as rp,
    ):
        prompt = "one two three four five six"
        usages = []
        for _ in range(2):
            res = await ph.stream_completion(
                rp.session, rp.url, prompt, max_tokens=2, stream_options={"include_usage": True}
            )
            assert res.status == 200
            assert ph.completion_text(res.events)
            (usage,) = [
                json.loads(ev)["usage"]
                for ev in res.events
                if ev.startswith("{") and json.loads(ev).get("usage")
            ]
            usages.append(usage)
        async with rp.session.post(
            rp.url + "/v1/completions", json={"model": "fake", "prompt": prompt, "max_tokens": 2}
        ) as r:
            unary = (await r.json())["usage"]
        async with rp.session.post(
            rp.url + "/v1/completions",
            json={"model": "fake", "prompt": "a new prompt", "max_tokens": 2},
        ) as r:
            fresh = (await r.json())["usage"]
    # the decoder got all KV from the prefiller (it reports 6 cached); the client is told
    # what the prefiller had in its cache: nothing the first time, all of it after
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 6]
    assert unary["prompt_tokens_details"]["cached_tokens"] == 6
    assert fresh["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[0]["prompt_tokens"] == 6
