"""The upgrade's own decisions (order, capacity, stand-ins, .env edits), no Docker."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from pdstack.upgrade import (
    Compose,
    Engine,
    StackEnv,
    UpgradeError,
    engine_busy,
    new_model_arg,
    serving_generations,
    set_backends_json_generation,
    standin_for,
    upgrade_order,
)

REPO = Path(__file__).resolve().parents[2]
OLD, NEW = "rev1@img", "rev2@img"


def eng(service: str, node: str = "local") -> Engine:
    role = {"prefill": "prefill", "decode": "decode", "engine": "colocated"}[service.split("-")[0]]
    return Engine(service, f"{node}/{service}", role, node, f"http://h/{service}")


def listing(states: dict[str, tuple[str, str]], kv_mode: str = "shared-l1") -> dict:
    """states: service -> (state, generation); pairs every prefiller with every decoder."""
    backends = [
        {"name": f"local/{s}", "role": s.split("-")[0], "node": "local",
         "url": f"http://h/{s}", "state": st, "generation": g, "in_flight": 0}
        for s, (st, g) in states.items()
    ]
    pre = [b["name"] for b in backends if b["role"] == "prefill"]
    dec = [b["name"] for b in backends if b["role"] == "decode"]
    pairs = [{"prefill": p, "decode": d, "kv_path": "shared-l1"} for p in pre for d in dec]
    return {"kv_mode": kv_mode, "backends": backends, "pairings": pairs}


def test_order_one_decoder_then_prefillers_then_rest() -> None:
    engines = [eng("prefill-0"), eng("prefill-1"), eng("decode-0"), eng("decode-1")]
    assert [e.service for e in upgrade_order(engines)] == [
        "decode-1", "prefill-0", "prefill-1", "decode-0"]
    colocated = [eng("engine-0"), eng("engine-1")]
    assert [e.service for e in upgrade_order(colocated)] == ["engine-0", "engine-1"]


def test_serving_generations_needs_a_same_generation_pair() -> None:
    state = listing({"prefill-0": ("healthy", OLD), "decode-0": ("healthy", OLD),
                     "decode-1": ("healthy", NEW)})
    assert serving_generations(state) == {OLD}
    assert serving_generations(state, ["local/decode-1"]) == {OLD}
    # taking the only prefiller out leaves nothing: a stand-in is needed
    assert serving_generations(state, ["local/prefill-0"]) == set()
    drained = listing({"prefill-0": ("drained", OLD), "decode-0": ("healthy", OLD)})
    assert serving_generations(drained) == set()


def test_standin_prefers_old_generation_and_pairs_same_generation_only() -> None:
    state = listing({"prefill-0": ("healthy", OLD), "decode-0": ("healthy", OLD),
                     "decode-1": ("healthy", NEW)})
    spec = standin_for(state, eng("prefill-0"), OLD)
    assert spec is not None
    assert spec["role"] == "prefill" and spec["url"] == "http://h/decode-0"
    assert spec["generation"] == OLD and spec["pairs_with"] == ["local/decode-0"]
    assert spec["name"] == "local/prefill-standin-decode-0"
    # with the stand-in registered, the old generation serves again without prefill-0
    state["backends"].append({**spec, "state": "healthy", "in_flight": 0})
    state["pairings"].append({"prefill": spec["name"], "decode": "local/decode-0",
                              "kv_path": "shared-l1"})
    assert serving_generations(state, ["local/prefill-0"]) == {OLD}
    # ...and a stand-in is counted out together with the engine it points at
    assert serving_generations(state, ["local/prefill-0", "local/decode-0"]) == set()


def test_no_standin_where_kv_does_not_go_through_the_node_store() -> None:
    state = listing({"prefill-0": ("healthy", OLD), "decode-0": ("healthy", OLD)}, "nixl")
    assert standin_for(state, eng("prefill-0"), OLD) is None


def test_new_model_arg() -> None:
    assert new_model_arg("/models/tiny-llama/rev1", "rev1", "rev2", None) == \
        "/models/tiny-llama/rev2"
    assert new_model_arg("/m/rev1", "rev1", "rev2", "/x/{revision}/w") == "/x/rev2/w"
    # a hub id with --revision keeps its name: the caller must refuse (cache namespace)
    assert new_model_arg("deepseek-ai/DeepSeek-V2-Lite", "main", "abc", None) == \
        "deepseek-ai/DeepSeek-V2-Lite"


def test_env_edit_touches_one_engine_only(tmp_path: Path) -> None:
    for name in (".env", "backends.json"):
        shutil.copy(REPO / "compose" / "cpu" / name, tmp_path / name)
    env = StackEnv(tmp_path / ".env")
    before = env.read()
    env.update(
        {"DECODE_1_MODEL": "/models/tiny-llama/rev2", "DECODE_1_REVISION": "rev2"},
        {"# decode-1:": "# decode-1: decode, generation rev2@pdstack/engine-cpu:dev"},
    )
    after = env.read()
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"DECODE_1_MODEL", "DECODE_1_REVISION"}
    text = (tmp_path / ".env").read_text()
    assert "# decode-1: decode, generation rev2@pdstack/engine-cpu:dev" in text
    assert "# decode-0: decode, generation rev1@pdstack/engine-cpu:dev" in text
    with pytest.raises(UpgradeError, match="NOPE_MODEL"):
        env.update({"NOPE_MODEL": "x"})
    set_backends_json_generation(tmp_path / "backends.json", "local/decode-1", "rev2@x")
    gens = {b["name"]: b["generation"]
            for b in json.loads((tmp_path / "backends.json").read_text())["backends"]}
    assert gens["local/decode-1"] == "rev2@x"
    assert gens["local/decode-0"] == "rev1@pdstack/engine-cpu:dev"


# A test double for the `docker` CLI (fault injection): it logs every call and answers the
# first `up` with the daemon error CI once hit while a loaded host recreated an engine.
FAKE_DOCKER = """#!/bin/sh
echo "$*" >> "$FAKE_DOCKER_LOG"
case " $* " in
  *" up "*)
    if [ "$FAKE_DOCKER_MODE" = broken ]; then
      echo "Error response from daemon: No such image: pdstack/missing" >&2; exit 1
    fi
    if [ ! -f "$FAKE_DOCKER_LOG.failed" ]; then
      touch "$FAKE_DOCKER_LOG.failed"
      echo "Error response from daemon: cannot stop container: a4e6: tried to kill" \\
        "container, but did not receive an exit event" >&2
      exit 1
    fi;;
