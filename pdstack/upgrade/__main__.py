"""Standalone on a node (stdlib only): the engine_upgrade Ansible role copies this file to
the node as its upgrade script, with the modules it imports in a ``pdstack/`` folder beside
it (``pdstack/__init__.py``, ``kvmodes.py``, ``naming.py``, ``secrets.py``,
``upgrade/*.py``), and runs it there, next to the node's Docker Compose.  Also
``python -m pdstack.upgrade``."""

from __future__ import annotations

import sys

from pdstack.upgrade.cli import standalone

if __name__ == "__main__":
    sys.exit(standalone())
