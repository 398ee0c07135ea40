"""The synthetic Azure-2019 generator matches the published characteristics, read back through the real reader."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from ember.errors import InvalidInput
from ember.sim.synthetic import SyntheticConfig, generate_day, synthetic_trace, write_azure2019
from ember.sim.traces import load_azure2019_day, read_trace


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("azure2019")
    write_azure2019(generate_day(SyntheticConfig(apps=1000, seed=7)), directory)
    return directory


def test_calibration(written: Path) -> None:
    day = load_azure2019_day(written)
    per_app: dict[str, int] = {}
    for app, counts in zip(day.apps, day.counts, strict=True):
        per_app[app] = per_app.get(app, 0) + int(counts.sum())
    daily = np.array(sorted(per_app.values(), reverse=True), dtype=np.float64)
    assert len(daily) == 1000
    assert abs((daily <= 24).mean() - 0.45) < 0.05          # at most once an hour
    assert abs((daily <= 1440).mean() - 0.81) < 0.05        # at most once a minute
    top = daily[: round(0.186 * len(daily))].sum() / daily.sum()
    assert top > 0.99                                        # published: 99.6%
    assert np.log10(daily.max() / daily.min()) > 5.5         # ~8 orders over the full (50k-app) trace, ~7 in 1000
    assert abs((day.avg_duration_ms < 1000).mean() - 0.5) < 0.06
    with (written / "app_memory_percentiles.anon.d01.csv").open() as f:
        most = np.array([float(r["AverageAllocatedMb_pct100"]) for r in csv.DictReader(f)])
    assert abs((most <= 400).mean() - 0.9) < 0.04


def test_round_trip_through_the_reader(written: Path) -> None:
    day = generate_day(SyntheticConfig(apps=1000, seed=7))
    back = load_azure2019_day(written)
    np.testing.assert_array_equal(back.counts, day.counts)
    np.testing.assert_allclose(back.avg_duration_ms, day.avg_duration_ms, rtol=1e-3)
    from_files = read_trace(written, "azure2019", seed=7)
    direct = synthetic_trace(SyntheticConfig(apps=1000, seed=7))
    assert from_files.invocations == direct.invocations == int(day.counts.sum())
    assert len(from_files.apps) == 1000


def test_deterministic_for_a_seed() -> None:
    a, b = generate_day(SyntheticConfig(50, 3)), generate_day(SyntheticConfig(50, 3))
    np.testing.assert_array_equal(a.counts, b.counts)
    assert not np.array_equal(a.counts.sum(), generate_day(SyntheticConfig(50, 4)).counts.sum())


def test_bad_size() -> None:
    with pytest.raises(InvalidInput, match="apps"):
        SyntheticConfig(apps=0)
