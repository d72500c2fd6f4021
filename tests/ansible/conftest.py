"""Ansible test fixtures; helpers live in anshelpers.py (a unique module name)."""

from anshelpers import lab_fixtures

alab, clean_alab = lab_fixtures()

__all__ = ["alab", "clean_alab"]
