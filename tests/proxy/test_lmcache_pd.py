"""kv_mode lmcache-pd: LMCache's legacy P/D push (disagg_spec + ZMQ ProxyNotif).

Against FakeEngine test doubles that send a real ZMQ PUSH ProxyNotif, encoded as
LMCache 0.5.x encodes it; no real LMCache engine runs here.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from pdstack.proxy.backends import BackendRegistry
from pdstack.proxy.cli import parse_receiver
from pdstack.proxy.lmcache_pd import decode_notif, disagg_spec, encode_notif
from pdstack.testing import proxy_harness as ph
from pdstack.testing.fake_engine import Faults

REPO = Path(__file__).resolve().parents[2]
RX0 = {"host": "127.0.0.1", "init_ports": [7302], "alloc_ports": [7303]}
RX1 = {"host": "127.0.0.2", "init_ports": [7304, 7306], "alloc_ports": [7305, 7307]}  # TP 2
NOTIFY = "pdstack_proxy_lmcache_pd_notify_total"
# msgspec.msgpack.encode(ProxyNotif(req_id="abc")) with LMCache 0.5.6's own classes
# (lmcache.v1.storage_backend.pd_backend_async and .pd_backend), printed in .venv-vllm
LMCACHE_ABC = bytes.fromhex("82a474797065aa50726f78794e6f746966a67265715f6964a3616263")


def lmpd_table(engines_by_name: dict, prefill: list[str], decode: dict[str, dict | None]) -> dict:
    backends = [ph.backend(p, "prefill", engines_by_name[p]) for p in prefill]
    for name, rx in decode.items():
        b = ph.backend(name, "decode", engines_by_name[name])
        if rx is not None:
            b["lmcache_pd"] = rx
        backends.append(b)
    return {
        "kv_mode": "lmcache-pd",
        "served_model_name": "fake",
        "backends": backends,
        "pairings": [
            {"prefill": p, "decode": d, "kv_path": "lmcache-pd"} for p in prefill for d in decode
        ],
        "lmcache_pd_notify": {"host": "127.0.0.1", "port": 0},  # 0: any free port (tests)
    }


class FirstChoice(random.Random):
    """p2c always takes the first candidate (deterministic decoder choice)."""

    def randrange(self, *args, **kwargs):  # type: ignore[override]
        return 0


def point_prefillers_at_proxy(e: dict, rp, *names: str) -> None:
    port = rp.proxy.notifier.port
    for name in names:
        e[name].lmcache_pd_notify = f"127.0.0.1:{port}"


# --------------------------------------------------------------------------- wire format


def test_proxy_notif_bytes_are_lmcaches() -> None:
    # tagged msgspec struct = msgpack map {"type": "ProxyNotif", "req_id": <str>}
    hand = b"\x82\xa4type\xaaProxyNotif\xa6req_id\xa3abc"
    assert encode_notif("abc") == hand == LMCACHE_ABC
    assert decode_notif(LMCACHE_ABC) == "abc"
    long_id = "x" * 40  # str8 (0xd9) once past 31 bytes
    assert decode_notif(encode_notif(long_id)) == long_id
    assert encode_notif(long_id).endswith(b"\xd9\x28" + long_id.encode())

    class PDMsgBase(msgspec.Struct, tag=True):
        pass

    class AllocResponse(PDMsgBase):
        remote_indexes: list[int]

    with pytest.raises(ValueError):
        decode_notif(msgspec.msgpack.encode(AllocResponse([1])))
    with pytest.raises(ValueError):
        decode_notif(b"\x01")


@pytest.mark.vllm
def test_proxy_notif_bytes_match_installed_lmcache() -> None:
    python = Path(os.environ.get("PDSTACK_VLLM_VENV", REPO / ".venv-vllm")) / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no {python}")
    code = (
        "import msgspec, sys\n"
        "from lmcache.v1.storage_backend.pd_backend_async import ProxyNotif as A\n"
        "from lmcache.v1.storage_backend.pd_backend import ProxyNotif as S\n"
        "for cls in (A, S):\n"
        "    sys.stdout.write(msgspec.msgpack.encode(cls(req_id=sys.argv[1])).hex() + '\\n')\n"
    )
    out = subprocess.run(
        [str(python), "-c", code, "req-ü-1"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    a, s = out.stdout.split()
    assert bytes.fromhex(a) == bytes.fromhex(s) == encode_notif("req-ü-1")


def test_disagg_spec_shape_and_receiver_parsing() -> None:
    assert disagg_spec("r1", RX1) == {
        "disagg_spec": {
            "req_id": "r1",
            "receiver_host": "127.0.0.2",
            "receiver_init_port": [7304, 7306],
            "receiver_alloc_port": [7305, 7307],
        }
    }
    assert parse_receiver("127.0.0.2:7304,7306:7305,7307") == RX1
    assert parse_receiver("[::1]:7302:7303") == {
        "host": "::1",
        "init_ports": [7302],
        "alloc_ports": [7303],
    }
    with pytest.raises(SystemExit):
        parse_receiver("127.0.0.1:7302")
    with pytest.raises(SystemExit):
        parse_receiver("127.0.0.1:7302,7304:7303")


def test_registry_keeps_receivers_and_standins_inherit_them() -> None:
    t = {
        "kv_mode": "lmcache-pd",
        "backends": [
            {"name": "p0", "role": "prefill", "url": "http://127.0.0.1:1"},
            {"name": "d0", "role": "decode", "url": "http://127.0.0.1:2", "lmcache_pd": RX0},
        ],
        "pairings": [{"prefill": "p0", "decode": "d0", "kv_path": "lmcache-pd"}],
        "lmcache_pd_notify": {"host": "127.0.0.1", "port": 7299},
    }
    reg = BackendRegistry.from_table(t)
    assert reg.backends["d0"].lmcache_pd == RX0
    assert reg.to_json()["lmcache_pd_notify"] == {"host": "127.0.0.1", "port": 7299}
    standin = reg.upsert({"name": "d0-standin", "role": "decode", "url": "http://127.0.0.1:2"})
    assert standin.lmcache_pd == RX0
    replaced = reg.upsert({"name": "d0", "role": "decode", "url": "http://127.0.0.1:3"})
    assert replaced.lmcache_pd == RX0
    bad = {"name": "d9", "role": "decode", "url": "http://x:1", "lmcache_pd": {"host": "h"}}
    with pytest.raises(ValueError, match="init_ports"):
        reg.upsert(bad)


# --------------------------------------------------------------------------- flow


async def test_prefill_names_the_decoder_and_decode_waits_for_the_notify() -> None:
    async with ph.engines("p0", "d0", "d1", output_tokens=5) as e:
        e["p0"].lmcache_pd_notify_delay_ms = 300
        t = lmpd_table(e, ["p0"], {"d0": RX0, "d1": RX1})
        async with ph.running_proxy(t) as rp:
            point_prefillers_at_proxy(e, rp, "p0")
            ids = [f"req-lm-{i}" for i in range(6)]
            results = await asyncio.gather(
                *(
                    ph.stream_completion(
                        rp.session,
                        rp.url,
                        f"prompt {i} " * 20,
                        headers={"X-Request-Id": rid},
                        max_tokens=4,
                    )
                    for i, rid in enumerate(ids)
                )
            )
            metrics = await rp.metrics()
            direct = await ph.stream_completion(
                rp.session, e["d0"].url, "prompt 0 " * 20, max_tokens=4
            )
    assert all(r.status == 200 and r.events[-1] == "[DONE]" for r in results)
    assert ph.completion_text(results[0].events) == ph.completion_text(direct.events)
    notified = dict(e["p0"].lmcache_pd_notified)
    assert set(notified) == set(ids)
    receivers = {"d0": RX0, "d1": RX1}
    for rid in ids:
        (pre,) = [r for r in e["p0"].seen() if r.request_id == rid]
        assert pre.body["max_tokens"] == 1 and pre.body["stream"] is False
        spec = pre.body["kv_transfer_params"]["disagg_spec"]
        assert spec["req_id"] == rid
        decs = [(n, r) for n in ("d0", "d1") for r in e[n].seen() if r.request_id == rid]
        assert len(decs) == 1, "one decode leg, on one decoder"
        name, dec = decs[0]
        rx = receivers[name]
        assert spec == {
            "req_id": rid,
            "receiver_host": rx["host"],
            "receiver_init_port": rx["init_ports"],
            "receiver_alloc_port": rx["alloc_ports"],
        }
        assert dec.received_at >= notified[rid], "decode leg went before the KV was in"
        assert dec.received_at - pre.received_at >= 0.29
        assert "kv_transfer_params" not in dec.body
        assert dec.body["max_tokens"] == 4 and dec.body["stream"] is True
    assert ph.metric_value(metrics, NOTIFY, outcome="received") == 6
    assert ph.metric_value(metrics, NOTIFY, outcome="timeout") == 0
    assert ph.metric_value(metrics, "pdstack_proxy_lmcache_pd_notify_wait_seconds_count") == 6


async def test_notify_timeout_still_serves_and_counts() -> None:
    async with ph.engines("p0", "d0", output_tokens=4) as e:  # p0 never notifies
        t = lmpd_table(e, ["p0"], {"d0": RX0})
        async with ph.running_proxy(t, lmcache_pd_notify_timeout_s=0.3) as rp:
            res = await ph.stream_completion(
                rp.session, rp.url, "a b c " * 10, headers={"X-Request-Id": "lost"}, max_tokens=3
            )
            plain = await rp.session.post(
                f"{rp.url}/v1/completions",
                json={"model": "fake", "prompt": "x y", "max_tokens": 2},
            )
            body = await plain.json()
            metrics = await rp.metrics()
            assert not rp.proxy.notifier.pending, "timed-out waits are forgotten"
    assert res.status == 200 and res.events[-1] == "[DONE]"
    assert len(ph.completion_text(res.events).split()) == 3
    assert plain.status == 200 and len(body["choices"][0]["text"].split()) == 2
    assert e["p0"].seen()[0].body["kv_transfer_params"]["disagg_spec"]["req_id"] == "lost"
    assert len(e["d0"].seen()) == 2
    assert ph.metric_value(metrics, NOTIFY, outcome="timeout") == 2
    assert ph.metric_value(metrics, NOTIFY, outcome="received") == 0


async def test_late_and_duplicate_notifies_are_dropped() -> None:
    async with ph.engines("p0", "d0") as e:
        t = lmpd_table(e, ["p0"], {"d0": RX0})
        async with ph.running_proxy(t) as rp:
            notifier = rp.proxy.notifier
            fut = notifier.expect("dup")
            notifier.notify("dup")
            notifier.notify("dup")  # a second TP rank's
            notifier.notify("nobody")
            assert fut.done() and not notifier.pending
            assert notifier.unique_id("x") == "x"
            notifier.expect("x")
            assert notifier.unique_id("x") == "x-1"
            metrics = await rp.metrics()
    assert ph.metric_value(metrics, NOTIFY, outcome="unmatched") == 2


async def test_dead_prefiller_retried_same_decoder_new_req_id() -> None:
    async with ph.engines("p0", "p1", "d0", "d1", output_tokens=3) as e:
        e["p0"].faults = Faults(close_after_chunks=0)  # dies on every request
        t = lmpd_table(e, ["p0", "p1"], {"d0": RX0, "d1": RX1})
        async with ph.running_proxy(t, eject_after=100) as rp:
            point_prefillers_at_proxy(e, rp, "p1")
            results = []
            for i in range(16):
                results.append(
                    await ph.stream_completion(
                        rp.session,
                        rp.url,
                        f"retry prompt {i} " * 30,
                        headers={"X-Request-Id": f"rq{i}"},
                    )
                )
                if e["p0"].seen():
                    break
            metrics = await rp.metrics()
    assert all(r.status == 200 and r.events[-1] == "[DONE]" for r in results)
    (dead,) = e["p0"].seen()
    rid = dead.request_id
    first = dead.body["kv_transfer_params"]["disagg_spec"]
    (retry,) = [r for r in e["p1"].seen() if r.request_id == rid]
    second = retry.body["kv_transfer_params"]["disagg_spec"]
    assert first["req_id"] == rid and second["req_id"] == f"{rid}-r1"
    assert {k: v for k, v in first.items() if k != "req_id"} == {
        k: v for k, v in second.items() if k != "req_id"
    }, "the decoder chosen before the prefill is kept across the prefill retry"
    assert f"{rid}-r1" in dict(e["p1"].lmcache_pd_notified)
    name = "d0" if first["receiver_host"] == RX0["host"] else "d1"
    assert [r.request_id for r in e[name].seen()].count(rid) == 1
    assert ph.metric_value(metrics, "pdstack_proxy_retries_total", leg="prefill") >= 1
    assert ph.metric_value(metrics, NOTIFY, outcome="received") == len(results)


async def test_decode_failure_before_first_byte_retried_on_other_decoder() -> None:
    async with ph.engines("p0", "d0", "d1", output_tokens=3) as e:
        e["d0"].faults = Faults(status=503, times=1)
        t = lmpd_table(e, ["p0"], {"d0": RX0, "d1": RX1})
        async with ph.running_proxy(t, eject_after=100) as rp:
            e["d0"].faults.health_status = 503  # the 5xx is confirmed: d0 is really sick
            rp.proxy.rng = FirstChoice()  # p2c picks d0 (first paired decoder)
            point_prefillers_at_proxy(e, rp, "p0")
            res = await ph.stream_completion(
                rp.session, rp.url, "q " * 10, headers={"X-Request-Id": "dr"}
            )
            metrics = await rp.metrics()
    assert res.status == 200 and res.events[-1] == "[DONE]"
    spec = e["p0"].seen()[0].body["kv_transfer_params"]["disagg_spec"]
    assert spec["receiver_host"] == RX0["host"]
    assert [r.request_id for r in e["d0"].seen()] == ["dr"]  # failed before its first byte
    assert [r.request_id for r in e["d1"].seen()] == ["dr"]  # recomputes there
    assert ph.metric_value(metrics, "pdstack_proxy_retries_total", leg="decode") == 1


async def test_decoder_without_receiver_is_served_without_push() -> None:
    async with ph.engines("p0", "d0") as e:
        t = lmpd_table(e, ["p0"], {"d0": None})
        async with ph.running_proxy(t) as rp:
            point_prefillers_at_proxy(e, rp, "p0")
            res = await ph.stream_completion(rp.session, rp.url, "hello")
            metrics = await rp.metrics()
    assert res.status == 200
    assert "kv_transfer_params" not in e["p0"].seen()[0].body
    assert not e["p0"].lmcache_pd_notified
    assert ph.metric_value(metrics, NOTIFY, outcome="no_receiver") == 1


def test_cli_adhoc_lmcache_pd_needs_receivers(capsys) -> None:
    from pdstack.cli import main

    base = [
        "proxy",
        "--kv-mode",
        "lmcache-pd",
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:2",
    ]
    with pytest.raises(SystemExit, match="lmcache-pd-receiver"):
        main(base)
    import argparse

    from pdstack.proxy.cli import backend_table_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(), "proxy", "")
    args = parser.parse_args(
        [
            *base,
            "--lmcache-pd-receiver",
            "127.0.0.2:7304,7306:7305,7307",
            "--lmcache-pd-notify-port",
            "7299",
            "--host",
            "127.0.0.9",
        ]
    )
    table = backend_table_from_args(args)
    data = table.model_dump(mode="json")
    assert data["lmcache_pd_notify"] == {"host": "127.0.0.9", "port": 7299}
    (dec,) = [b for b in data["backends"] if b["role"] == "decode"]
    assert dec["lmcache_pd"] == RX1
    assert BackendRegistry.from_table(table).backends["local/decode-0"].lmcache_pd == RX1


def test_fake_engine_cli_accepts_notify_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdstack.testing.fake_engine", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "--lmcache-pd-notify" in out.stdout
