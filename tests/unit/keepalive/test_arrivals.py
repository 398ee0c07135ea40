"""The ladder's arrival forecast, as the warm pool sizes idle instances by it."""

from __future__ import annotations

import numpy as np
import pytest

from ember.keepalive.arrivals import ArrivalForecast, LadderForecast
from ember.keepalive.policies import LadderPolicy


def test_the_arrival_forecast_is_the_ladders_hazards_chained_over_the_cells() -> None:
    ladder = LadderPolicy()
    history = ladder.new_history()
    for idle in (0.2, 0.4, 3.0, 3.0, 20.0, 90.0):
        history.observe(idle)
    table = history.table()
    h = ladder.hazards(table)[0]
    starts = ladder.cell_starts()
    forecast = ArrivalForecast(ladder, table)
    # To the end of the first minute: survive the nine head cells.
    assert forecast.chance(np.array([0]), np.zeros(1), 60.0)[0] == pytest.approx(1 - np.prod(1 - h[:9]))
    # From 30 s (the last head cell) to 120 s: that cell and the bin 60-120 s.
    assert starts[8] == 30.0
    assert forecast.chance(np.array([0]), np.array([30.0]), 90.0)[0] == pytest.approx(1 - np.prod(1 - h[8:10]))
    # Within a cell the hazard rate is constant: half of the 30-60 s cell keeps sqrt of its survival.
    assert forecast.chance(np.array([0]), np.array([30.0]), 15.0)[0] == pytest.approx(1 - np.sqrt(1 - h[8]))


def test_the_live_forecast_is_one_row_of_it_and_the_prior_alone_without_history() -> None:
    ladder = LadderPolicy()
    history = ladder.new_history()
    for idle in (1.0, 2.0, 40.0):
        history.observe(idle)
    live = LadderForecast(ladder)
    row = ArrivalForecast(ladder, history.table()).chance(np.array([0]), np.array([5.0]), 60.0)[0]
    assert live.chance(history, 5.0, 60.0) == pytest.approx(row)
    prior = ArrivalForecast(ladder, ladder.new_history().table()).chance(np.array([0]), np.array([5.0]), 60.0)[0]
    assert live.chance(None, 5.0, 60.0) == pytest.approx(prior) != pytest.approx(row)
