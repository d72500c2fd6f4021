"""``vllm_engines.running`` (the `vllm` suites' fixtures start their engines through it):
every engine it started is stopped, the last first, also when a later one fails to start.
Stand-ins for the engines: nothing starts vLLM here."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from pdstack.testing import vllm_engines as ve


class _Engine:
    def __init__(self, name: str, stopped: list[str]) -> None:
        self.name = name
        self._stopped = stopped

    def stop(self) -> None:
        self._stopped.append(self.name)


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    """No venv check, no heavy-run lock, a readiness wait that records what it waited for."""
    waited: list[list[Any]] = []
    monkeypatch.setattr(ve, "require_venv", lambda: None)
    monkeypatch.setattr(ve, "heavy_lock", contextlib.nullcontext)
    monkeypatch.setattr(ve, "wait_ready", lambda procs: waited.append(list(procs)))
    return waited


def test_started_ready_then_stopped_last_first(no_vllm: list[list[Any]]) -> None:
    stopped: list[str] = []
    engines: Iterator[Any] = (_Engine(n, stopped) for n in ("p", "d"))
    with ve.running(engines) as procs:
        assert [p.name for p in procs] == ["p", "d"] and no_vllm == [procs]
        assert not stopped
    assert stopped == ["d", "p"]


def test_a_failed_start_stops_the_ones_started(no_vllm: list[list[Any]]) -> None:
    stopped: list[str] = []

    def starts() -> Iterator[Any]:
        yield _Engine("p", stopped)
        yield _Engine("d", stopped)
        raise RuntimeError("the third engine would not start")

    with pytest.raises(RuntimeError, match="third"), ve.running(starts()):
        pytest.fail("not reached")
    assert stopped == ["d", "p"] and no_vllm == []
