"""The ladder's pooled (empirical-Bayes) prior: pooling by hand, the hazards it gives by hand, and no future."""

from __future__ import annotations

import numpy as np
import pytest

from ember.errors import InvalidInput
from ember.keepalive.policies import LadderPolicy
from ember.keepalive.pooled_prior import (
    PooledPrior,
    SortedGrid,
    epochs,
    epochs_of,
    from_counts,
    kaplan_meier,
    pool,
    pool_censored,
)


def test_each_application_counts_once_however_busy() -> None:
    # A: 2 + 2 periods (half in cell 0, half in cell 2), B: 1 period in cell 1, C: none (not pooled).
    counts = np.array([[2.0, 0.0, 2.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    sums = np.array([[0.2], [0.0], [0.0]])            # A's two cell-0 periods sum to 0.2 s
    mass, head, n = pool(counts, sums)
    np.testing.assert_allclose(mass, [0.25, 0.5, 0.25])
    np.testing.assert_allclose(head, [0.025])         # (0.2 / 4 + 0) / 2
    assert n == 2
    assert pool(np.zeros((2, 3)), np.zeros((2, 1)))[2] == 0


def test_an_epoch_pools_only_the_periods_that_ended_before_it() -> None:
    # App 0: a period in cell 0 ending at 5 s; app 1: one in cell 1 ending at 700 s, and 3 in cell 2 ending at 650.
    ends, apps = np.array([5.0, 700.0, 650.0]), np.array([0, 1, 1])
    cells, gaps, weights = np.array([0, 1, 2]), np.array([0.1, 0.3, 90.0]), np.array([1.0, 1.0, 3.0])
    mass, head, n = epochs(ends, apps, cells, gaps, weights, (2, 3, 2), 600.0, 3)
    np.testing.assert_array_equal(n, [0, 1, 2])
    np.testing.assert_allclose(mass[0], [0, 0, 0])                  # at 0 s: nothing has ended
    np.testing.assert_allclose(mass[1], [1, 0, 0])                  # at 600 s: app 0 alone
    np.testing.assert_allclose(mass[2], [0.5, 0.125, 0.375])        # at 1200 s: app 1 is 1/4, 3/4
    np.testing.assert_allclose(head[2], [0.05, 0.3 / 4 / 2])


def test_kaplan_meier_by_hand_with_a_running_period() -> None:
    counts = np.array([[1.0, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 2]])
    running = np.array([1, 2, 0, -1])
    tail = np.array([0.4, 0.3, 0.2, 0.1])
    pmf = kaplan_meier(counts, running, tail)
    # 1: at risk 3, 2, 1 in cells 0-2: hazards 1/3, 0, 1: mass 1/3, 0, 2/3 (the running one moves the rest on).
    # 2: at risk 2, 1, 1: hazard 1/2 in cell 0, then none: half left beyond cell 2, all into cell 3.
    # 3: only running, in cell 0: all of it beyond, as the tail is over cells 1-3 (0.3, 0.2, 0.1 over 0.6).
    # 4: two periods beyond the range.
    np.testing.assert_allclose(pmf, [[1 / 3, 0, 2 / 3, 0], [0.5, 0, 0, 0.5], [0, 0.5, 1 / 3, 1 / 6], [0, 0, 0, 1]])
    mass, _, n = pool_censored(counts, np.zeros((4, 1)), running, tail)
    np.testing.assert_allclose(mass, pmf.mean(axis=0))
    assert n == 4
    assert pool_censored(np.zeros((1, 4)), np.zeros((1, 1)), np.array([-1]), tail)[2] == 0   # not started


# One app that has seen one period of 0.3 s (head cell 1); the pooled prior: half its mass in head cell 0 (mean
# 0.1 s there), half beyond the range. prior_weight 1, no smoothing, pooled_weight 1: one pseudo-period of it.
def _one_period() -> tuple[LadderPolicy, object, PooledPrior]:
    policy = LadderPolicy(prior_weight=1.0, smooth_weight=0.0, pooled_weight=1.0)
    h = policy.new_history()
    h.observe(0.3)
    cells = len(policy.cell_starts())
    mass = np.zeros((1, cells))
    mass[0, 0], mass[0, -1] = 0.5, 0.5
    head = np.zeros((1, policy.spec.head_splits + 1))
    head[0, 0] = 0.05                                   # E[idle; idle in cell 0] = 0.5 x 0.1 s
    return policy, h.table(), PooledPrior(mass, head, np.array([5]), np.zeros(1, dtype=np.int64))


def test_ladder_hazards_and_held_times_with_a_pooled_prior_by_hand() -> None:
    policy, table, prior = _one_period()
    # pmf per cell (1 period + 1 pseudo-period): cell 0 0.5 / 2, cell 1 1 / 2, beyond 0.5 / 2; survival 1, 0.75,
    # 0.25: hazards 0.25, 2/3, then 0 until the tail.
    h = policy.hazards(table, prior=prior)[0]            # type: ignore[arg-type]
    np.testing.assert_allclose(h[:4], [0.25, 2 / 3, 0.0, 0.0], atol=1e-12)
    # Held in [0, 0.234): the real period holds it all (0.234), the pseudo one 0.05 + 0.234 x 0.5; over 2 at risk.
    # Held in [0.234, 0.469): 0.3 - 0.234 of the real one, 0.234 x 0.5 of the pseudo one; over 1 + 0.5 at risk.
    held = policy.held_head(table, prior=prior)[0]       # type: ignore[arg-type]
    a, b = 0.234375, 0.46875
    np.testing.assert_allclose(held[:2], [(a + 0.05 + a * 0.5) / 2, (0.3 - a + (b - a) * 0.5) / 1.5], rtol=1e-12)


def test_pooled_weight_mixes_the_two_priors_and_no_pool_changes_nothing() -> None:
    _, table, prior = _one_period()
    plain = LadderPolicy(prior_weight=1.0, smooth_weight=0.0)
    half = LadderPolicy(prior_weight=1.0, smooth_weight=0.0, pooled_weight=0.5)
    starts = plain.cell_starts()
    logu = np.diff(np.clip(np.log(np.maximum(starts, 0.1) / 0.1) / np.log(86400 / 0.1), 0, 1))
    # Cell 0's hazard: (0 + 1 x mass0) / (1 + 1), the mass half log-uniform, half pooled (0.5).
    want = (0.5 * logu[0] + 0.5 * 0.5) / 2
    assert half.hazards(table, prior=prior)[0, 0] == pytest.approx(want, rel=1e-12)   # type: ignore[arg-type]
    np.testing.assert_array_equal(plain.hazards(table, prior=prior), plain.hazards(table))  # type: ignore[arg-type]
    empty = PooledPrior(prior.mass, prior.head_sums, np.array([0]), prior.index)      # pools no application yet
    np.testing.assert_array_equal(half.hazards(table, prior=empty), plain.hazards(table))  # type: ignore[arg-type]
    assert half.plans(table, prior=empty).row(0) == plain.plan(table_history(plain))    # type: ignore[arg-type]


def table_history(policy: LadderPolicy) -> object:
    h = policy.new_history()
    h.observe(0.3)
    return h


def test_the_live_node_pools_its_models_histories_into_one_prior() -> None:
    prior = from_counts(np.array([[4.0, 0.0], [0.0, 2.0]]), np.array([[0.4], [0.0]]))
    np.testing.assert_allclose(prior.mass, [[0.5, 0.5]])
    np.testing.assert_allclose(prior.head_sums, [[0.05]])
    assert prior.apps.tolist() == [2] and prior.index.tolist() == [0]


def test_a_pooled_prior_must_fit_the_ladders_grid_and_its_rows() -> None:
    policy, table, prior = _one_period()
    short = PooledPrior(prior.mass[:, :5], prior.head_sums, prior.apps, prior.index)
    with pytest.raises(InvalidInput, match="cells"):
        policy.hazards(table, prior=short)                # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="row indices"):
        prior.rows_for(np.array([1]))
    with pytest.raises(InvalidInput, match="pooled_weight"):
        LadderPolicy(pooled_weight=1.5)


def test_the_ladder_pools_live_histories_per_cell_each_model_once() -> None:
    policy = LadderPolicy(pooled_weight=0.5)
    a, b = policy.new_history(), policy.new_history()
    for t in (0.1, 0.1, 0.1, 90.0):                      # head cell 0 (3 of 4), the minute bin [60, 120) (1 of 4)
        a.observe(t)
    b.observe(20000.0)                                  # beyond the 4-hour range
    prior = policy.pool([a.table(), b.table()])
    assert prior is not None
    starts = policy.cell_starts()
    want = np.zeros(len(starts))
    want[0], want[int(np.searchsorted(starts, 90.0, side="right") - 1)], want[-1] = 0.375, 0.125, 0.5
    np.testing.assert_allclose(prior.mass[0], want)
    assert prior.head_sums[0, 0] == pytest.approx(0.3 / 4 / 2)
    assert LadderPolicy().pool([a.table()]) is None     # pooled_weight 0: no prior to build


def test_the_live_pool_censors_each_models_idle_time_so_far() -> None:
    policy = LadderPolicy(pooled_weight=1.0)
    h = policy.new_history()
    h.observe(0.1)
    plain = policy.pool([h.table()])
    running = policy.pool([h.table()], [90.0])       # idle for 90 s now: half the mass is beyond 90 s
    assert plain is not None and running is not None
    assert plain.mass[0, 0] == pytest.approx(1.0) and running.mass[0, 0] == pytest.approx(0.5)
    starts = policy.cell_starts()
    assert running.mass[0, : int(np.searchsorted(starts, 90.0, side="right"))].sum() == pytest.approx(0.5)


# The fast `epochs` held to the straightforward computation it replaced: every epoch pooled from scratch, from the
# items sorted by end, with `kaplan_meier` as first written. The same floats, not merely close ones.
def _kaplan_meier_reference(counts: np.ndarray, censored: np.ndarray, tail: np.ndarray) -> np.ndarray:
    n_apps, n_cells = counts.shape
    cells = np.arange(n_cells)
    at_risk = np.cumsum(counts[:, ::-1], axis=1)[:, ::-1] + (cells[None, :] <= censored[:, None])
    with np.errstate(divide="ignore", invalid="ignore"):
        hazard = np.where(at_risk > 0, counts / at_risk, 0.0)
    alive = np.hstack([np.ones((n_apps, 1)), np.cumprod(1.0 - hazard, axis=1)[:, :-1]])
    pmf = alive * hazard
    rest = np.clip(1.0 - pmf.sum(axis=1), 0.0, 1.0)
    last_event = np.where(counts > 0, cells[None, :], -1).max(axis=1)
    spread = np.where(cells[None, :] > np.maximum(censored, last_event)[:, None], tail[None, :], 0.0)
    norm = spread.sum(axis=1, keepdims=True)
    spread = np.where(norm > 0, spread / np.where(norm > 0, norm, 1.0), (cells == n_cells - 1)[None, :])
    return pmf + rest[:, None] * spread


def _pool_censored_reference(counts: np.ndarray, head_sums: np.ndarray, censored: np.ndarray,
                             tail: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    seen = (counts.sum(axis=1) > 0) | (censored >= 0)
    if not seen.any():
        return np.zeros(counts.shape[1]), np.zeros(head_sums.shape[1]), 0
    pmf = _kaplan_meier_reference(counts[seen], censored[seen], tail)
    heads = head_sums.shape[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        mean_in_cell = np.where(counts[seen, :heads] > 0, head_sums[seen] / counts[seen, :heads], 0.0)
    return pmf.mean(axis=0), (mean_in_cell * pmf[:, :heads]).mean(axis=0), int(seen.sum())


def _epochs_reference(ends: np.ndarray, apps: np.ndarray, cells: np.ndarray, gaps: np.ndarray, weights: np.ndarray,
                      shape: tuple[int, int, int], epoch_s: float, n_epochs: int,
                      censored: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n_apps, n_cells, n_heads = shape
    order = np.argsort(ends, kind="stable")
    ends, apps, cells, gaps, weights = ends[order], apps[order], cells[order], gaps[order], weights[order]
    cuts = np.searchsorted(ends, np.arange(n_epochs) * epoch_s, side="left")
    counts, sums = np.zeros((n_apps, n_cells)), np.zeros((n_apps, n_heads))
    mass, head, pooled = np.zeros((n_epochs, n_cells)), np.zeros((n_epochs, n_heads)), np.zeros(n_epochs, dtype=int)
    done = 0
    for e, cut in enumerate(cuts):
        if cut > done:
            a, c, g, w = apps[done:cut], cells[done:cut], gaps[done:cut], weights[done:cut]
            counts += np.bincount(a * n_cells + c, weights=w, minlength=n_apps * n_cells).reshape(n_apps, n_cells)
            h = c < n_heads
            sums += np.bincount(a[h] * n_heads + c[h], weights=g[h] * w[h],
                                minlength=n_apps * n_heads).reshape(n_apps, n_heads)
            done = cut
        if censored is None:
            mass[e], head[e], pooled[e] = pool(counts, sums)
        else:
            mass[e], head[e], pooled[e] = _pool_censored_reference(counts, sums, censored[0][e], censored[1])
    return mass, head, pooled


def _random_items(rng: np.random.Generator, n_apps: int, n_items: int, n_cells: int, n_epochs: int,
                  by_app: bool) -> tuple[np.ndarray, ...]:
    """Items of `n_apps` applications: ends on a coarse grid too (ties, ends on an epoch's bound), weights 0 to 3
    (repeated items; 0: an item standing for none), gaps of seconds to hours; `by_app`: sorted by application,
    then end (as the simulator builds them)."""
    apps = rng.integers(0, max(n_apps, 1), n_items) if n_apps else np.zeros(0, dtype=np.int64)
    ends = np.where(rng.random(len(apps)) < 0.3, rng.integers(0, 12, len(apps)) * 300.0,
                    rng.uniform(0, n_epochs * 600.0, len(apps)))
    cells = rng.integers(0, n_cells, len(apps))
    # Busy applications end in the first cells, the rest anywhere.
    cells = np.where(rng.random(len(apps)) < 0.5, cells % 3, cells)
    gaps = rng.exponential(30.0, len(apps)) * 10.0 ** rng.integers(-2, 3, len(apps))
    weights = rng.integers(0, 4, len(apps)).astype(np.float64)
    if by_app:
        order = np.lexsort((ends, apps))
        apps, ends, cells, gaps, weights = apps[order], ends[order], cells[order], gaps[order], weights[order]
    return ends, apps, cells, gaps, weights


@pytest.mark.parametrize("seed", range(24))
def test_epochs_gives_the_floats_of_pooling_each_epoch_from_scratch(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_apps, n_cells, n_heads, n_epochs = int(rng.integers(0, 9)), int(rng.integers(1, 60)), 3, int(rng.integers(1, 9))
    n_heads = min(n_heads, n_cells)
    items = _random_items(rng, n_apps, int(rng.integers(0, 1500)), n_cells, n_epochs, by_app=seed % 2 == 0)
    # Running periods: none for most apps and epochs, anywhere for the rest (an app with one arrival has only these).
    running = np.where(rng.random((n_epochs, n_apps)) < 0.6, -1, rng.integers(0, n_cells, (n_epochs, n_apps)))
    tail = rng.random(n_cells) * (rng.random(n_cells) < 0.8)          # with zeros, a few cells' worth or none
    if seed % 5 == 0:
        tail[: n_cells // 2] = 0.0
    shape = (n_apps, n_cells, n_heads)
    for censored in (None, (running, tail)):
        want = _epochs_reference(*items, shape, 600.0, n_epochs, censored)
        got = epochs(*items, shape, 600.0, n_epochs, censored)
        for w, g in zip(want, got, strict=True):
            np.testing.assert_array_equal(g, w)


def test_epochs_edge_cases_give_the_floats_of_the_straightforward_computation() -> None:
    tail = np.array([0.5, 0.25, 0.125, 0.125])
    empty = np.zeros(0)
    none = (empty, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), empty, empty)
    cases = [
        (none, 0, np.zeros((3, 0), dtype=np.int64)),                                   # no applications
        (none, 2, np.array([[-1, -1], [0, -1], [2, 1]])),                              # single arrivals: running only
        ((np.array([5.0]), np.array([1]), np.array([2]), np.array([70.0]), np.array([1.0])), 2,
         np.array([[-1, -1], [-1, 0], [3, -1]])),                                      # one period, then running
        ((np.array([5.0, 5.0, 650.0]), np.array([0, 0, 0]), np.array([0, 0, 1]), np.array([0.1, 0.2, 0.3]),
          np.array([40.0, 2.0, 0.0])), 1, np.array([[-1], [1], [-1]])),                # repeated items, a weight 0
    ]
    for items, n_apps, running in cases:
        for censored in (None, (running, tail)):
            want = _epochs_reference(*items, (n_apps, 4, 2), 600.0, 3, censored)
            got = epochs(*items, (n_apps, 4, 2), 600.0, 3, censored)
            for w, g in zip(want, got, strict=True):
                np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("seed", range(8))
def test_kaplan_meier_gives_the_floats_it_gave(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    n_apps, n_cells = int(rng.integers(1, 30)), int(rng.integers(1, 300))
    counts = rng.integers(0, 4, (n_apps, n_cells)) * (rng.random((n_apps, n_cells)) < 0.2)
    running = np.where(rng.random(n_apps) < 0.5, -1, rng.integers(0, n_cells, n_apps))
    tail = rng.random(n_cells) * (rng.random(n_cells) < 0.9)
    np.testing.assert_array_equal(kaplan_meier(counts.astype(float), running, tail),
                                  _kaplan_meier_reference(counts.astype(float), running, tail))


@pytest.mark.parametrize("seed", range(12))
def test_epochs_of_parts_gives_the_floats_of_epochs_however_the_applications_are_split(seed: int) -> None:
    rng = np.random.default_rng(200 + seed)
    n_apps, n_cells, n_epochs = int(rng.integers(1, 12)), int(rng.integers(3, 40)), int(rng.integers(1, 9))
    items = _random_items(rng, n_apps, int(rng.integers(0, 1500)), n_cells, n_epochs, by_app=seed % 2 == 0)
    running = np.where(rng.random((n_epochs, n_apps)) < 0.6, -1, rng.integers(0, n_cells, (n_epochs, n_apps)))
    tail = rng.random(n_cells)
    # Each application's items in one part, the parts in any order of applications.
    part_of = rng.integers(0, 4, n_apps)
    parts = [tuple(x[part_of[items[1]] == p] for x in items) for p in rng.permutation(4)]
    shape = (n_apps, n_cells, 2)
    for censored in (None, (running, tail)):
        want = epochs(*items, shape, 600.0, n_epochs, censored)
        got = epochs_of(parts, shape, 600.0, n_epochs, censored)
        for w, g in zip(want, got, strict=True):
            np.testing.assert_array_equal(g, w)


def test_a_sorted_grid_finds_what_a_binary_search_finds() -> None:
    rng = np.random.default_rng(3)
    ladder = np.concatenate([[0.0], 60.0 / 2.0 ** np.arange(8, 0, -1), np.arange(1, 241) * 60.0])
    grids = [ladder, np.arange(145) * 600.0, np.sort(rng.uniform(-5, 5, 30)), np.array([1.0, 1.0, 2.0, 2.0, 3.0]),
             np.array([2.5]), np.zeros(0), np.array([0.0, 1e-300, 1.0]), np.array([-np.inf, 0.0, np.inf])]
    for edges in grids:
        x = np.concatenate([rng.uniform(-10, 15000, 5000), rng.exponential(30.0, 5000), edges,
                            np.nextafter(edges, -np.inf), np.nextafter(edges, np.inf),
                            [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e300]])
        got = SortedGrid.of(edges).right(x)
        np.testing.assert_array_equal(got, np.searchsorted(edges, x, side="right"))
        square = x[: 100 * 100].reshape(100, 100)
        np.testing.assert_array_equal(SortedGrid.of(edges).right(square), np.searchsorted(edges, square, side="right"))


def test_kaplan_meier_leaves_its_counts_as_they_were_in_either_memory_order() -> None:
    counts = np.asfortranarray([[3.0, 1.0, 0.0, 2.0], [0.0, 4.0, 1.0, 0.0]])
    before = counts.copy()
    censored, tail = np.array([-1, 2]), np.full(4, 0.25)
    got = kaplan_meier(counts, censored, tail)
    assert np.array_equal(counts, before)
    assert np.array_equal(got, kaplan_meier(np.ascontiguousarray(before), censored, tail))
