"""compose_up's judgement of a container (pdstack/compose_up.py), without Docker: a container
that its restart policy restarted while ``up --wait`` watched is failing (a crash loop seen
between two polls), named with its restart count; one that existed before with restarts of
its own is judged on the restarts since."""

from __future__ import annotations

import pytest

from pdstack import compose_up as cu

PS = """[{"Service": "decode-0", "Name": "p-decode-0-1", "State": "running", "Health": "starting",
  "ExitCode": 0, "Status": "Up 2 seconds (health: starting)"},
 {"Service": "lmcache", "Name": "p-lmcache-1", "State": "running", "Health": "",
  "ExitCode": 0, "Status": "Up 40 seconds"}]"""


def test_a_restart_during_up_is_a_crash_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {"p-decode-0-1": ("idD", 2), "p-lmcache-1": ("idL", 5)}
    monkeypatch.setattr(cu, "restart_counts", lambda containers, env=None: {
        c: counts[c] for c in containers})
    states = cu._with_restarts(cu.parse_ps_json(PS), {"idL": 5}, None)
    by = {s.service: s for s in states}
    assert by["decode-0"].restarts == 2 and by["decode-0"].failed
    assert "restarted by its policy 2 time(s)" in by["decode-0"].describe()
    assert by["lmcache"].restarts == 0 and not by["lmcache"].failed  # its 5 are from before
    err = cu.ComposeUpError(cu.Path("/s"), "crash loop", states, {"decode-0": "boom"})
    assert [s.service for s in err.failing] == ["decode-0"]
    assert "FAILED decode-0" in str(err)


def test_restart_counts_parses_docker_inspect(monkeypatch: pytest.MonkeyPatch) -> None:
    out = "/p-decode-0-1 3f9a 4\n/p-lmcache-1 77b1 0\n"
    seen = []

    def fake_run(cmd, env, timeout=60.0):
        seen.append(cmd)
        return cu.subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(cu, "_run", fake_run)
    assert cu.restart_counts(["p-decode-0-1", "p-lmcache-1"]) == {
        "p-decode-0-1": ("3f9a", 4), "p-lmcache-1": ("77b1", 0)}
    assert seen[0][:3] == ["docker", "inspect", "--format"]
    assert cu.restart_counts([]) == {}
