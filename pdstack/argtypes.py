"""argparse ``type=`` converters shared by the CLIs: one wording for a bad number."""

from __future__ import annotations

import argparse
from typing import Any


def positive(text: str, kind: type, noun: str, unit: str = "") -> Any:
    """``kind(text)`` if it is > 0; else ArgumentTypeError ("not NOUN" / "must be > 0UNIT")."""
    try:
        value = kind(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from exc
    if not value > 0:
        got = value if kind is int else text
        raise argparse.ArgumentTypeError(f"must be > 0{unit}, got {got}")
    return value


def positive_int(text: str) -> int:
    return int(positive(text, int, "an integer"))


def seconds(text: str) -> float:
    return float(positive(text, float, "a number", " seconds"))
