"""The lab's own tests use the lab under the prefix ``pdlabt``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if "pdstack_netns_lab" not in sys.modules:
    _spec = importlib.util.spec_from_file_location(
        "pdstack_netns_lab", Path(__file__).resolve().with_name("lab.py"))
    assert _spec is not None and _spec.loader is not None
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["pdstack_netns_lab"] = _mod
    _spec.loader.exec_module(_mod)
netns_lab = sys.modules["pdstack_netns_lab"]

lab, clean_lab = netns_lab.lab_fixtures("pdlabt")
