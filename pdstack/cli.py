"""The ``pdstack`` command line.

Its help is plain text: :func:`plain` takes the reST markup (````x````, ``:func:`x```) out of
the descriptions and help strings the subcommand modules take from their docstrings.

Each subcommand lives in its own module, which exposes ``register(subparsers)``;
modules are imported only when their subcommand runs, so ``pdstack render``
never pays for the proxy's or the bench's imports.

Exit codes: 0 ok, 1 a check failed, 2 misuse / invalid input.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("pdstack.commands.topology", "check an inventory; one error per problem"),
    "plan": ("pdstack.commands.topology", "print the planned services, pairings and edges"),
    "render": ("pdstack.commands.topology", "render per-node compose stacks into build/"),
    "proxy": ("pdstack.proxy.cli", "run the P/D-aware OpenAI proxy"),
    "preflight": ("pdstack.preflight.cli", "probe every network path the topology needs"),
    "bench": ("pdstack.bench.cli", "prefix-heavy chat benchmark: asked vs served, TTFT"),
    "launch": ("pdstack.launch", "run a node's planned services as plain processes"),
    "upgrade": ("pdstack.upgrade", "rolling upgrade of one node's engines"),
    "advise": ("pdstack.advise", "from bench curves to the topology that meets a target"),
    "secrets": ("pdstack.secrets", "write each service's own secrets file from the node's"),
}


DESCRIPTION = ("pdstack plans and deploys prefill/decode vLLM stacks (engines, LMCache, the "
               "OpenAI proxy) from an inventory. Exit codes: 0 ok, 1 a check failed, 2 misuse "
               "or invalid input.")
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")
_EMPHASIS = re.compile(r"\*\*([^*]+)\*\*")


def plain(text: str | None) -> str | None:
    """``text`` without reST markup: ``:func:`x``` and ````x```` become x, ``**x**`` x."""
    if not text:
        return text
    return _EMPHASIS.sub(r"\1", _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text)))


def _plain_help(parser: argparse.ArgumentParser) -> None:
    parser.description = plain(parser.description)
    parser.epilog = plain(parser.epilog)
    for action in parser._actions:
        action.help = plain(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                choice.help = plain(choice.help)
            for sub in dict.fromkeys(action.choices.values()):
                _plain_help(sub)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdstack", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_name)
        module.register(sub, name, help_text)
    _plain_help(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_list if not a.startswith("-")), None)
    only = command if command in SUBCOMMANDS else None
    if only is None:
        parser = build_parser(only="")  # help only: import nothing
        if args_list and args_list[0] not in ("-h", "--help"):
            parser.parse_args(args_list)  # exits 2 naming the bad command
        parser.print_help()
        return 0
    parser = build_parser(only=only)
    args = parser.parse_args(args_list)
    from pdstack.commands import InvalidInventory

    try:
        result = args.func(args)
    except InvalidInventory as exc:  # its problems are printed
        return int(exc.code or 0)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
