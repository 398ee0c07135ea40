"""The simulator's pooled prior is causal: a refresh point's prior pools only periods that ended before it."""

from __future__ import annotations

import numpy as np
import pytest

from ember.core.rung_costs import RungCosts
from ember.keepalive.policies import LadderPolicy
from ember.keepalive.pooled_prior import epochs
from ember.sim.engine import AppItems, app_items, simulate
from ember.sim.pooled import POOL_EPOCH_S, _build, trace_priors
from ember.sim.traces import AppTrace, Trace


def _app(name: str, starts: list[float]) -> AppTrace:
    n = len(starts)
    return AppTrace(name, np.array(starts), np.ones(n, dtype=np.int64), np.zeros(n), np.zeros(n))


def _priors(apps: list[AppTrace], horizon: float = 3600.0) -> tuple[object, dict[int, np.ndarray], list[object]]:
    items = [app_items(a, horizon) for a in apps]
    base, index = trace_priors(LadderPolicy(pooled_weight=1.0), items, list(range(len(apps))), horizon)
    return base, index, items


def test_each_refresh_point_uses_the_prior_of_the_periods_ended_before_its_epoch() -> None:
    busy = _app("busy", [0.0, 1.0, 2.0, 3.0])                  # three 1 s periods, ended by 3 s
    rare = _app("rare", [100.0, 1300.0, 3000.0])               # 1200 s (ends at 1300), 1700 s (ends at 3000)
    base, index, items = _priors([busy, rare])
    # Epochs at 0, 600, 1200, 1800, 2400, 3000 s: from 600 s both apps are pooled, the rare one by its period still
    # running (600 - 100 = 500 s so far: at least that long).
    assert base.apps.tolist()[:6] == [0, 2, 2, 2, 2, 2]
    for i, it in enumerate(items):
        assert (index[i] * POOL_EPOCH_S <= it.seg_t).all()      # never an epoch after the plan is made
    # The rare app's plan at 1300 s (its second arrival) uses the 1200 s epoch, from before the period ended; its
    # trailing period's plan, made at the end of its last execution (3000 s), the 3000 s epoch's.
    assert index[1].tolist() == [0, 2, 5, 5]
    policy = LadderPolicy()
    starts = policy.cell_starts()
    cell = {t: int(np.searchsorted(starts, t, side="right") - 1) for t in (1.0, 1100.0, 1200.0)}
    # At 1200 s: the busy app's three 1 s periods, its last one running for 1197 s; the rare app's running 1100 s.
    # Each app's mass beyond what it has seen follows the log-uniform prior; none of it before 1100 s.
    assert base.mass[2, cell[1.0]] == pytest.approx(0.5 * 3 / 4)
    assert base.mass[2, cell[1.0] + 1: cell[1100.0]].sum() == pytest.approx(0.0)
    assert base.mass[2].sum() == pytest.approx(1.0)
    # At 1800 s the rare app's 1200 s period has ended, and its next one has run 500 s: by Kaplan-Meier all its mass
    # is in the 1200 s cell (the running period leaves the risk set before it), half the pool.
    assert base.mass[3, cell[1200.0]] >= 0.5 > base.mass[2, cell[1200.0]]


