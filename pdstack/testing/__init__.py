"""Test doubles for pdstack (never used in production paths)."""
