"""The density benchmark's trace mapping and fixed keep-alive baseline, on made-up counts and arrivals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ember.testing.density import (
    fixed_keepalive,
    kind_sequence,
    map_trace,
    minute_arrivals,
    nearest_rank,
    pick_functions,
    processes_mb,
    up_at,
)


def test_kinds_interleave_in_proportion() -> None:
    seq = kind_sequence({"a": 4, "b": 2, "c": 1})
    assert sorted(seq) == ["a"] * 4 + ["b"] * 2 + ["c"]
    assert seq == ["a", "b", "a", "c", "a", "b", "a"]


def test_functions_picked_across_the_ranks_busiest_first() -> None:
    window = np.array([[5], [0], [50], [1], [7]])   # ranks: row 2, 4, 0, 3, 1
    assert pick_functions(window, 3).tolist() == [2, 0, 1]
    assert pick_functions(window, 5).tolist() == [2, 4, 0, 3, 1]
    with pytest.raises(ValueError, match="models: from 1 to 5"):
        pick_functions(window, 6)


def test_minutes_capped_placed_within_their_minute_and_sped_up() -> None:
    t = minute_arrivals(np.array([0, 3, 100, 0]), cap=10, speedup=4.0, rng=np.random.default_rng(0))
    assert len(t) == 13
    assert (np.diff(t) >= 0).all()
    minute = np.floor(t * 4.0 / 60.0)
    assert (minute == 1).sum() == 3 and (minute == 2).sum() == 10
    with pytest.raises(ValueError, match="cap"):
        minute_arrivals(np.array([1]), cap=0, speedup=1.0, rng=np.random.default_rng(0))


def test_map_trace_names_kinds_and_window() -> None:
    counts = np.zeros((6, 10), dtype=np.int64)
    counts[0, 2:4] = 100      # busiest in the window
    counts[1, 3] = 2
    counts[2, 0] = 9          # outside the window [2, 6)
    loads = map_trace(counts, [f"f{i}" for i in range(6)], 2, 4, {"x": 2, "y": 1}, cap=5, speedup=2.0)
    assert [m.name for m in loads] == ["x-01", "y-01", "x-02"]
    assert [m.function for m in loads] == ["f0", "f2", "f5"]
    assert loads[0].window_invocations == 200 and len(loads[0].arrivals) == 10
    assert all(m.arrivals.max(initial=0) < 4 * 60 / 2.0 for m in loads)
    with pytest.raises(ValueError, match="window"):
        map_trace(counts, ["f"] * 6, 8, 4, {"x": 1}, cap=5, speedup=1.0)


def test_fixed_keepalive_cold_then_hot_then_cold_after_the_keep() -> None:
    # cold at 0 (ready at 10), 5 waits for the load, 20 hot, 20 + 0.1 + 300 + 1 expired: cold again
    out = fixed_keepalive(np.array([0.0, 5.0, 20.0, 321.2]), keep_s=300, cold_s=10, hot_s=0.1, end_s=1000)
    assert out.cold.tolist() == [True, False, False, True]
    assert out.latency_s == pytest.approx([10.0, 5.1, 0.1, 10.0])
    assert out.loaded == [(0.0, pytest.approx(320.1)), (321.2, pytest.approx(631.2))]
    assert up_at(out.loaded, np.array([-1.0, 0.0, 320.5, 500.0, 700.0])).tolist() == [False, True, False, True,
                                                                                          False]


def test_fixed_keepalive_interval_cut_at_the_end_and_no_arrivals() -> None:
    assert fixed_keepalive(np.array([1.0]), 300, 2, 0.1, end_s=50).loaded == [(1.0, 50.0)]
    none = fixed_keepalive(np.array([]), 300, 2, 0.1, end_s=50)
    assert none.loaded == [] and len(none.latency_s) == 0


def test_processes_share_their_shared_pages_once() -> None:
    assert processes_mb(np.array([0, 1, 3]), uss_mb=100, shared_mb=40).tolist() == [0, 140, 340]


def test_nearest_rank_keeps_infinities() -> None:
    assert nearest_rank([3, 1, 2], 50) == 2
    assert nearest_rank(list(range(1, 101)), 99) == 99
    assert nearest_rank([1.0, math.inf], 99) == math.inf
    assert math.isnan(nearest_rank([], 50))
