"""The node's rendered stack files that an upgrade edits: the ``.env`` lines of an engine
and its generation in ``backends.json``; and the new model argument of a revision."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from pdstack import naming
from pdstack.upgrade.common import UpgradeError

env_prefix = naming.env_prefix  # ``decode-1`` -> ``DECODE_1``, as the renderer names it


class StackEnv:
    """The stack's ``.env``: read and edit ``KEY=VALUE`` lines in place, atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for line in self.path.read_text().splitlines():
            if line and not line.startswith("#") and "=" in line:
                key, value = line.split("=", 1)
                out[key.strip()] = value.strip()
        return out

    def update(self, values: dict[str, str], comments: dict[str, str] | None = None) -> None:
        """Replace the lines of ``values``' keys (they must exist); ``comments`` maps a
        comment line's prefix to its new text (the renderer's ``# svc: ...`` lines)."""
        lines = self.path.read_text().splitlines()
        seen: set[str] = set()
        for i, line in enumerate(lines):
            if "=" in line and not line.startswith("#"):
                key = line.split("=", 1)[0].strip()
                if key in values:
                    lines[i] = f"{key}={values[key]}"
                    seen.add(key)
            elif comments:
                for prefix, text in comments.items():
                    if line.startswith(prefix):
                        lines[i] = text
        missing = set(values) - seen
        if missing:
            raise UpgradeError(f"{self.path}: no line for {', '.join(sorted(missing))}")
        atomic_write(self.path, "\n".join(lines) + "\n")


def atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def set_backends_json_generation(path: Path, backend: str, generation: str) -> None:
    """Keep the rendered ``backends.json`` in step, so a proxy restart mid-upgrade (or
    after it) starts with each engine's real generation."""
    if not path.exists():
        return
    data = json.loads(path.read_text())
    for b in data.get("backends", []):
        if b.get("name") == backend:
            b["generation"] = generation
    atomic_write(path, json.dumps(data, indent=2) + "\n")


def new_model_arg(old_model: str, old_rev: str, new_rev: str, template: str | None) -> str:
    """The model argument for ``new_rev``: from ``template`` (``{revision}``) when given,
    else the old path with its revision path segment replaced."""
    if template:
        return template.replace("{revision}", new_rev)
    parts = old_model.split("/")
    if old_rev and old_rev in parts:
        return "/".join(new_rev if p == old_rev else p for p in parts)
    return old_model


generation = naming.generation  # ``<revision>@<image>``, as the planner names it
