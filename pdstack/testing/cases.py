"""Table-driven tests: one ``(id, *values)`` tuple a case."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest


def named_cases(argnames: Sequence[str], cases: Sequence[Sequence[Any]]) -> Any:
    """``pytest.mark.parametrize`` over ``cases``; the first item of each names it."""
    return pytest.mark.parametrize(
        tuple(argnames), [tuple(c[1:]) for c in cases], ids=[c[0] for c in cases]
    )
