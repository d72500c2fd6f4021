"""What a KV mode implies for one engine (``KvMode.engine``, issue 57): the one record the
ports and the engine's kv-transfer-config are written from."""

from __future__ import annotations

import pytest

from pdstack import kvmodes

# (mode, role, has a partner on another node) -> (nixl, LMCache tier, push)
FACTS = [
    ("colocated", "colocated", False, (False, False, None)),
    ("colocated+l1", "colocated", False, (False, True, None)),
    ("nixl", "prefill", False, (True, False, None)),
    ("nixl", "decode", True, (True, False, None)),
    # the tier is the prefillers' (LMCache PR #4355): decoders take NIXL alone
    ("nixl+l1", "prefill", False, (True, True, None)),
    ("nixl+l1", "decode", False, (True, False, None)),
    ("shared-l1", "prefill", False, (False, True, None)),
    ("shared-l1", "decode", False, (False, True, None)),
    # NIXL only for a role with a partner on another node
    ("shared-l1+nixl", "prefill", False, (False, True, None)),
    ("shared-l1+nixl", "prefill", True, (True, True, None)),
    ("shared-l1+nixl", "decode", True, (True, True, None)),
    ("lmcache-pd", "prefill", True, (False, False, "sender")),
    ("lmcache-pd", "decode", False, (False, False, "receiver")),
]


@pytest.mark.parametrize(("mode", "role", "cross", "want"), FACTS)
def test_a_mode_says_what_each_engine_runs(mode: str, role: str, cross: bool, want: tuple) -> None:
    kv = kvmodes.get(mode).engine(role, cross)
    assert (kv.nixl, kv.lmcache_tier, kv.push) == want
    assert kv.receives_push == (want[2] == "receiver")


def test_every_mode_names_every_role_it_runs() -> None:
    for mode in kvmodes.MODES.values():
        roles = ("prefill", "decode") if mode.disaggregated else ("colocated",)
        for role in roles:
            assert any(f[:2] == (mode.name, role) for f in FACTS), (mode.name, role)


def test_the_kv_roles_follow_the_handoff() -> None:
    pre = kvmodes.get("nixl+l1").engine("prefill")
    assert (pre.handoff_role, pre.multi_role, pre.load_failure_policy) == (
        "kv_producer", "kv_producer", "fail")
    dec = kvmodes.get("shared-l1+nixl").engine("decode", cross_node_partner=True)
    # its same-node pairs hand off through the store: kv_both at the top
    assert (dec.handoff_role, dec.multi_role, dec.load_failure_policy) == (
        "kv_consumer", "kv_both", None)
