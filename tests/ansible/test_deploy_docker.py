"""deploy.yml brings the CPU stack up on a namespaced lab host through the real Docker
engine, and the proxy answers (marker ``netns``; needs .ci/install-docker.sh's engine and
the pdstack/engine-cpu:dev + pdstack/proxy:dev images).

The stack is one colocated engine on the node's LMCache server (``colocated+l1``: engine,
LMCache, its metrics gate, proxy) with canary secrets given to Ansible (``stack_secrets``,
written to the node's 0600 secrets file): the proxy then wants a client key and the engine
its own, and no canary may show up in any service's HTTP answers, process arguments, or the
environment of the LMCache services (issue 27; :mod:`pdstack.testing.canaries`).

The lab node (SSH on 10.77.0.1, its own mount namespace) drives the root namespace's
Docker daemon through DOCKER_HOST=/proc/<dockerd>/root/run/docker.sock.  Containers use
``network_mode: host`` and so live in the *root* network namespace: the node's private
address is 127.0.0.1 with ports no other test uses, the stack directory lies outside the
node's overlaid /opt (the daemon resolves bind mounts in its own mount namespace), and the
role checks /health from inside the proxy container (``stack_health_check_from``).  The
engines are heavy: the run holds the heavy-run lock (pdstack.testing.heavy).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from anshelpers import docker_host, playbook

from pdstack.testing.canaries import canaries, check_stack
from pdstack.testing.heavy import CPU_STACK_IMAGES, heavy_lock, require_docker

PROXY_PORT = 28000
ENGINE_PORT = 28100
IMAGES = CPU_STACK_IMAGES
SECRETS = canaries()


def _inventory(lab, dest: Path, stack_root: Path, dh: str) -> Path:
    (dest / "group_vars").mkdir(parents=True)
    hosts = {"all": {
        "vars": {"ansible_user": "root", "ansible_ssh_private_key_file": str(lab.key_file),
                 "ansible_ssh_common_args": f"-o UserKnownHostsFile={lab.known_hosts} "
                                            "-o StrictHostKeyChecking=yes",
                 "ansible_python_interpreter": "/usr/bin/python3"},
        "children": {"pdstack_nodes": {"hosts": {"node1": {
            "ansible_host": lab.address("node1"),
            "pdstack_private_address": "127.0.0.1",
            "pdstack_gpu_count": 0,
            "pdstack_proxy": True,
            "pdstack_engines": [{"role": "colocated", "cpu_threads_bind": "nobind",
                                 "kv_cache_bytes": 268435456}],
        }}}}}}
    lab_gv = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "inventory" / "lab" / "group_vars" / "all.yml")
        .read_text())
    gv = {
        "pdstack_deployment_name": "ansdeploy",
        "pdstack_profile": "cpu",
        "pdstack_kv_mode": "colocated+l1",
        "pdstack_lmcache": {"l1_size_gb": 1, "chunk_size": 256},
        "pdstack_engine_image": IMAGES[0],
        "pdstack_proxy_image": IMAGES[1],
        # no C++ compiler in the CPU engine image: no torch.compile
        "pdstack_model": {**lab_gv["pdstack_model"], "extra_args": ["--enforce-eager"]},
        "pdstack_ports": {"proxy": PROXY_PORT, "engine_http_base": ENGINE_PORT,
                          "nixl_side_channel_base": 28600, "lmcache_zmq": 28700,
                          "lmcache_http": 28701, "lmcache_pd_base": 28300},
        "pdstack_shm_size": "1g",
        "pdstack_docker_host": dh,
        "stack_root": str(stack_root),
        "stack_health_check_from": "container",
        "stack_pull": "never",
        # written to the node's secrets file (its /etc is the lab node's own overlay)
        "stack_secrets": SECRETS,
    }
    (dest / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    (dest / "group_vars" / "all.yml").write_text(yaml.safe_dump(gv, sort_keys=False))
    return dest


@pytest.mark.netns
@pytest.mark.docker
def test_deploy_cpu_stack_through_docker(clean_alab, tmp_path):
    lab = clean_alab
    dh = docker_host()
    require_docker(IMAGES)
    stack_root = lab.base / "stacks"
    inv = _inventory(lab, tmp_path / "inv", stack_root, dh)
    project_dir = stack_root / "ansdeploy"
    with heavy_lock():
        _deploy_and_check(lab, inv, project_dir, stack_root)


def _deploy_and_check(lab, inv: Path, project_dir: Path, stack_root: Path) -> None:
    try:
        up = playbook(lab, "ansible/deploy.yml", inv, timeout=1200)
        assert up.rc == 0, up.tail(150)
        assert up.changed() > 0
        assert ("TASK [stack : Check that the proxy answers /health (inside the proxy container)]"
                in up.out)
        # the proxy answers from the machine too (host network of the daemon's namespace)
        with urllib.request.urlopen(f"http://127.0.0.1:{PROXY_PORT}/health", timeout=10) as r:
            assert r.status == 200
        body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4,
                           "ignore_eos": True}).encode()
        url = f"http://127.0.0.1:{PROXY_PORT}/v1/completions"
        # the secrets file Ansible wrote holds the client keys: no key, no answer
        anonymous = urllib.request.Request(url, data=body,
                                           headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(anonymous, timeout=30)
            raise AssertionError("the proxy answered without a client key")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401, exc.code
        req = urllib.request.Request(url, data=body, headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {SECRETS['PDSTACK_API_KEYS']}"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.load(r)
        assert answer["model"] == "tiny", answer
        assert answer["usage"]["completion_tokens"] == 4, answer
        assert answer["choices"][0]["finish_reason"] == "length", answer
        # the engine wants its own key (the proxy sent it), and nothing hands a secret out
        report = check_stack(project_dir, SECRETS, bearer=SECRETS["VLLM_API_KEY"])
        print(f"\ncanaries: {report.answered} HTTP answers on ports {report.ports}, "
              f"processes {report.processes}: {report.leaks or 'clean'}")
        assert not report.leaks, report.leaks
        assert report.answered >= 20, f"only {report.answered} HTTP answers: nothing checked"
        assert set(report.processes) == {"engine-0", "lmcache", "lmcache-metrics", "proxy"}, (
            report.processes)
        again = playbook(lab, "ansible/deploy.yml", inv, timeout=900)
        assert again.rc == 0, again.tail(150)
        assert again.changed() == 0, again.tail(150)
        check = playbook(lab, "ansible/deploy.yml", inv, "--check", "--diff", timeout=900)
        assert check.rc == 0, check.tail(150)
        assert check.changed() == 0, check.tail(150)
        print(f"\ndeploy (compose up --wait) {up.seconds:.1f}s, second run {again.seconds:.1f}s "
              f"(changed=0), check mode {check.seconds:.1f}s (changed=0); "
              f"completion: {answer['choices'][0]['text']!r}")
    finally:
        env = {**os.environ}
        subprocess.run(["docker", "compose", "--project-directory", str(project_dir), "down",
                        "--volumes", "--timeout", "5"], capture_output=True, env=env, timeout=300)
        shutil.rmtree(stack_root, ignore_errors=True)
