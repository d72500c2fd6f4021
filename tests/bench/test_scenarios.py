"""``pdstack bench --scenario``: presets, overrides, many-tenants sizing, the multi-turn
schedule, and the seed scenario's request stream equal to the one before schedules."""

from __future__ import annotations

import argparse
import collections
import hashlib
import http.server
import itertools
import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdstack.bench import cli, scenarios
from pdstack.bench.client import build_body
from pdstack.bench.runner import BenchConfig
from pdstack.bench.workload import Distribution, Workload, WorkloadConfig, poisson_arrivals

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(), "bench", "bench")
    return parser.parse_args(["bench", "--target", "http://127.0.0.1:9", *argv])


def config(*argv: str) -> BenchConfig:
    cfg = cli._config(parse(*argv))
    assert isinstance(cfg, BenchConfig)
    return cfg


def test_no_scenario_keeps_the_historic_defaults() -> None:
    cfg = config()
    assert cfg.scenario is None and cfg.scenario_sizing is None
    assert cfg.workload == WorkloadConfig()  # 4 prompts of 1024, 0.8 shared, ...
    wl = cfg.to_json()["workload"]
    assert (wl["system_len"], wl["user_len"], wl["output_len"]) == (
        "1024", "uniform:32:256", "uniform:64:256")
    assert wl["turns"] is None and wl["think_time_s"] is None


def test_seed_scenario_is_what_results_h200x2_used() -> None:
    recorded = json.loads((REPO / "results/h200x2/colocated.json").read_text())
    old = recorded["config"]["workload"]
    cfg = config("--scenario", "seed", "--token-ids", "--seed", str(old["seed"]))
    new = cfg.to_json()
    assert new["scenario"] == "seed"
    for key, value in old.items():
        assert new["workload"][key] == value, key


def test_explicit_flags_override_the_preset() -> None:
    cfg = config("--scenario", "multi-turn", "--system-prompts", "9", "--system-len", "100",
                 "--turns", "2", "--think-time", "0.5", "--shared-share", "1")
    wl = cfg.workload
    assert (wl.num_system_prompts, str(wl.system_len), str(wl.turns), wl.think_time,
            wl.shared_share) == (9, "100", "2", 0.5, 1.0)
    assert str(wl.user_len) == "uniform:32:256"  # from the preset
    preset = config("--scenario", "multi-turn").workload
    assert (str(preset.turns), preset.think_time, str(preset.system_len)) == (
        "uniform:3:8", 4.0, "uniform:2000:6000")