esac
exit 0
"""


@pytest.fixture
def fake_docker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    log_file = tmp_path / "docker.log"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DOCKER_LOG", str(log_file))
    return log_file


def test_compose_stops_with_grace_then_retries_a_transient_daemon_error(
    fake_docker: Path, tmp_path: Path
) -> None:
    compose = Compose(tmp_path, project="p", stop_timeout_s=45, retry_pause_s=0)
    compose.stop("decode-0")
    compose.up("decode-0")
    calls = fake_docker.read_text().splitlines()
    assert calls[0] == "compose -p p stop -t 45 decode-0"
    assert [c.split()[3] for c in calls] == ["stop", "up", "up"], calls


def test_compose_does_not_retry_a_real_failure(
    fake_docker: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_DOCKER_MODE", "broken")
    with pytest.raises(UpgradeError, match=r"docker compose up failed(.|\n)*No such image"):
        Compose(tmp_path, retry_pause_s=0).up("decode-0")
    calls = fake_docker.read_text().splitlines()
    assert [c.split()[1] for c in calls] == ["up", "logs"], calls  # no retry; logs for the error


def test_engine_busy_reads_vllms_own_running_and_waiting_gauges() -> None:
    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 1.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 99.0
"""
    assert engine_busy(text) == 3.0
    assert engine_busy(text.replace(" 1.0", " 0.0").replace(" 2.0", " 0.0")) == 0.0
    assert engine_busy("") == 0.0


def test_verify_and_warm_sends_the_engines_key(tmp_path: Path) -> None:
    """Engines with VLLM_API_KEY refuse the warm-up without it; the upgrade reads the key
    from the environment or the node's secrets file and sends it."""
    import subprocess
    import sys
    import time
    import urllib.request

    from pdstack.testing.vllm_engines import free_port
    from pdstack.upgrade import Upgrader, read_engine_key

    secrets = tmp_path / "secrets.env"
    secrets.write_text("# secrets\nHF_TOKEN=x\nVLLM_API_KEY='engine-key-1'\n")
    env_key = os.environ.pop("VLLM_API_KEY", None)
    try:
        assert read_engine_key(str(secrets)) == "engine-key-1"
        assert read_engine_key(str(tmp_path / "absent")) is None
    finally:
        if env_key is not None:
            os.environ["VLLM_API_KEY"] = env_key
    port = free_port()
    proc = subprocess.Popen(  # a FakeEngine TEST DOUBLE that requires the key
        [sys.executable, "-m", "pdstack.testing.fake_engine", "--port", str(port),
         "--api-key-env", "VLLM_API_KEY"],
        env={**os.environ, "VLLM_API_KEY": "engine-key-1"}, cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        engine = Engine("decode-0", "local/decode-0", "decode", "local",
                        f"http://127.0.0.1:{port}")
        keyless = Upgrader(None, None, tmp_path, None)  # type: ignore[arg-type]
        with pytest.raises(UpgradeError, match="warm-up request answered 401"):
            keyless.verify_and_warm(engine, "fake")
        keyed = Upgrader(None, None, tmp_path, None, engine_key="engine-key-1")  # type: ignore[arg-type]
        keyed.verify_and_warm(engine, "fake")
    finally:
        proc.terminate()
        proc.wait(10)
