"""The synthetic Azure-2019 generator matches the published characteristics, read back through the real reader."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from ember.errors import InvalidInput
from ember.sim.synthetic import SyntheticConfig, generate_day, synthetic_trace, write_azure2019
from ember.sim.traces import Trace, load_azure2019_day, poisson_minutes, read_trace, trace_from_2019


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


def _per_minute(trace: Trace) -> dict[str, np.ndarray]:
    out = {}
    for a in trace.apps:
        minute = np.floor(np.repeat(a.starts + 0.0, a.counts) / 60.0).astype(np.int64)
        out[a.name] = np.bincount(minute, minlength=1440)
    return out


def test_poisson_placement_keeps_each_minutes_count_and_is_seeded() -> None:
    config = SyntheticConfig(apps=30, seed=5)
    even = synthetic_trace(config)
    poisson = synthetic_trace(config, "poisson")
    assert poisson.invocations == even.invocations
    ref = _per_minute(even)
    for a in poisson.apps:
        assert (a.counts == 1).all() and (np.diff(a.starts) >= 0).all()
        np.testing.assert_array_equal(np.bincount(np.floor(a.starts / 60).astype(np.int64), minlength=1440),
                                      ref[a.name])
    again = synthetic_trace(config, "poisson")
    for a, b in zip(poisson.apps, again.apps, strict=True):
        np.testing.assert_array_equal(a.starts, b.starts)
        np.testing.assert_array_equal(a.durations, b.durations)
    other = trace_from_2019(generate_day(config), seed=6, placement="poisson")
    assert not np.array_equal(poisson.apps[0].starts, other.apps[0].starts)


def test_poisson_placement_looks_uniform_within_the_minute() -> None:
    at = poisson_minutes(np.random.default_rng(0), np.array([0, 7]), np.array([20_000, 1]))
    assert len(at) == 20_001 and at[-1] >= 7 * 60 and at[-1] < 8 * 60
    inside = at[:-1]
    assert inside.min() >= 0 and inside.max() < 60
    hist = np.histogram(inside, bins=6, range=(0, 60))[0]
    assert np.abs(hist / len(inside) - 1 / 6).max() < 0.01        # 6 bins of 10 s, ~3,333 each
    gaps = np.diff(inside)                                         # spacings of uniforms: ~exponential
    assert abs(np.std(gaps) / np.mean(gaps) - 1.0) < 0.05          # evenly spaced would give 0


def test_unknown_placement_is_named() -> None:
    with pytest.raises(InvalidInput, match="--placement: unknown placement 'jitter'"):
        trace_from_2019(generate_day(SyntheticConfig(apps=2, seed=0)), placement="jitter")
