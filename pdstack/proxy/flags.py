"""Command-line flags made from config dataclass fields: one home for a flag's name, type
and default (the field's)."""

from __future__ import annotations

import typing
from typing import Any, NamedTuple


class Flag(NamedTuple):
    """A flag for one config field: ``--FIELD`` (dashed, without ``_s``) unless ``flag``
    names it; its type and default are the dataclass field's."""

    field: str
    help: str | None = None
    flag: str | None = None
    metavar: str | None = None

    def name(self, prefix: str = "") -> str:
        return self.flag or "--" + prefix + self.field.removesuffix("_s").replace("_", "-")


def dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def add_fields(group: Any, config: Any, flags: tuple[Flag, ...], prefix: str = "") -> None:
    """Add ``flags`` to ``group``, each typed and defaulted by ``config``'s field."""
    hints = typing.get_type_hints(type(config))
    for f in flags:
        hint = hints[f.field]  # ``float | None`` -> float
        kind = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
        extra = {"metavar": f.metavar} if f.metavar else {}
        group.add_argument(
            f.name(prefix), type=kind, default=getattr(config, f.field), help=f.help, **extra
        )
