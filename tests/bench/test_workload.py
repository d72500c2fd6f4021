"""Workload: Poisson arrivals, length distributions, shared system prompts."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from pdstack.bench.workload import (
    Distribution,
    DistributionError,
    Workload,
    WorkloadConfig,
    poisson_arrivals,
)


def test_poisson_arrivals_count_and_exponential_gaps() -> None:
    rate, duration = 50.0, 200.0
    arrivals = poisson_arrivals(rate, duration, random.Random(1))
    n = len(arrivals)
    expected = rate * duration
    assert abs(n - expected) < 4 * math.sqrt(expected)  # Poisson count, 4 sigma
    assert all(0 <= t < duration for t in arrivals)
    assert arrivals == sorted(arrivals)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / rate, rel=0.05)
    # exponential: sd == mean (a fixed-interval or uniform schedule fails this)
    assert statistics.pstdev(gaps) == pytest.approx(mean, rel=0.05)
    # memorylessness check at one point: P(gap < 1/rate) = 1 - 1/e
    share = sum(1 for g in gaps if g < 1 / rate) / len(gaps)
    assert share == pytest.approx(1 - math.exp(-1), abs=0.02)


def test_poisson_arrivals_are_deterministic_per_seed() -> None:
    a = poisson_arrivals(5.0, 10.0, random.Random("x"))
    assert a == poisson_arrivals(5.0, 10.0, random.Random("x"))
    assert a != poisson_arrivals(5.0, 10.0, random.Random("y"))
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 10.0, random.Random(0))


@pytest.mark.parametrize(
    ("spec", "lo", "hi", "mean"),
    [("128", 128, 128, 128), ("uniform:10:20", 10, 20, 15), ("normal:100:10", 40, 160, 100),
     ("lognormal:200:0.5", 1, 10_000, 200)],
)
def test_distribution_samples(spec: str, lo: int, hi: int, mean: float) -> None:
    dist = Distribution.parse(spec)
    rng = random.Random(3)
    samples = [dist.sample(rng) for _ in range(20_000)]
    assert all(lo <= s <= hi for s in samples)
    assert statistics.fmean(samples) == pytest.approx(mean, rel=0.03)
    assert str(Distribution.parse(str(dist))) == str(dist)


@pytest.mark.parametrize("spec", ["0", "abc", "uniform:5", "uniform:9:3", "gamma:1:2",
                                  "normal:-1:2", ""])
def test_distribution_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(DistributionError):
        Distribution.parse(spec)


def test_shared_share_and_k_system_prompts() -> None:
    cfg = WorkloadConfig(num_system_prompts=3, shared_share=0.8,
                         system_len=Distribution.parse("64"), user_len=Distribution.parse("8"))
    wl = Workload(cfg)
    reqs = [wl.next_request() for _ in range(5000)]
    shared = [r for r in reqs if r.shared]
    assert len(shared) / len(reqs) == pytest.approx(0.8, abs=0.03)
    assert {r.system_prompt_id for r in shared} == {0, 1, 2}
    assert len({r.system for r in shared}) == 3
    unique = [r for r in reqs if not r.shared]
    assert len({r.system for r in unique}) == len(unique)  # no accidental sharing
    assert len(set(wl.system_prompts)) == 3
    assert all(len(str(r.system).split()) == 64 for r in reqs)
    # same seed, same requests
    again = Workload(cfg)
    assert [again.next_request() for _ in range(50)] == reqs[:50]


def test_token_id_prompts() -> None:
    cfg = WorkloadConfig(num_system_prompts=2, token_ids=True, token_id_min=100,
                         token_id_max=200, system_len=Distribution.parse("32"),
                         user_len=Distribution.parse("uniform:4:8"))
    wl = Workload(cfg)
    for _ in range(200):
        r = wl.next_request()
        assert isinstance(r.system, list) and isinstance(r.user, list)
        assert len(r.system) == 32 and 4 <= len(r.user) <= 8
        assert all(isinstance(t, int) and 100 <= t < 200 for t in r.system + r.user)
        assert r.prompt_len == len(r.system) + len(r.user)
    assert wl.system_prompts[0] != wl.system_prompts[1]


@pytest.mark.parametrize("token_ids", [True, False])
def test_prompt_salt_changes_only_each_prompts_lead(token_ids: bool) -> None:
    """--prompt-salt: the same workload (lengths, sharing, every id or word after the lead),
    but each prompt's first token id / first word differs between salts: cold caches with no
    cache_salt, so a router that hashes the prompt sees the engines' own blocks."""
    def draw(salt: str | None) -> list:
        wl = Workload(WorkloadConfig(num_system_prompts=3, token_ids=token_ids,
                                     token_id_min=10, token_id_max=100_000, seed=7,
                                     prompt_salt=salt))
        return [wl.next_request() for _ in range(60)]
    plain, a, b = draw(None), draw("run-a"), draw("run-b")
    for x, y, z in zip(plain, a, b, strict=True):
        assert (x.system_prompt_id, x.max_tokens) == (y.system_prompt_id, y.max_tokens) \
            == (z.system_prompt_id, z.max_tokens)
        if token_ids:
            assert x.system[1:] == y.system[1:] == z.system[1:]
            assert len({x.system[0], y.system[0], z.system[0]}) == 3
        else:
            assert y.system.startswith("run-a system prompt") or y.system.startswith("run-a unique")
            assert y.system.split()[1:] == z.system.split()[1:]
            assert not x.system.startswith("run-")


def test_config_rejects_bad_share() -> None:
    with pytest.raises(ValueError):
        WorkloadConfig(shared_share=1.5)
    with pytest.raises(ValueError):
        WorkloadConfig(num_system_prompts=0)


def test_no_return_token_ids_leaves_only_openais_fields() -> None:
    """--no-return-token-ids: a token-id prompt's body has no ``return_token_ids``
    (vllm-router 0.1.17's kv_aware skips its KV lookup for any field it does not model);
    by default it asks for them."""
    from pdstack.bench.client import build_body

    req = Workload(WorkloadConfig(token_ids=True)).next_request()
    assert build_body(req, "m", "completions")["return_token_ids"] is True
    body = build_body(req, "m", "completions", token_ids_back=False)
    assert "return_token_ids" not in body
    assert set(body) == {"model", "max_tokens", "stream", "stream_options", "temperature",
                         "ignore_eos", "prompt"}