def test_the_future_changes_no_earlier_prior() -> None:
    early = [_app("a", [0.0, 5.0, 700.0]), _app("b", [10.0, 20.0, 1000.0])]
    later = [early[0], _app("b", [10.0, 20.0, 1000.0, 2500.0, 2510.0])]   # b goes on after 1800 s
    before, _, _ = _priors(early)
    after, _, _ = _priors(later)
    upto = int(2500.0 // POOL_EPOCH_S) + 1                      # the epochs up to the first new period's end
    np.testing.assert_array_equal(before.mass[:upto], after.mass[:upto])
    assert not np.array_equal(before.mass, after.mass)


def test_a_pooled_ladder_simulates_and_a_weight_of_zero_is_the_plain_ladder() -> None:
    rng = np.random.default_rng(5)
    apps = [_app(f"app{i}", sorted(rng.uniform(0, 7200, n).tolist())) for i, n in enumerate((3, 5, 400, 40))]
    trace = Trace("tiny", "test", 7200.0, apps)
    costs = RungCosts()
    plain = simulate(trace, LadderPolicy(zygote_share=2.0), costs, runtimes=2)
    zero = simulate(trace, LadderPolicy(zygote_share=2.0, pooled_weight=0.0), costs, runtimes=2)
    pooled = simulate(trace, LadderPolicy(zygote_share=2.0, pooled_weight=1.0), costs, runtimes=2)
    np.testing.assert_array_equal(plain.starts, zero.starts)
    assert pooled.invocations == plain.invocations == sum(a.invocations for a in apps)
    assert pooled.starts.sum() == plain.starts.sum()


def _running_reference(it: AppItems, at: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """One application's running period's cell at each epoch, as first computed, application by application."""
    single = (it.gaps >= 0) & (it.weights == 1)
    begin = np.append(it.at[single], it.trailing_at)
    end = np.append(it.at[single] + it.gaps[single], np.inf)     # the trailing period runs to the end
    order = np.argsort(begin, kind="stable")
    begin, end = begin[order], end[order]
    last = np.searchsorted(begin, at, side="left") - 1
    ok = last >= 0
    on = np.zeros(len(at), dtype=bool)
    on[ok] = end[last[ok]] > at[ok]
    out = np.full(len(at), -1, dtype=np.int64)
    out[on] = np.searchsorted(starts, at[on] - begin[last[on]], side="right") - 1
    return out


def _build_reference(policy: LadderPolicy, items: list[AppItems], active: list[int],
                     horizon: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """The priors as first assembled, application by application."""
    starts = policy.cell_starts()
    n_epochs = int(np.ceil(horizon / POOL_EPOCH_S)) + 1
    at = np.arange(n_epochs) * POOL_EPOCH_S
    running = np.stack([_running_reference(items[i], at, starts) for i in active], axis=1)
    ends, apps, gaps, weights = [], [], [], []
    for a, i in enumerate(active):
        it = items[i]
        idle = it.gaps >= 0
        w = it.weights[idle]
        ends.append(it.at[idle] + it.gaps[idle] + np.maximum(w - 1, 0) * it.every[idle])
        apps.append(np.full(int(idle.sum()), a, dtype=np.int64))
        gaps.append(it.gaps[idle])
        weights.append(w.astype(np.float64))
    g = np.concatenate(gaps)
    cells = np.searchsorted(starts, g, side="right") - 1
    mass, head, pooled = epochs(np.concatenate(ends), np.concatenate(apps), cells, g, np.concatenate(weights),
                                (len(active), len(starts), policy.spec.head_splits + 1), POOL_EPOCH_S, n_epochs,
                                (running, policy.prior_masses()))
    index = [np.minimum(np.floor(items[i].seg_t / POOL_EPOCH_S), n_epochs - 1).astype(np.int64) for i in active]
    return mass, head, pooled, index


def test_the_priors_are_those_assembled_app_by_app() -> None:
    rng = np.random.default_rng(11)
    horizon = 4 * 3600.0
    apps = [_app("once", [900.0]), _app("poisson", sorted(rng.uniform(0, horizon, 300).tolist())),
            _app("idle", [50.0]), _app("rare", [10.0, 5000.0, 9000.0])]
    # Groups of evenly spaced arrivals (repeated items), some while the previous execution still runs (busy).
    t = np.sort(rng.choice(int(horizon // 60) - 1, 40, replace=False)) * 60.0
    k = rng.integers(1, 30, 40)
    apps.append(AppTrace("grouped", t, k, 60.0 / k, rng.uniform(0.0, 4.0, 40)))
    items = [app_items(a, horizon) for a in apps]
    active = [0, 1, 3, 4]                                       # one application not simulated
    policy = LadderPolicy(pooled_weight=1.0)
    base, index = trace_priors(policy, items, active, horizon)
    mass, head, pooled, want_index = _build_reference(policy, items, active, horizon)
    np.testing.assert_array_equal(base.mass, mass)
    np.testing.assert_array_equal(base.head_sums, head)
    np.testing.assert_array_equal(base.apps, pooled)
    assert list(index) == active
    for i, want in zip(active, want_index, strict=True):
        np.testing.assert_array_equal(index[i], want)


@pytest.mark.parametrize("part_items", [1, 7, 250, 1 << 16])
def test_the_priors_built_a_few_applications_at_a_time_are_those_assembled_app_by_app(part_items: int) -> None:
    rng = np.random.default_rng(part_items)
    horizon = 6 * 3600.0
    apps = [_app(f"p{i}", sorted(rng.uniform(0, horizon, int(rng.integers(1, 200))).tolist())) for i in range(12)]
    apps += [_app("same", [100.0, 100.0, 700.0, 700.0, 1200.0])]                # ties, periods of 0 s, ends on bounds
    t = np.sort(rng.choice(int(horizon // 60) - 1, 60, replace=False)) * 60.0
    k = rng.integers(1, 40, 60)
    apps.append(AppTrace("grouped", t, k, 60.0 / k, rng.uniform(0.0, 5.0, 60)))
    items = [app_items(a, horizon) for a in apps]
    active = [i for i in range(len(apps)) if i != 3]
    policy = LadderPolicy(pooled_weight=1.0)
    base, index = _build(policy.cell_starts(), policy.spec.head_splits + 1, items, active, horizon,
                         policy.prior_masses(), part_items)
    mass, head, pooled, want_index = _build_reference(policy, items, active, horizon)
    np.testing.assert_array_equal(base.mass, mass)
    np.testing.assert_array_equal(base.head_sums, head)
    np.testing.assert_array_equal(base.apps, pooled)
    for got, want in zip(index, want_index, strict=True):
        np.testing.assert_array_equal(got, want)