@pytest.mark.parametrize(("argv", "needle"), [
    (["--turns", "3"], "--turns needs --scenario multi-turn"),
    (["--scenario", "seed", "--think-time", "2"], "--think-time needs --scenario multi-turn"),
    (["--kv-capacity-tokens", "1000"], "--kv-capacity-tokens needs --scenario many-tenants"),
    (["--scenario", "many-tenants"], "--kv-capacity-tokens"),
])
def test_bad_scenario_input_is_one_clear_error(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.run_bench(parse(*argv)) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_many_tenants_from_kv_capacity_flag() -> None:
    cfg = config("--scenario", "many-tenants", "--kv-capacity-tokens", "386000")
    # ceil(2 * 386000 / mean(uniform:2000:6000) = 4000) = 193
    assert cfg.workload.num_system_prompts == 193
    sizing = cfg.to_json()["scenario_sizing"]
    assert sizing["kv_capacity_tokens"] == 386000
    assert sizing["kv_capacity_source"] == "--kv-capacity-tokens"
    assert sizing["num_system_prompts"] == 193
    # an explicit --system-prompts wins, and then nothing needs sizing
    assert config("--scenario", "many-tenants", "--system-prompts", "7").workload \
        .num_system_prompts == 7


@pytest.fixture
def metrics_servers() -> Iterator[list[str]]:
    """Two /metrics endpoints: the saved vLLM sample (two engines, 6032 and 7000 blocks
    of 64) and a proxy-like one without cache_config_info."""
    bodies = {"/engine": (DATA / "vllm_metrics_after.prom").read_bytes(),
              "/proxy": b"# TYPE pdstack_requests_total counter\npdstack_requests_total 3\n"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = bodies.get(self.path)
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    yield [base + "/proxy", base + "/engine"]
    server.shutdown()


def test_many_tenants_sized_from_the_engines_metrics(metrics_servers: list[str]) -> None:
    proxy, engine = metrics_servers
    cfg = config("--scenario", "many-tenants", "--metrics-url", proxy, "--metrics-url", engine)
    # the smaller engine: 6032 blocks x 64 = 386,048 tokens; ceil(2 * 386048 / 4000) = 194
    assert cfg.scenario_sizing == {
        "kv_capacity_tokens": 386048, "kv_capacity_source": engine, "kv_factor": 2.0,
        "mean_system_len": 4000.0, "num_system_prompts": 194,
        "shared_prompt_tokens": 776000}
    assert cfg.workload.num_system_prompts == 194
    with pytest.raises(scenarios.ScenarioError, match="--kv-capacity-tokens"):
        config("--scenario", "many-tenants", "--metrics-url", proxy)


def _multi_turn(seed: int = 3, token_ids: bool = True, **kw: object) -> WorkloadConfig:
    args: dict[str, object] = dict(
        num_system_prompts=4, system_len=Distribution.parse("uniform:20:60"),
        user_len=Distribution.parse("uniform:4:12"), output_len=Distribution.parse("uniform:3:9"),
        token_ids=token_ids, seed=seed, turns=Distribution.parse("uniform:3:8"), think_time=4.0)
    args.update(kw)
    return WorkloadConfig(**args)  # type: ignore[arg-type]


def test_multi_turn_schedule_is_deterministic_and_turns_extend_the_conversation() -> None:
    cfg = _multi_turn()
    sched = Workload(cfg).schedule(5.0, 120.0, cfg.seed)
    assert sched == Workload(cfg).schedule(5.0, 120.0, cfg.seed)
    assert sched != Workload(_multi_turn(seed=4)).schedule(5.0, 120.0, 4)
    offsets = [t for t, _ in sched]
    assert offsets == sorted(offsets) and offsets[0] >= 0 and offsets[-1] < 120.0
    assert [r.index for _, r in sched] == list(range(len(sched)))
    by_session: dict[str, list[tuple[float, object]]] = collections.defaultdict(list)
    for t, r in sched:
        assert r.session is not None
        by_session[r.session].append((t, r))
    assert len(by_session) > 50
    later_turns = 0
    for session, turns in by_session.items():
        reqs = [r for _, r in turns]
        assert [r.turn for r in reqs] == list(range(reqs[0].turn, reqs[0].turn + len(reqs)))
        assert len({r.system_prompt_id for r in reqs}) == 1
        bodies = [build_body(r, "m", "completions") for r in reqs]
        assert {b["user"] for b in bodies} == {session}
        for prev, cur, req in zip(bodies, bodies[1:], reqs[1:], strict=False):
            later_turns += 1
            assert len(cur["prompt"]) > len(prev["prompt"])
            assert cur["prompt"][: len(prev["prompt"])] == prev["prompt"]
            assert len(cur["prompt"]) == req.prompt_len
        # the earlier answer in the history is as long as that turn's max_tokens
        for prev_req, req in itertools.pairwise(reqs):
            assert len(req.history[-1]) == prev_req.max_tokens
    assert later_turns > 100


def test_multi_turn_chat_messages_alternate_and_extend() -> None:
    cfg = _multi_turn(token_ids=False)
    sched = Workload(cfg).schedule(5.0, 60.0, cfg.seed)
    convs: dict[str, list[dict[str, object]]] = collections.defaultdict(list)
    for _, r in sched:
        assert r.session is not None
        convs[r.session].append(build_body(r, "m", "chat"))
    checked = 0
    for bodies in convs.values():
        for prev, cur in itertools.pairwise(bodies):
            msgs = cur["messages"]
            assert isinstance(msgs, list)
            roles = [m["role"] for m in msgs]
            assert roles[0] == "system" and roles[-1] == "user"
            assert roles[1:] == ["user", "assistant"] * ((len(roles) - 2) // 2) + ["user"]
            assert msgs[: len(prev["messages"])] == prev["messages"]  # type: ignore[arg-type]
            checked += 1
    assert checked > 30


def test_multi_turn_rate_is_the_asked_rate_from_the_start() -> None:
    cfg = _multi_turn(token_ids=False)
    rate, total = 10.0, 600.0
    sched = Workload(cfg).schedule(rate, total, cfg.seed)
    assert len(sched) / total == pytest.approx(rate, rel=0.15)
    first_minute = sum(1 for t, _ in sched if t < 60.0)
    assert first_minute / 60.0 == pytest.approx(rate, rel=0.3)  # no ramp-up from 0
    assert any(r.turn > 0 for t, r in sched if t < 5.0)  # conversations already under way
    # the stream continues: a second rate's conversations are new ones
    wl = Workload(cfg)
    a = {r.session for _, r in wl.schedule(2.0, 30.0, cfg.seed)}
    b = {r.session for _, r in wl.schedule(2.0, 30.0, cfg.seed)}
    assert a and b and not a & b


# sha256 over (offset, request body) of rates 2 and 8, 25 s each, seed 1, the seed
# scenario's knobs: computed with the code before Workload.schedule existed.
PRE_CHANGE = {
    True: (278, "c1160d4a0201282e2b285e338f228c39448cb7fc1a68386b2c0f00ca5f39ccc6"),
    False: (278, "b93870ed693ebd3ca422220cc9601a787a4aaf1a1e5433c9837c0df1f109d835"),
}


@pytest.mark.parametrize("token_ids", [True, False])
def test_seed_scenario_sends_the_pre_change_request_stream(token_ids: bool) -> None:
    argv = ["--scenario", "seed", "--seed", "1"] + (["--token-ids"] if token_ids else [])
    cfg = config(*argv)
    wl = Workload(cfg.workload)
    digest, n = hashlib.sha256(), 0
    for rate in (2.0, 8.0):
        for t, req in wl.schedule(rate, 25.0, cfg.workload.seed):
            n += 1
            assert req.session is None and req.history == ()
            digest.update(repr(t).encode())
            digest.update(json.dumps(build_body(req, "m", "chat")).encode())
    assert (n, digest.hexdigest()) == PRE_CHANGE[token_ids]
    # and equal to today's arrivals + next_request() in order
    old, new = Workload(cfg.workload), Workload(cfg.workload)
    arrivals = poisson_arrivals(3.0, 20.0, random.Random("arrivals-1-3.0"))
    assert [(t, old.next_request()) for t in arrivals] == new.schedule(3.0, 20.0, 1)


def _new_block_tokens(prompt: list[int], seen: set[int], block: int = 16) -> int:
    """Tokens of ``prompt`` in full blocks that no earlier prompt had at the same place
    with the same prefix (vLLM's prefix-cache block hash chain); records its blocks."""
    new, h = 0, 0
    for i in range(0, len(prompt) - block + 1, block):
        h = hash((h, *prompt[i : i + block]))
        if h not in seen:
            seen.add(h)
            new += block
    return new


def test_long_input_scenario_is_6_to_12k_a_third_shared_poisson() -> None:
    cfg = config("--scenario", "long-input", "--token-ids", "--seed", "3").workload
    assert cfg.turns is None  # one request per arrival
    rate, total = 2.0, 150.0
    sched = Workload(cfg).schedule(rate, total, cfg.seed)
    # Poisson arrivals at the asked rate
    assert [t for t, _ in sched] == poisson_arrivals(rate, total, random.Random("arrivals-3-2.0"))
    assert len(sched) / total == pytest.approx(rate, rel=0.2)
    seen: set[int] = set()
    fractions, shared, tokens, prefixes = [], 0, 0, set()
    for _, req in sched:
        assert isinstance(req.system, list) and isinstance(req.user, list)
        prompt = req.system + req.user
        assert 6000 <= len(prompt) == req.prompt_len <= 12000
        reused = len(prompt) - _new_block_tokens(prompt, seen)
        assert req.system_prompt_id is not None  # every prompt starts with a shared prefix
        if req.system_prompt_id in prefixes:  # not its prefix's first use
            fractions.append(reused / len(prompt))
            shared, tokens = shared + reused, tokens + len(prompt)
        prefixes.add(req.system_prompt_id)
    assert shared / tokens == pytest.approx(1 / 3, abs=0.03)
    assert min(fractions) > 0.15 and max(fractions) < 0.55  # each prompt: about a third
