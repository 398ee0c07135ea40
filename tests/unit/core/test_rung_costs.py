"""Rung costs: the reference defaults, and figures read from bench/cold_start.py's JSON."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ember.core.rung_costs import MAX_FIGURE, RungCost, RungCosts
from ember.errors import InvalidInput


def test_rung_costs_defaults_and_benchmark_json() -> None:
    c = RungCosts()
    assert c.hot == RungCost(250.0, 0.0003) and c.cold.start_s == 12.5 and c.zygote.idle_mb == 150.0
    measured = RungCosts.from_benchmark({"rungs": {"template": {"start_ms": 70, "rss_mb": 120},
                                                   "fetch": {"start_s": 9.0}}})
    assert measured.template == RungCost(120.0, 0.07)
    assert measured.cold.start_s == 9.0 and measured.hot == c.hot
    with pytest.raises(InvalidInput, match="warm"):
        RungCosts.from_benchmark({"warm": {"start_s": 1}})
    with pytest.raises(InvalidInput, match="replica_uss_vs_template"):
        RungCosts.from_benchmark({"memory": {"template_pss_mb": 50, "replica_uss_vs_template": [-1]}})
    with pytest.raises(InvalidInput, match="hot.start_ms"):
        RungCosts.from_benchmark({"hot": {"start_ms": "fast"}})


def test_rung_costs_from_the_cold_start_benchmark_shape() -> None:
    """bench/cold_start.py reports times to first response (seconds) and template/replica memory."""
    data = {
        "in_process": {"p50": 0.010},
        "rungs": {"hot": {"p50": 0.015}, "paused": {"p50": 0.035}, "template": {"p50": 0.105},
                  "zygote": {"p50": 0.160}},
        "naive": {"p50": 7.75},
        "memory": {"template_pss_mb": 54.0, "replica_uss_vs_template": [0.16, 0.14]},
    }
    c = RungCosts.from_benchmark(data)
    assert [x.start_s for x in c.by_level()] == pytest.approx([0.005, 0.025, 0.095, 0.150, 7.74])
    assert c.template.idle_mb == 54.0
    assert c.hot.idle_mb == pytest.approx(54.0 * 1.15) and c.paused.idle_mb == c.hot.idle_mb
    assert c.zygote.idle_mb == 150.0 and c.template_replica_fraction == pytest.approx(0.15)


def test_a_memory_tier_copy_is_charged_on_every_rung_but_nothing_kept() -> None:
    costs = RungCosts.from_benchmark({"memory_copy_mb": 90, "rungs": {"zygote": {"idle_mb": 150}}})
    assert costs.memory_copy_mb == 90.0
    assert costs.own_mb().tolist() == [340.0, 340.0, 340.0, 90.0, 0.0]   # the shared zygote charged apart
    assert RungCosts().own_mb()[3] == 0.0
    with pytest.raises(InvalidInput, match=r"memory_copy_mb must be a number from 0 to 1e\+09, got -1"):
        RungCosts.from_benchmark({"memory_copy_mb": -1})
    with pytest.raises(InvalidInput, match="memory_copy_mb must be >= 0"):
        RungCosts(memory_copy_mb=-1.0)


# JSON-like documents with the keys bench/cold_start.py's output and hand-written costs use, any value anywhere.
_scalar = st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats() | st.text(max_size=5)
_keys = st.sampled_from(["rungs", "hot", "paused", "template", "zygote", "cold", "fetch", "in_process", "naive",
                         "memory", "p50", "start_s", "start_ms", "idle_mb", "rss_mb", "memory_mb", "template_pss_mb",
                         "replica_uss_vs_template", "memory_copy_mb", "other"])
_json = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=4),
                     max_leaves=15)


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.dictionaries(_keys, _json, max_size=5))
@example(data={"in_process": None})                  # an AttributeError before
@example(data={"hot": {"idle_mb": 2**64}})          # a TypeError (from numpy) before
@example(data={"cold": {"start_s": 1e308}})         # accepted before: the sums over a trace overflowed
def test_any_costs_document_is_read_or_refused_naming_what_is_wrong(data: dict[str, Any]) -> None:
    """`--rung-costs` (and `rung_costs` in the serve settings) read any JSON: the costs come back finite, >= 0 and
    at most `MAX_FIGURE`, or InvalidInput names what is wrong."""
    try:
        costs = RungCosts.from_benchmark(data)
    except InvalidInput as err:
        assert str(err).startswith("rung costs"), err
        return
    for cost in (costs.hot, costs.paused, costs.template, costs.zygote, costs.cold):
        assert 0 <= cost.idle_mb <= MAX_FIGURE and 0 <= cost.start_s <= MAX_FIGURE



def test_with_restore_the_bottom_level_holds_nothing_and_starts_in_the_restore_time() -> None:
    from ember.core.rung_costs import RESTORE_START_S, RungCost, RungCosts

    costs = RungCosts().with_restore()
    assert costs.cold == RungCost(0.0, RESTORE_START_S)
    assert costs.zygote == RungCosts().zygote and costs.hot == RungCosts().hot   # the rest as they were
    assert RungCosts().with_restore(0.3).start_s()[-1] == 0.3
