"""The learned KV watermark (pdstack.proxy.kv_mark): pure state, no engine, no timing."""

from __future__ import annotations

import math

from pdstack.proxy.kv_mark import GROW, SHRINK, KvMark

SLO = 2.0  # fast below 0.5 s, slow above 1 s


def test_a_fixed_mark_never_moves_but_shows_the_engines_first_bytes() -> None:
    mark = KvMark(0.97, 0.0)  # the default: no learning (the ceiling is the floor)
    assert mark.ceiling == 0.97 and mark.value == 0.97 and mark.at_floor
    mark.held(100.0)
    for _ in range(50):
        mark.first_byte(0.05, 100.5, SLO)
    assert mark.value == 0.97
    assert math.isclose(mark.first_byte_s, 0.05)
    mark.first_byte(5.0, 100.6, SLO)
    assert mark.value == 0.97 and math.isclose(mark.first_byte_s, 0.9 * 0.05 + 0.1 * 5.0)


def test_the_mark_rises_only_while_it_binds_and_the_engine_answers_fast() -> None:
    mark = KvMark(0.97, 1.2)
    for _ in range(20):  # fast, but the mark held nothing: an unbound mark stays
        mark.first_byte(0.1, 10.0, SLO)
    assert mark.value == 0.97
    mark.held(10.0)
    for _ in range(20):
        mark.first_byte(0.1, 11.0, SLO)
    assert math.isclose(mark.value, 0.97 + 20 * GROW) and not mark.at_floor
    for _ in range(20):  # the hold is 2 s old: no longer bound
        mark.first_byte(0.1, 12.5, SLO)
    assert math.isclose(mark.value, 0.97 + 20 * GROW)
    mark.held(20.0)
    for _ in range(1000):
        mark.first_byte(0.1, 20.1, SLO)
    assert mark.value == 1.2, "never past its ceiling"
    # between fast and slow: it stays
    mark.first_byte_s = 0.7
    mark.first_byte(0.7, 20.2, SLO)
    assert mark.value == 1.2


def test_slow_first_bytes_bring_the_mark_down_to_its_floor_fast() -> None:
    mark = KvMark(0.97, 1.2, value=1.2)
    mark.first_byte(0.1, 1.0, SLO)
    mark.first_byte(3.0, 1.0, SLO)  # EWMA 0.1 x 0.9 + 0.3 = 0.39: not slow yet
    assert mark.value == 1.2
    for _ in range(4):  # 0.65, 0.89, 1.10, 1.29: slow from the 3rd of these on
        mark.first_byte(3.0, 1.0, SLO)
    assert mark.first_byte_s > 0.5 * SLO
    assert math.isclose(mark.value, 1.2 - 2 * SHRINK)
    for _ in range(100):
        mark.first_byte(3.0, 1.0, SLO)
    assert mark.value == 0.97 and mark.at_floor
    # nonsense times teach nothing; no SLO: nothing to learn against
    mark.first_byte(-1.0, 1.0, SLO)
    mark.first_byte(math.nan, 1.0, SLO)
    assert mark.first_byte_s < 3.0 + 1e-9
    other = KvMark(0.97, 1.2)
    other.held(1.0)
    for _ in range(10):
        other.first_byte(0.01, 1.0, 0.0)
    assert other.value == 0.97
