"""Suite-wide pytest hooks: the light inner loop runs on several workers, slowest tests first.

``pytest -m "not docker and not vllm and not netns"`` (the README's inner loop) selects only
tests that run fakes, the real proxy and short-lived tools (ansible-playbook --syntax-check,
ansible-lint, promtool). About half of their wall time is waiting (injected TTFT, timeouts,
bench durations), so on a 2-core machine they finish in about half the time on a few
pytest-xdist workers. That happens by itself when ALL of these hold:

- pytest-xdist is installed (the ``dev`` extra) and ``-n`` / ``--numprocesses`` was not given;
- the ``-m`` expression deselects every heavy marker (``docker``, ``vllm``, ``netns``): heavy
  suites share one machine-wide lock, start real stacks in session fixtures and must never
  share the cores with anything else, so any run that may select one stays serial (``.ci/run``
  therefore runs the light selection on workers first, then the heavy ones serially);
- no argument names single tests (``file::test``);
- ``PDSTACK_TEST_WORKERS`` is not ``0`` (it sets the number of workers; default 3: measured
  on 2 cores, 2 workers 107 s, 3 workers 83 s, 4 workers 79 s, serial 201 s).

``-n 0`` or ``PDSTACK_TEST_WORKERS=0`` forces the old serial run. On the workers, the tests
known to take longest are scheduled first (longest-processing-time-first), so that no worker
is left alone with a 15 s test at the end. And tests that only run CPU-bound tools
(ansible-lint, ansible-playbook, promtool: ``NICE_TOOLS``, no timing assertions) run at
nice +10 there (as root), so that the tests that measure latency (bench, proxy hardening,
fault timings) get the cores first, as in a serial run.
"""

from __future__ import annotations

import functools
import os

import pytest

HEAVY_MARKERS = ("docker", "vllm", "netns")
DEFAULT_WORKERS = 3

# Measured on a 2-core CI machine (``--durations``), slowest first; a prefix of a node id.
# Only the order on xdist workers depends on this list: a stale entry costs a little wall
# time, never a test.
SLOW_FIRST = (
    "tests/spine/test_first_day.py::test_fresh_clone_install_line_puts_pdstack_on_path",
    "tests/ansible/test_playbooks.py::test_ansible_lint_production",
    "tests/bench/test_proxy_overhead_script.py::test_script_writes_ratio_table",
    "tests/bench/test_end_to_end.py::test_sweep_measures_injected_ttft_and_itl",
    "tests/proxy/test_hardening.py::test_big_bodies_bounded_memory_and_health_stays_fast",
    "tests/host/test_h200_fixtures.py::test_rdma_ucx_role_on_recorded_ibv_devinfo_and_ucx_info",
    "tests/bench/test_end_to_end.py::test_compare_overlays_runs",
    "tests/proxy/test_hardening.py::test_head_timeout_spares_bodies_streams_and_kept_alive",
    "tests/bench/test_end_to_end.py::test_multi_turn_scenario_sends_sessions_and_records_gauges",
    "tests/proxy/test_hardening.py::test_frozen_prefiller_ejected_at_first_timeout",
    "tests/bench/test_end_to_end.py::test_closed_loop_keeps_n_streams",
    "tests/launch/test_launch.py::test_engines_start_in_parallel",
    "tests/bench/test_end_to_end.py::test_token_ids_and_client_side_pd",
    "tests/upgrade/test_role.py::",
    "tests/bench/test_end_to_end.py::test_errors_are_counted_by_kind",
    "tests/launch/test_launch.py::",
    "tests/ansible/test_playbooks.py::",
    "tests/proxy/test_hardening.py::",
    "tests/host/",
    "tests/bench/test_end_to_end.py::",
    "tests/proxy/test_faults.py::",
    "tests/proxy/test_cli_load.py::",
)


# node-id prefixes of tests that only run CPU-bound tools and assert no timing
NICE_TOOLS = (
    "tests/ansible/",
    "tests/host/",
    "tests/monitoring/",
    "tests/upgrade/test_role.py::",
)
NICE_TOOLS_BY = 10


@functools.cache  # asked once per test by the nice hook: compile each expression once
def _selects_no_heavy_test(markexpr: str) -> bool:
    """True when ``-m markexpr`` deselects a test carrying any one heavy marker."""
    if not markexpr.strip():
        return False
    try:
        from _pytest.mark.expression import Expression

        expr = Expression.compile(markexpr)
        return not any(
            expr.evaluate(lambda name, /, _m=marker, **_kw: name == _m) for marker in HEAVY_MARKERS
        )
    except Exception:  # an unknown pytest internals change: stay serial
        return False


def _workers() -> int:
    raw = os.environ.get("PDSTACK_TEST_WORKERS", "")
    try:
        return max(0, int(raw)) if raw.strip() else DEFAULT_WORKERS
    except ValueError:
        return DEFAULT_WORKERS


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config):
    """Before xdist reads its options: ``-n N`` for a light-only selection (see above)."""
    opt = config.option
    if (
        config.pluginmanager.hasplugin("xdist")
        and getattr(opt, "numprocesses", "unset") is None
        and not os.environ.get("PYTEST_XDIST_WORKER")
        and not opt.collectonly
        and not getattr(opt, "usepdb", False)
        and _selects_no_heavy_test(opt.markexpr or "")
        and not any("::" in str(arg) for arg in config.args)  # single tests: no worker start-up
        and _workers() > 1
    ):
        opt.numprocesses = _workers()
        # refill workers one test at a time: xdist's first batch is otherwise a quarter of a
        # worker's share in a row, i.e. every slow test on the first worker
        if getattr(opt, "maxschedchunk", None) is None:
            opt.maxschedchunk = 1
    return (yield)


def _slow_rank(nodeid: str) -> int:
    for rank, prefix in enumerate(SLOW_FIRST):
        if nodeid.startswith(prefix):
            return rank
    return len(SLOW_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On xdist workers only: known-slow tests first (a stable sort: the rest keep their
    order). A serial run keeps the file order, which some heavy suites rely on."""
    if os.environ.get("PYTEST_XDIST_WORKER") and _selects_no_heavy_test(
        config.option.markexpr or ""
    ):
        items.sort(key=lambda item: _slow_rank(item.nodeid))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """On xdist workers of a light run, as root: NICE_TOOLS tests (setup, call, teardown and
    what they start) at nice +NICE_TOOLS_BY, every other test at the worker's own nice."""
    if not (
        os.environ.get("PYTEST_XDIST_WORKER")
        and os.geteuid() == 0  # only root may lower the nice value back afterwards
        and item.nodeid.startswith(NICE_TOOLS)
        and _selects_no_heavy_test(item.config.option.markexpr or "")
    ):
        return (yield)
    before = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, min(19, before + NICE_TOOLS_BY))
    try:
        return (yield)
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)
