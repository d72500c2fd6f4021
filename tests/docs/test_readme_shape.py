"""The front page stays a front page and results stay data (issue 57).

- README.md has at most 150 lines and no markdown table cell over 60 words (a headline row is one
  claim, its number range and its link; the history lives in the linked results READMEs);
- no tracked file under results/ or benchmarks/results/ is a log (``*.log``, ``*.tail``, a
  ``logs/`` folder): logs stay in the git history, a README quotes what it needs in an
  ``*-excerpt.txt``;
- every relative link in a results README resolves (a removed log must not be linked).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from test_docs import _split, broken_links

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_LINES = 150
MAX_CELL_WORDS = 60
LOG = re.compile(r"\.(log|tail)$|(^|/)logs/")
RESULT_PAGES = sorted([*(REPO / "results").rglob("*.md"), *(REPO / "benchmarks").rglob("*.md")])


def table_cells(text: str) -> list[tuple[int, str]]:
    """(prose line number, cell text) of every markdown table cell outside fenced blocks; a
    ``|`` inside a code span or escaped as ``\\|`` does not split a cell."""
    _, prose = _split(text)
    cells = []
    for n, line in enumerate(prose, 1):
        row = line.strip()
        if not row.startswith("|"):
            continue
        masked = re.sub(r"(`+)(.+?)\1", lambda m: m.group(0).replace("|", "\0"), row)
        masked = masked.replace("\\|", "\0")
        for cell in masked.strip("|").split("|"):
            if not re.fullmatch(r"\s*:?-+:?\s*", cell):  # the |---| line
                cells.append((n, cell.replace("\0", "|").strip()))
    return cells


def long_cells(text: str, limit: int = MAX_CELL_WORDS) -> list[str]:
    return [f"line {n}: {len(c.split())} words: {c[:80]}..." for n, c in table_cells(text)
            if len(c.split()) > limit]


def log_files(paths: list[str]) -> list[str]:
    return [p for p in paths if LOG.search(p)]


def test_the_readme_is_at_most_150_lines() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines (at most {MAX_LINES}): move detail to docs/"


def test_no_readme_table_cell_is_over_60_words() -> None:
    cells = table_cells(README.read_text())
    assert len(cells) > 50, "README.md's tables were not found"  # not vacuous
    problems = long_cells(README.read_text())
    assert not problems, "README.md table cells over 60 words:\n" + "\n".join(problems)


def test_the_shape_checks_catch_a_long_cell() -> None:
    text = ("| what | result |\n|---|---|\n| a `x | y` claim | " + "word " * 61 + "|\n"
            "```\n| " + "word " * 70 + "|\n```\n")
    assert [n for n, _ in table_cells(text)] == [1, 1, 3, 3]
    assert table_cells(text)[2] == (3, "a `x | y` claim")
    assert len(long_cells(text)) == 1  # the fenced one is not a table
    assert long_cells(text.replace("word " * 61, "word " * 60)) == []


def test_no_log_is_tracked_under_results() -> None:
    tracked = subprocess.run(["git", "ls-files", "results", "benchmarks/results"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    assert any(p.endswith(".json") for p in tracked)  # not vacuous
    logs = log_files(tracked)
    assert not logs, f"{len(logs)} log files tracked (the git history keeps them): {logs[:10]}"


def test_the_log_pattern() -> None:
    assert log_files(["results/a/run.log", "results/a/logs/engine.pid", "results/a/b.out.tail",
                      "results/a/x.json", "results/a/machine.txt", "results/a/crash-excerpt.txt",
                      "results/a/catalogs.json"]) == [
        "results/a/run.log", "results/a/logs/engine.pid", "results/a/b.out.tail"]


@pytest.mark.parametrize("page", RESULT_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_in_a_results_readme_resolves(page: Path) -> None:
    problems = broken_links(page)
    assert not problems, "\n".join(problems)
