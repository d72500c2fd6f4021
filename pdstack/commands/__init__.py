"""Helpers the subcommands share."""

from __future__ import annotations

import sys
from pathlib import Path

from pdstack.topology import Topology, TopologyError, load_topology

EXIT_INVALID = 2


class InvalidInventory(SystemExit):
    """The inventory does not validate; its problems are printed. ``pdstack.cli.main``
    returns the code (2); outside it, it exits like ``sys.exit(2)``."""


def load_or_exit(inventory: str | Path, prog: str = "pdstack") -> Topology:
    """The validated topology, or one ``error:`` line per problem on stderr and
    :class:`InvalidInventory` (exit 2)."""
    try:
        return load_topology(inventory)
    except TopologyError as err:
        print(f"{prog}: invalid inventory {inventory}:", file=sys.stderr)
        for p in err.problems:
            print(f"  error: {p}", file=sys.stderr)
        raise InvalidInventory(EXIT_INVALID) from err
