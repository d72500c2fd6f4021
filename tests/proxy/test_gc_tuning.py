"""The proxy's garbage-collector tuning (pdstack.proxy.gc_tuning, issues 53/54): once
``pdstack proxy`` serves, what is alive is frozen (``--gc T0,T1,T2``: those thresholds too);
``--gc default`` (or ``PDSTACK_PROXY_GC=default``) leaves CPython's settings; leaving
``serve`` undoes it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
from collections.abc import Iterator

import pytest

from pdstack.proxy import cli, gc_tuning
from pdstack.proxy.app import Proxy
from pdstack.proxy.backends import BackendRegistry
from pdstack.testing import proxy_harness as ph
from pdstack.testing.ports import free_port


@pytest.fixture(autouse=True)
def gc_as_found() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


FROZEN_AT_START = gc.get_freeze_count()  # CPython's own (375 in 3.12), not the proxy's


def test_modes() -> None:
    assert gc_tuning.parse_mode("tuned") == gc_tuning.THRESHOLDS
    assert gc_tuning.parse_mode("default") is None
    assert gc_tuning.parse_mode("off") is None
    assert gc_tuning.parse_mode("20000,10,50") == (20000, 10, 50)
    for bad in ("fast", "1,2", "0,10,10", "1000,-1,10", "a,b,c"):
        with pytest.raises(ValueError):
            gc_tuning.parse_mode(bad)


@pytest.mark.parametrize("mode", ["tuned", "20000,5,50"])
def test_tune_freezes_and_restore_undoes(mode: str) -> None:
    before = gc.get_threshold()
    tuning = gc_tuning.tune(mode)
    assert tuning is not None
    assert gc.get_freeze_count() > FROZEN_AT_START + 1000  # the modules, the app
    assert tuning.frozen == gc.get_freeze_count()
    assert gc.get_threshold() == gc_tuning.parse_mode(mode)
    gc_tuning.restore(tuning)
    assert gc.get_freeze_count() == 0  # unfrozen: walked again
    assert gc.get_threshold() == before


def test_default_changes_nothing() -> None:
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    assert gc_tuning.tune("default") is None
    assert gc.get_freeze_count() == frozen
    assert gc.get_threshold() == before
    gc_tuning.restore(None)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(), "proxy", "")
    return parser


def test_the_flag_defaults_to_tuned_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gc_tuning.ENV, raising=False)
    assert _parser().parse_args(["proxy"]).gc == "tuned"
    monkeypatch.setenv(gc_tuning.ENV, "default")
    assert _parser().parse_args(["proxy"]).gc == "default"
    assert _parser().parse_args(["proxy", "--gc", "tuned"]).gc == "tuned"


def test_a_bad_mode_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["proxy", "--kv-mode", "colocated", "--prefill",
                                 "http://127.0.0.1:1", "--gc", "fast", "--env-file", "/dev/null"])
    assert cli.run(args) == 2
    assert "gc mode 'fast'" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["tuned", "default"])
async def test_serve_tunes_while_serving_and_restores(mode: str) -> None:
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    table = ph.table("colocated", [{"name": "e0", "role": "colocated", "node": "n1",
                                     "url": "http://127.0.0.1:1", "generation": "g"}])
    proxy = Proxy(BackendRegistry.from_table(table))
    task = asyncio.create_task(cli.serve(proxy, "127.0.0.1", free_port(), mode))
    try:
        if mode == "tuned":
            await ph.until(lambda: gc.get_freeze_count() > frozen + 1000, "frozen once serving")
            assert gc.get_threshold() == gc_tuning.THRESHOLDS
        else:
            await asyncio.sleep(0.3)
            assert gc.get_freeze_count() == frozen
            assert gc.get_threshold() == before
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert gc.get_freeze_count() <= frozen
    assert gc.get_threshold() == before
