"""RainbowCake's layered timers by hand, and the ARIMA order (d by KPSS, then p by AIC)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ember.core.rung_costs import RungCost, RungCosts
from ember.core.states import Rung
from ember.errors import InvalidInput
from ember.keepalive.forecast import arima_forecast, arima_order, differencing_order, kpss_statistic
from ember.sim.keepalive_layered import RainbowCake

H, T, Z, F = Rung.HOT, Rung.TEMPLATE, Rung.ZYGOTE, Rung.FETCH
# Round numbers: keeping hot saves 1 s over the template at 100 MB; the template saves 2 s over the zygote at
# 50 MB; the zygote saves 7 s over nothing at 20 MB.
COSTS = RungCosts(hot=RungCost(100.0, 0.0), paused=RungCost(100.0, 0.0), template=RungCost(50.0, 1.0),
                  zygote=RungCost(20.0, 3.0), cold=RungCost(0.0, 10.0))


def test_timers_are_the_break_even_of_each_layer() -> None:
    # latency_value 100 MB*s per s: hot 100 * 1 / 100 = 1 s, template 100 * 2 / 50 = 4 s, zygote 100 * 7 / 20 = 35 s.
    policy = RainbowCake(latency_value=100.0, costs=COSTS)
    np.testing.assert_allclose(policy.timers(), [1.0, 4.0, 35.0])
    assert policy.plan(policy.new_history()).steps == ((0.0, H), (1.0, T), (5.0, Z), (40.0, F))
    # Shared by 5 models the zygote costs 4 MB: 100 * 7 / 4 = 175 s.
    shared = RainbowCake(latency_value=100.0, costs=COSTS, zygote_share=5)
    assert shared.plan(shared.new_history()).steps[-1] == (5.0 + 175.0, F)
    # And a 10 MB copy of the model's weights in the memory tier, its own on the zygote rung: 100 * 7 / 14 = 50 s.
    copy = RainbowCake(latency_value=100.0, costs=replace(COSTS, memory_copy_mb=10.0), zygote_share=5)
    assert copy.plan(copy.new_history()).steps[-1] == (5.0 + 50.0, F)


def test_own_layers_end_after_nearly_every_observed_idle_time() -> None:
    # Ten idle periods of 2 s: the 99th percentile lies in the head cell [1.875, 3.75) s, so the model's own layers
    # end at 3.75 * 1.1 = 4.125 s instead of 5 s; the shared zygote keeps its timer (to 40 s).
    policy = RainbowCake(latency_value=100.0, costs=COSTS)
    history = policy.new_history()
    for _ in range(9):
        history.observe(2.0)
    assert policy.plan(history).steps == ((0.0, H), (1.0, T), (5.0, Z), (40.0, F))   # 9 < min_samples
    history.observe(2.0)
    steps = policy.plan(history).steps
    assert [r for _, r in steps] == [H, T, Z, F]
    assert [s for s, _ in steps] == pytest.approx([0.0, 1.0, 4.125, 40.0])


def test_simulated_by_hand() -> None:
    # Arrivals at 0, 3, 20 and 100 s (instant), horizon 150 s, plan hot [0, 1), template [1, 5), zygote [5, 40),
    # nothing after. 0: fetch. 3: template (1 s hot, 2 s template). 20: zygote (1 + 4 + 12). 100: fetch
    # (1 + 4 + 35, then 40 s of nothing). Trailing 50 s: 1 + 4 + 35 (+ 10 of nothing).
    from ember.sim.engine import simulate
    from ember.sim.traces import AppTrace, Trace

    t = np.array([0.0, 3.0, 20.0, 100.0])
    app = AppTrace("a", t, np.ones(4, dtype=np.int64), np.zeros(4), np.zeros(4))
    r = simulate(Trace("t", "test", 150.0, [app]), RainbowCake(latency_value=100.0, costs=COSTS), COSTS)
    np.testing.assert_allclose(r.starts, [0, 0, 1, 1, 2])
    np.testing.assert_allclose(r.idle_s, [4.0, 0.0, 14.0, 82.0, 50.0])
    # The zygote is held whenever the model is not on nothing: 150 - 40 - 10 = 100 s.
    assert r.total_idle_mb_s == pytest.approx(4 * 100 + 14 * 50 + 100 * 20)


def test_bad_knobs_name_the_field() -> None:
    with pytest.raises(InvalidInput, match="quantile"):
        RainbowCake(quantile=2.0)
    assert RainbowCake().with_knob(10.0).latency_value == 10.0


def test_arima_chooses_d_by_kpss_not_by_aic_across_differencing() -> None:
    # White noise around 600 s: stationary. The old rule compared AIC across d (the differenced series is one
    # point shorter and has another likelihood) and chose ARIMA(2, 1, 0) here, forecasting 617.9 s; the KPSS
    # test keeps d = 0, AIC then picks p = 0, and the forecast is the mean.
    x = 600 + 30 * np.random.default_rng(0).standard_normal(20)
    assert kpss_statistic(x) < 0.463
    assert arima_order(x) == (0, 0)
    assert arima_forecast(x) == pytest.approx(float(x.mean()))
    # A random walk is differenced once.
    walk = 600 + np.cumsum(30 * np.random.default_rng(0).standard_normal(40))
    assert differencing_order(walk) == 1
    assert arima_order(walk)[1] == 1
    assert differencing_order(np.full(10, 5.0)) == 0            # a constant is stationary
