"""The docs are tested: README.md and docs/*.md.

- every relative link (and its ``#anchor``, GitHub's heading slugs) resolves;
- every ``pdstack ...`` command line parses with the current CLI: a line in a ``bash`` block is
  parsed whole by its subcommand's argparse (placeholders such as ``<proxy>`` filled in), an
  inline ```pdstack ...``` span has every flag checked against its subcommand;
- every ``inventory/<name>`` they name exists and ``pdstack validate`` accepts it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from pdstack.cli import SUBCOMMANDS, build_parser, main

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# inventory names; `<...>` is a placeholder, a trailing `*` a glob, after --inventory-out an output
INVENTORY = re.compile(r"(--inventory-out\s+)?\binventory/([A-Za-z0-9<][\w.+<>-]*)(\*?)")


def _rel(page: Path) -> str:
    return str(page.relative_to(REPO)) if page.is_relative_to(REPO) else page.name


def _split(text: str) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(fenced blocks as (language, lines), prose lines with fences removed)."""
    blocks: list[tuple[str, list[str]]] = []
    prose: list[str] = []
    fence: str | None = None
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(2)
            blocks.append((m.group(3).lower(), []))
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is not None:
            blocks[-1][1].append(line)
        else:
            prose.append(line)
    return blocks, prose


def _paragraphs(prose: list[str]) -> Iterator[str]:
    """Prose joined into paragraphs (a link or a code span may wrap onto the next line)."""
    para: list[str] = []
    for line in [*prose, ""]:
        if line.strip():
            para.append(line.strip())
        elif para:
            yield " ".join(para)
            para = []


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, every character but
    letters, digits, spaces, hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    _, prose = _split(page.read_text())
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def _links(page: Path) -> Iterator[str]:
    _, prose = _split(page.read_text())
    for para in _paragraphs(prose):
        for m in LINK.finditer(INLINE_CODE.sub("", para)):
            yield m.group(1)


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{_rel(page)}: link {target!r}: {path} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{_rel(page)}: link {target!r}: no heading #{anchor} in "
                            f"{_rel(dest)} (has: {', '.join(sorted(anchors(dest)))})")
    return problems


def command_lines(page: Path) -> Iterator[tuple[str, bool]]:
    """(command line, whole): ``whole`` for a line of a shell block (parsed whole), else an
    inline span (its flags checked)."""
    blocks, prose = _split(page.read_text())
    for lang, lines in blocks:
        if lang not in SHELL_LANGS:
            continue
        joined = "\n".join(lines).replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("pdstack "):
                yield line, True
    for para in _paragraphs(prose):
        for m in INLINE_CODE.finditer(para):
            code = m.group(2).strip()
            if code.startswith("pdstack "):
                yield code, False


def _fill(line: str) -> list[str]:
    line = re.sub(r"\[(--[^\]]*)\]", r"\1", line)  # an optional flag shown as [--flag V]
    line = re.sub(r"<[^<>]*>", "1", line)  # <proxy>, <rev>, <name>
    return shlex.split(line, comments=True)


@cache
def _parser(sub: str) -> argparse.ArgumentParser:
    return build_parser(only=sub)


def _subparser(parser: argparse.ArgumentParser, words: list[str]) -> argparse.ArgumentParser:
    """The deepest (sub)subcommand parser that ``words`` name."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for w in words:
                if w in action.choices:
                    return _subparser(action.choices[w], words[words.index(w) + 1:])
    return parser


def command_problem(line: str, whole: bool) -> str | None:
    words = _fill(line)
    if len(words) < 2 or words[1] not in SUBCOMMANDS:
        return f"{line!r}: not a pdstack subcommand (have: {', '.join(SUBCOMMANDS)})"
    if whole:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                _parser(words[1]).parse_args(words[1:])
            except SystemExit as exc:
                if exc.code:
                    return f"{line!r}: {err.getvalue().strip().splitlines()[-1]}"
        return None
    sub = _subparser(_parser(words[1]), words[1:])
    for w in words[2:]:
        flag = w.split("=", 1)[0]
        if flag.startswith("-") and flag not in sub._option_string_actions:
            return f"{line!r}: {sub.prog} has no option {flag}"
    return None


def inventories(page: Path) -> Iterator[str]:
    for m in INVENTORY.finditer(page.read_text()):
        out, name, glob = m.groups()
        if out or "<" in name:
            continue
        yield name + glob


def inventory_problem(name: str) -> str | None:
    found = sorted(p.name for p in (REPO / "inventory").glob(name) if (p / "hosts.yml").is_file())
    if not found:
        return f"inventory/{name} does not exist"
    return None


# ---------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    problems = broken_links(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_pdstack_command_line_parses_with_the_current_cli(page: Path) -> None:
    problems = [p for line, whole in command_lines(page) if (p := command_problem(line, whole))]
    assert not problems, "\n".join(problems)


def test_every_named_inventory_exists_and_validates(capsys: pytest.CaptureFixture[str]) -> None:
    names = sorted({n for page in PAGES for n in inventories(page)})
    problems = [p for n in names if (p := inventory_problem(n))]
    assert not problems, "\n".join(problems)
    for name in names:
        for inv in sorted((REPO / "inventory").glob(name)):
            assert main(["validate", "-i", str(inv)]) == 0, capsys.readouterr().err
    assert len(names) >= 5  # the pages name the inventories they talk about


def test_the_pages_have_commands_to_check() -> None:
    """Not vacuous: the README and the docs hold pdstack command lines, whole ones among them."""
    lines = [c for page in PAGES for c in command_lines(page)]
    assert sum(whole for _, whole in lines) >= 10 and len(lines) >= 20


# ------------------------------------------------------- the checks catch what they claim to


def test_slugs_follow_github() -> None:
    assert slug("Measured on 1\u00d7H200 (`results/h200x1-tiers/`): the default") == (
        "measured-on-1h200-resultsh200x1-tiers-the-default")
    assert slug("Self-healing: what a fault costs") == "self-healing-what-a-fault-costs"
    assert slug("[KV modes](kv-modes.md) & tiers") == "kv-modes--tiers"


def test_a_broken_link_a_removed_flag_and_a_missing_inventory_are_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Top\n[ok](#top) [gone](nowhere.md) [bad anchor](#nope)\n")
    assert [p.split(": ", 2)[1] for p in broken_links(page)] == [
        "link 'nowhere.md'", "link '#nope'"]
    assert command_problem("pdstack launch -i inventory/h200x1 --no-such-flag", True)
    assert command_problem("pdstack launch -i inventory/h200x1 --no-such-flag", False)
    assert command_problem("pdstack render -i inventory/<name> -o DIR", True) is None
    assert command_problem("pdstack frobnicate", False)
    assert inventory_problem("no-such-inventory")
    assert inventory_problem("h200x2-*") is None
