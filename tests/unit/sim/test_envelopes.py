"""The envelope yardstick (issue 30), each rule on figures worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from ember.core.rung_costs import RungCosts
from ember.keepalive.policies import FixedKeepAlive
from ember.sim import verdict
from ember.sim.engine import app_items, poisson_trace, simulate
from ember.sim.envelopes import figures, judge, run_point, variants
from ember.sim.greedy_dual import FaaSCache
from ember.sim.shared_engine import simulate_shared
from ember.sim.traces import AppTrace, Trace
from ember.sim.verdict import AppFigures, Stack

COSTS = RungCosts()
START = COSTS.start_s()        # hot 0.3 ms, paused 0.8 ms, template 85 ms, zygote 0.3 s, nothing 12.5 s


def test_envelope_is_the_least_memory_at_no_worse_quality() -> None:
    q, m = np.array([0.1, 0.2, 0.3]), np.array([30.0, 20.0, 25.0])
    assert verdict.envelope(q, m, np.array([0.05, 0.1, 0.25, 0.35])).tolist() == [np.inf, 30.0, 20.0, 20.0]
    assert verdict.pareto(q, m).tolist() == [0, 1]           # (0.3, 25) is beaten by (0.2, 20)


def test_eps_is_the_ladder_envelope_at_the_point_plus_delta_over_its_memory() -> None:
    lq, lm = np.array([0.1, 0.2]), np.array([27.0, 22.0])
    bq, bm = np.array([0.1, 0.2, 0.3]), np.array([30.0, 20.0, 25.0])
    every = np.ones(3, dtype=bool)
    e = verdict.eps(lq, lm, bq, bm, np.zeros(3), every)
    assert e[0] == pytest.approx(27 / 30 - 1) and e[1] == pytest.approx(22 / 20 - 1) and np.isnan(e[2])
    # delta lets the ladder use a point up to delta worse: at b0, the ladder's (0.2, 22) counts.
    assert verdict.eps(lq, lm, bq, bm, np.full(3, 0.1), every)[0] == pytest.approx(22 / 30 - 1)
    # A saturated point is not judged; a quality the ladder never reaches is an infinite gap.
    assert np.isnan(verdict.eps(lq, lm, bq, bm, np.zeros(3), np.array([False, True, True]))[0])
    assert verdict.eps(np.array([0.5]), np.array([1.0]), bq, bm, np.zeros(3), every)[0] == np.inf


def test_weighted_percentile_is_numpys_on_the_expanded_sample() -> None:
    vals = np.array([[0.0, 0.5, 1.0]])
    assert verdict.weighted_percentile(vals, np.array([[1.0, 1.0, 2.0]]), 0.75)[0] == 1.0          # 0 .5 1 1
    assert verdict.weighted_percentile(vals, np.array([[2.0, 1.0, 1.0]]), 0.75)[0] == 0.625        # 0 0 .5 1
    rng = np.random.default_rng(1)
    v = np.sort(rng.random(9))
    w = rng.integers(0, 4, 9).astype(float)
    assert verdict.weighted_percentile(v[None], w[None], 0.75)[0] == pytest.approx(
        np.percentile(np.repeat(v, w.astype(int)), 75))


def point(label: str, mem: list[float], starts: list[list[float]], inv: list[float]) -> AppFigures:
    s = np.array(starts, dtype=float)
    first = np.zeros_like(s)
    first[:, 4] = 1
    cold = (s + first)[:, 2:].sum(axis=1) / np.array(inv)
    return AppFigures("p", label, {"charged": np.array(mem), "excluded": np.array(mem)}, s, cold, np.array(inv))


def test_qualities_leave_out_the_first_start_and_delta_is_one_start_of_the_p75_app() -> None:
    # Two apps: A 4 calls (first from nothing, then 2 hot and 1 from the zygote), B 2 calls (first, then 1 hot).
    p = point("x", [10.0, 5.0], [[2, 0, 0, 1, 0], [1, 0, 0, 0, 0]], [4, 2])
    st = Stack([p], START, "charged")
    w = np.ones(2)
    # Mean latency over the 4 non-first starts: (3 x 0.3 ms + 0.3 s) / 4.
    assert st.quality("latency", w)[0] == pytest.approx((3 * 0.0003 + 0.3) / 4)
    # Cold shares (first counted, as ATC'20): A 2/4, B 1/2; p75 of (0.5, 0.5) = 0.5.
    assert st.quality("atc", w)[0] == pytest.approx(0.5)
    # p99 of the non-first starts (3 hot, 1 zygote): the zygote's 0.3 s.
    assert st.quality("p99", w)[0] == pytest.approx(0.3)
    assert st.memory(w)[0] == 15.0
    # The p75 app by nearest rank: round(0.75 x 1) = 1, the second in cold-share order (stable: B); 1 / 2 calls.
    assert st.delta("atc", st.quality("atc", w), w)[0] == pytest.approx(1 / 2)
    assert st.delta("latency", np.array([0.2]), w)[0] == pytest.approx(0.001)


def test_unsaturated_rules() -> None:
    assert verdict.unsaturated("atc", np.array([0.0, 0.3, 1.0]), START).tolist() == [False, True, False]
    floor = START.min()
    assert verdict.unsaturated("latency", np.array([floor * 1.005, floor * 1.02]), START).tolist() == [False, True]
    assert verdict.unsaturated("p99", np.array([0.3, 12.5]), START).tolist() == [True, False]


def test_geometric_mean_saving_over_levels_inside_both_envelopes() -> None:
    bq, bm = np.array([0.01, 0.02, 0.04]), np.array([40.0, 20.0, 10.0])
    lq, lm = np.array([0.01, 0.02, 0.04]), np.array([20.0, 10.0, 5.0])      # half the memory at every quality
    at = verdict.levels("latency", lq, bq, START)
    assert len(at) == verdict.LEVELS_N and at[0] == pytest.approx(0.01) and at[-1] == pytest.approx(0.04)
    assert verdict.geo_ratio(lq, lm, bq, bm, at) == pytest.approx(2.0)
    # The ATC pair is judged inside its band: no level where the envelopes lie below 20%.
    assert len(verdict.levels("atc", lq, bq, START)) == 0
    assert len(verdict.levels("atc", bq * 20, bq * 20, START)) == verdict.LEVELS_N   # 0.2 .. 0.8
    assert verdict.levels("atc", lq, bq, START, band=False)[-1] == pytest.approx(0.04)


def test_judge_pair_on_a_ladder_half_the_baselines_memory() -> None:
    apps = 30
    rng = np.random.default_rng(0)

    inv = rng.integers(10, 20, apps).astype(float)

    def pts(scale: float) -> list[AppFigures]:
        out = []
        for k, share in enumerate((0.5, 0.3, 0.1, 0.05)):     # more memory, fewer zygote starts
            zyg = np.round(share * (inv - 1))
            starts = np.zeros((apps, 5))
            starts[:, 3], starts[:, 0] = zyg, inv - 1 - zyg
            mem = scale * (k + 1) * 100 * np.ones(apps)
            cold = (zyg + 1) / inv
            out.append(AppFigures("p", f"p{k}", {"charged": mem, "excluded": mem}, starts, cold, inv))
        return out

    base, ladder = pts(1.0), pts(0.5)                 # the same starts, half the memory
    r = verdict.judge_pair(Stack(ladder, START, "charged"), Stack(base, START, "charged"), "latency", resamples=50)
    assert r["max_eps"] == pytest.approx(-0.5)
    assert r["geo_saving"] == pytest.approx(0.5)
    assert r["ci_low"] == pytest.approx(0.5) and r["ci_high"] == pytest.approx(0.5)


def one_app_trace() -> Trace:
    """One app called at 0 s and 100 s (no execution time), over 1,000 s."""
    app = AppTrace("a", np.array([0.0, 100.0]), np.ones(2, dtype=np.int64), np.zeros(2), np.zeros(2))
    return Trace("one", "test", 1000.0, [app])


def test_end_rules_on_a_fixed_keep_alive_worked_by_hand() -> None:
    trace = one_app_trace()
    items = [app_items(a, trace.horizon_s) for a in trace.apps]
    run = run_point(trace, FixedKeepAlive(keep_alive_s=600.0), COSTS, 1, items)
    f = figures(trace, run, items, COSTS, 1, "fixed", "fixed 600s")
    # Charged: hot 100 s between the calls and 600 s after the last (250 MB); the zygote from 0 to 700 s (150 MB).
    assert f.mem["charged"][0] == pytest.approx(700 * 250 + 700 * 150)
    assert f.mem["charged"].sum() == pytest.approx(run.total_idle_mb_s)
    # Excluded: nothing after the last call at 100 s.
    assert f.mem["excluded"][0] == pytest.approx(100 * 250 + 100 * 150)
    # The second call found it hot; the first (compulsory) is left out of the starts.
    assert f.starts[0].tolist() == [1, 0, 0, 0, 0] and f.cold[0] == pytest.approx(0.5)


def test_end_rules_on_the_shared_node_worked_by_hand() -> None:
    trace = one_app_trace()
    items = [app_items(a, trace.horizon_s) for a in trace.apps]
    run = run_point(trace, FaaSCache(budget_gb=1.0), COSTS, 1, items)
    f = figures(trace, run, items, COSTS, 1, "faascache", "1GB")
    # Never evicted: hot from 0 to 1,000 s but the call (no length); the zygote from the first start on.
    assert f.mem["charged"][0] == pytest.approx(1000 * 250 + 1000 * 150)
    assert f.mem["charged"].sum() == pytest.approx(run.total_idle_mb_s)
    assert f.mem["excluded"][0] == pytest.approx(100 * 250 + 100 * 150)


def test_charged_memory_adds_up_to_the_engines_totals_with_a_shared_zygote() -> None:
    trace = poisson_trace(0.002, 6 * 3600.0, seed=3, apps=6)
    items = [app_items(a, trace.horizon_s) for a in trace.apps]
    for policy in (FixedKeepAlive(keep_alive_s=120.0), *[p for _, p in variants("ladder", COSTS, 3.0)[::9]]):
        run = simulate(trace, policy, COSTS, runtimes=2, items=items, per_app=True)
        f = figures(trace, run, items, COSTS, 2, "x", "x")
        assert f.mem["charged"].sum() == pytest.approx(run.total_idle_mb_s, rel=1e-9)
        assert f.mem["excluded"].sum() <= f.mem["charged"].sum()   # (per app, the zygote's shares move)
    shared = simulate_shared(trace, FaaSCache(budget_gb=0.5), COSTS, runtimes=2, per_app=True)
    f = figures(trace, shared, items, COSTS, 2, "faascache", "x")
    assert f.mem["charged"].sum() == pytest.approx(shared.total_idle_mb_s, rel=1e-9)


def test_judge_reports_every_rule_pair_and_comparison() -> None:
    trace = poisson_trace(0.003, 4 * 3600.0, seed=5, apps=8)
    items = [app_items(a, trace.horizon_s) for a in trace.apps]
    pts = {name: [figures(trace, run_point(trace, p, COSTS, 2, items), items, COSTS, 2, name, label)
                  for label, p in variants(name, COSTS, 4.0)[::4]] for name in ("fixed", "ladder")}
    out = judge(pts, COSTS, resamples=20)
    assert set(out) == {"charged", "excluded"}
    for rule in out.values():
        assert set(rule) == {"atc", "latency", "p99"}
        for rows in rule.values():
            assert set(rows) == {"pooled", "fixed"}
            assert {"max_eps", "geo_saving", "ci_low", "ci_high"} <= set(rows["pooled"])
