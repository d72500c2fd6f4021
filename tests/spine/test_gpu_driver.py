"""gpu/run_ceiling.sh's data against itself and against gpu/README.md, without a GPU: every
extra proxy, router and SUB taker is a stack of STACKS, and every sweep the README's rehearsal
and next-session commands name parses to a workload and a stack the driver has (the run
itself: gpu/dry_run.sh, minutes)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DRIVER = (REPO / "gpu" / "run_ceiling.sh").read_text()
README = (REPO / "gpu" / "README.md").read_text()


def grab(pattern: str) -> str:
    """The driver's text that ``pattern``'s first group matches."""
    m = re.search(pattern, DRIVER, re.M | re.S)
    assert m, f"gpu/run_ceiling.sh has no {pattern}"
    return m.group(1)


def table(name: str) -> list[str]:
    """The first word of each row of the driver's bash array NAME=( ... )."""
    return re.findall(r'^\s+"([\w.-]+) ', grab(rf"^{name}=\(\n(.*?)\n\)"), re.M)


STACKS = table("STACKS")
PREFIXES = grab(r"case \$st in ([\w|*-]+)\)").replace("*", "").split("|")  # parse_sweep's


def stack_of(sweep: str) -> str:
    st = re.sub(r"-r\d+$", "", sweep)
    return next((st[len(p):] for p in PREFIXES if st.startswith(p)), st)


def test_the_driver_tables_name_its_stacks() -> None:
    assert len(STACKS) == len(set(STACKS)) > 20
    for name in ("EXTRA_PROXIES", "ROUTERS"):
        assert set(table(name)) <= set(STACKS), name
    takers = grab(r'^SUB_TAKERS=" (.*?) "$').split()
    assert set(takers) <= set(table("EXTRA_PROXIES")) | set(table("ROUTERS"))


def test_the_readme_commands_name_the_drivers_sweeps() -> None:
    """The README's sections a newcomer runs (not the session history below them)."""
    live = README[README.index("## Rehearse"):README.index("### Issue 53: overload")]
    sweeps = {s for m in re.findall(r'SWEEPS="([^"]+)"', live) for s in m.split()}
    assert {"rt-pdstack", "rt-pd-w16", "flood-iso", "heal-pdstack-engine"} <= sweeps
    unknown = sorted(s for s in sweeps if s != "\\" and stack_of(s) not in STACKS)
    assert unknown == [], f"gpu/README.md names sweeps gpu/run_ceiling.sh does not have: {unknown}"
