"""``pdstack secrets split`` takes out of the services' files what left the node's (issue 54):
with the node's secrets file removed, the old per-service files go too (a recreated proxy no
longer holds the admin token and keys), and it says which, by name only."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdstack.cli import main


def _split(node: Path, out: Path) -> int:
    return main(["secrets", "split", "--node-file", str(node), "--dir", str(out)])


def test_removed_node_file_removes_the_services_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    node = tmp_path / "secrets.env"
    node.write_text("PDSTACK_ADMIN_TOKEN=adm-1\nPDSTACK_API_KEYS=ck-1\nVLLM_API_KEY=ek-1\n"
                    "GF_SECURITY_ADMIN_PASSWORD=gp-1\n")
    out = tmp_path / "secrets"
    assert _split(node, out) == 0
    assert "ADMIN_TOKEN=adm-1" in (out / "proxy.env").read_text()
    capsys.readouterr()
    node.unlink()
    assert _split(node, out) == 0
    assert sorted(p.name for p in out.iterdir()) == []
    printed = capsys.readouterr().out
    for kind, names in (("proxy", "PDSTACK_ADMIN_TOKEN, PDSTACK_API_KEYS, VLLM_API_KEY"),
                        ("engine", "VLLM_API_KEY"), ("grafana", "GF_SECURITY_ADMIN_PASSWORD")):
        assert f"{out / kind}.env: removed the file (removed: {names})" in printed, printed
    assert "docker compose up -d" in printed
    assert "no secrets to split" not in printed
    for value in ("adm-1", "ck-1", "ek-1", "gp-1"):
        assert value not in printed
    # again: nothing left to remove, and it says so
    assert _split(node, out) == 0
    assert "no secrets to split (the services run without any)" in capsys.readouterr().out


def test_a_secret_taken_out_is_named_as_removed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    node = tmp_path / "secrets.env"
    node.write_text("PDSTACK_ADMIN_TOKEN=adm-1\nVLLM_API_KEY=ek-1\n")
    out = tmp_path / "secrets"
    assert _split(node, out) == 0
    capsys.readouterr()
    node.write_text("VLLM_API_KEY=ek-1\n")
    assert _split(node, out) == 0
    assert (out / "proxy.env").read_text() == "VLLM_API_KEY=ek-1\n"
    printed = capsys.readouterr().out
    assert f"{out}/proxy.env: VLLM_API_KEY (removed: PDSTACK_ADMIN_TOKEN)" in printed
    assert "adm-1" not in printed and "ek-1" not in printed
