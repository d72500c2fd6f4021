"""Preflight test fixtures; the helpers live in pfhelpers.py (a unique module name, so
other test folders' conftest modules never shadow them)."""

from pfhelpers import clean_lab, lab, lab_inventory

__all__ = ["clean_lab", "lab", "lab_inventory"]
