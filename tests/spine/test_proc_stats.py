"""pdstack.testing.proc_stats: the /proc readings the cost benchmarks report."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from pdstack.testing.proc_stats import cpu_seconds, process_tree


def test_a_child_is_in_its_parents_tree_and_its_cpu_counts() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = process_tree(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree
        assert process_tree(child.pid) == [child.pid]
    finally:
        child.kill()
        child.wait()
    assert cpu_seconds([child.pid]) == 0.0, "a process gone counts nothing"
    before = cpu_seconds([os.getpid()])
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    assert cpu_seconds([os.getpid()]) - before >= 0.2
