"""The held-out verdict on tiny frontiers worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from ember.sim import verdict
from ember.sim.heldout import judge
from ember.sim.heldout_report import verdict_lines


def pt(label: str, idle: float, mean: float, p99: float = 0.3, p75: float = 0.5) -> dict[str, object]:
    return {"label": label, "idle_mb_s": idle, "latency_mean_s": mean, "latency_p99_s": p99,
            "app_cold_start_p75": p75, "knob_value": 1.0, "invocations": 1}


LADDER = [pt("L1", 10, 5.0, p75=0.1), pt("L2", 20, 2.0, p75=0.05), pt("L3", 40, 1.0, p75=0.01)]


def test_domination_needs_no_worse_everywhere_and_better_somewhere() -> None:
    keys = ("idle_mb_s", "latency_mean_s")
    assert verdict.dominates(pt("a", 10, 4.0), pt("b", 10, 5.0), keys)
    assert verdict.dominates(pt("a", 9, 5.0), pt("b", 10, 5.0), keys)
    assert not verdict.dominates(pt("a", 10, 5.0), pt("b", 10, 5.0), keys)              # equal: no
    assert not verdict.dominates(pt("a", 10, 5.0 * (1 + 1e-12)), pt("b", 10, 5.0), keys)  # float noise: no
    assert not verdict.dominates(pt("a", 9, 6.0), pt("b", 10, 5.0), keys)                # a trade: no


def test_dominated_lists_each_ladder_point_with_its_cheapest_dominator() -> None:
    base = [pt("B1", 15, 3.0), pt("B2", 25, 1.5), pt("B3", 18, 1.9)]
    keys = verdict.PAIRS["latency"]
    hits = verdict.dominated(LADDER, base, keys)
    # L1 (10, 5.0): nothing has <= 10 memory. L2 (20, 2.0): B3 (18, 1.9) dominates it. L3 (40, 1.0): none is faster.
    assert [(p["label"], o["label"]) for p, o in hits] == [("L2", "B3")]
    # On p99 alone, B3's higher p99 spares L2; a cheaper point with the same p99 dominates L2 and L3.
    base[2]["latency_p99_s"] = 0.4
    assert verdict.dominated(LADDER, base, keys) == []
    assert [(p["label"], o["label"]) for p, o in verdict.dominated(LADDER, base, verdict.DIAGNOSTIC_PAIRS["p99"])] \
        == [("L2", "B1"), ("L3", "B1")]


def test_matched_budgets_by_hand() -> None:
    hybrid = [pt("H1", 5, 8.0), pt("H2", 20, 3.0), pt("H3", 50, 0.5)]
    rows = verdict.matched(LADDER, hybrid, "latency_mean_s")
    # Budgets 5, 10, 20, 40, 50. At 5 only H1 fits (loss); at 10 L1 5.0 < H1 8.0 (win); at 20 L2 2.0 < H2 3.0 (win);
    # at 40 L3 1.0 < H2 3.0 (win); at 50 L3 1.0 > H3 0.5 (loss).
    assert [r["budget_mb_s"] for r in rows] == [5, 10, 20, 40, 50]
    assert [r["outcome"] for r in rows] == ["loss", "win", "win", "win", "loss"]
    assert verdict.wins(rows) == (3, 5)
    tie = verdict.matched([pt("L", 10, 2.0)], [pt("H", 10, 2.0)], "latency_mean_s")
    assert [r["outcome"] for r in tie] == ["tie"]


def test_frontier_area_is_the_mean_log_of_the_best_within_each_budget() -> None:
    area = verdict.frontier_area(LADDER, np.array([5.0, 10.0, 30.0]), "latency_mean_s", worst=100.0)
    assert area == pytest.approx((np.log10(100.0) + np.log10(5.0) + np.log10(2.0)) / 3)


def test_judge_states_both_claims() -> None:
    base = {"fixed": [pt("F", 30, 1.5)], "hybrid-zygote": [pt("H1", 5, 8.0), pt("H2", 20, 3.0), pt("H3", 50, 0.5)]}
    v = judge({"ladder": LADDER, "ladder-cold": LADDER}, base)
    assert v["dominated"]["latency"] == []                     # F (30, 1.5) beats no ladder point on both
    assert v["matched"]["latency_mean_s"]["wins"] == 3 and v["matched"]["latency_mean_s"]["budgets"] == 5
    assert v["claims"] == {"undominated_on_both_pairs": True, "beats_hybrid_zygote_at_half": True}
    assert v["dominated"]["atc"] == []                         # every baseline has more cold starts (p75 0.5)
    base["fixed"].append(pt("F2", 19, 1.9, p75=0.04))
    v = judge({"ladder": LADDER, "ladder-cold": LADDER}, base)
    assert [(d["ladder"], d["by"]) for d in v["dominated"]["latency"]] == [("L2", "F2")]
    assert [(d["ladder"], d["by"]) for d in v["dominated"]["atc"]] == [("L2", "F2")]   # L3 has fewer (0.01)
    assert v["claims"]["undominated_on_both_pairs"] is False


def test_each_pair_judges_the_sweep_along_its_own_objective() -> None:
    """The ATC pair judges the cold-valued sweep, the latency pair the latency-valued one; the latency sweep on
    the ATC pair is reported beside, as a diagnostic that the claims do not count."""
    base = {"fixed": [pt("F2", 19, 1.9, p75=0.04)], "hybrid-zygote": [pt("H", 50, 0.5, p75=0.3)]}
    cold = [pt("C1", 12, 9.0, p75=0.03), pt("C2", 30, 9.0, p75=0.0)]   # F2 (19, p75 0.04) beats neither
    v = judge({"ladder": LADDER, "ladder-cold": cold}, base)
    assert [(d["ladder"], d["by"]) for d in v["dominated"]["latency"]] == [("L2", "F2")]
    assert v["dominated"]["atc"] == []
    assert [(d["ladder"], d["by"]) for d in v["dominated"]["atc_latency_objective"]] == [("L2", "F2")]
    assert v["points_by_sweep"] == {"ladder": 3, "ladder-cold": 2}
    # p75 budgets: the cold sweep (C1 12, C2 30) against H (50, 0.3): budgets 12, 30 and 50 won (0.03, 0, 0 < 0.3).
    assert v["matched"]["app_cold_start_p75"]["wins"] == 3 and v["matched"]["app_cold_start_p75"]["budgets"] == 3
    v = judge({"ladder": cold, "ladder-cold": LADDER}, base)
    # C1 (12 MB*s) holds less than F2; C2 (30, mean 9.0) holds more and is slower: dominated on latency.
    assert [(d["ladder"], d["by"]) for d in v["dominated"]["latency"]] == [("C2", "F2")]
    assert [(d["ladder"], d["by"]) for d in v["dominated"]["atc"]] == [("L2", "F2")]


def test_own_objective_prices_every_point_at_the_ladder_point_s_latency_value() -> None:
    # 10 invocations. At V = 1: the ladder's 100 + 1 x 2.0 x 10 = 120; "a" 50 + 1 x 5.0 x 10 = 100, "b" 200 + 10 =
    # 210: "a" lowest, the ladder 20% above it. At V = 100: the ladder 100 + 2,000 = 2,100; "a" 50 + 5,000; "b" 200
    # + 1,000 = 1,200: "b". At V = 10: the ladder 300; "a" 550, "b" 300: equal, an excess of 0 (lowest).
    def at(label: str, v: float, idle: float, mean: float) -> dict[str, object]:
        return {**pt(label, idle, mean), "knob_value": v, "invocations": 10}

    others = [at("a", 0, 50, 5.0), at("b", 0, 200, 1.0)]
    ladder = [at("L1", 1, 100, 2.0), at("L100", 100, 100, 2.0), at("L10", 10, 100, 2.0)]
    rows = verdict.own_objective(ladder, others)
    assert [(r["value"], r["ladder"], r["best_other"], r["by"]) for r in rows] == [
        (1.0, 120.0, 100.0, "a"), (100.0, 2100.0, 1200.0, "b"), (10.0, 300.0, 300.0, "b")]
    assert [r["excess"] for r in rows] == pytest.approx([0.2, 2100 / 1200 - 1, 0.0])
    # Against every point: the ladder's own others (each costs what the point does: the same memory and latency)
    # and `more` (a cold-sweep point, 40 MB*s, mean 4.0: at V = 1, 80, the lowest of all; at V = 10, 440). Ties go
    # to the first listed, the baselines.
    rows = verdict.own_objective(ladder, others, [at("C", 0, 40, 4.0)])
    assert [(r["by_any"], r["best_any"]) for r in rows] == [("C", 80.0), ("b", 1200.0), ("b", 300.0)]
    assert [r["excess_any"] for r in rows] == pytest.approx([0.5, 0.75, 0.0])


def test_own_objective_without_a_finite_rival_is_lowest() -> None:
    point = {**pt("L", 0, 0.0), "knob_value": 0.0, "invocations": 5}
    assert verdict.own_objective([point], [])[0] == {
        "value": 0.0, "ladder": 0.0, "best_other": None, "by": None, "excess": 0.0,
        "best_any": None, "by_any": None, "excess_any": 0.0}
    zero = {**pt("Z", 0, 0.0), "knob_value": 1.0, "invocations": 5}            # both 0: no division
    assert verdict.own_objective([point], [zero])[0]["excess"] == 0.0
    broken = {**pt("N", 1, float("nan")), "knob_value": 1.0, "invocations": 5}  # not a number: left out
    assert verdict.own_objective([{**point, "idle_mb_s": 5}], [broken, zero])[0]["by"] == "Z"


def test_tuning_score_counts_dominated_points_and_budgets_won() -> None:
    from ember.core.rung_costs import RungCosts
    from ember.sim.heldout import score

    # Latency sweep: L1 (100 MB*s, mean 2.0), L2 (300, 1.0). Baseline B (110, 1.9) dominates neither (L1 holds
    # less, L2 is faster); the cold sweep's C (50 MB*s, p75 0.9) is not dominated on the ATC pair (B holds more).
    # A cheaper cold-sweep point at its own value is no count either (the own-objective diagnostic is not scored).
    def at(label: str, idle: float, mean: float, p75: float = 0.5) -> dict[str, object]:
        return {**pt(label, idle, mean, p75=p75), "invocations": 10}

    ladder = [at("L1", 100, 2.0), at("L2", 300, 1.0)]
    cold = [at("C", 50, 6.5, p75=0.9)]
    dominated, won, _ = score({"ladder": ladder, "ladder-cold": cold}, {"hybrid-zygote": [at("B", 110, 1.9, 0.2)]},
                              RungCosts())
    assert dominated == 0
    # Budgets against hybrid-zygote B: 100 (L1 alone fits: a win), 110 (L1's 2.0 against B's 1.9: a loss), 300
    # (L2's 1.0: a win).
    assert won == pytest.approx(-2 / 3)
    # B2 (40 MB*s, mean 1.9, p75 0.2) dominates L1 on the latency pair (not L2, faster) and C on the ATC pair: 2.
    assert score({"ladder": ladder, "ladder-cold": cold}, {"hybrid-zygote": [at("B2", 40, 1.9, 0.2)]},
                 RungCosts())[0] == 2


def test_among_holds_each_policy_to_the_others() -> None:
    keys = ("idle_mb_s", "latency_mean_s")
    # A's (10, 5.0) and (30, 1.0); B's (20, 2.0) and (35, 1.0): B's second is dominated by A's (30, 1.0), nothing
    # of A's by B's (A's first holds less, its second is as fast and holds less).
    policies = {"A": [pt("A1", 10, 5.0), pt("A2", 30, 1.0)], "B": [pt("B1", 20, 2.0), pt("B2", 35, 1.0)]}
    assert verdict.among(policies, keys) == {"A": (0, 2), "B": (1, 2)}
    assert verdict.among({"A": policies["A"]}, keys) == {"A": (0, 2)}   # alone: nothing to dominate it


def test_the_memory_a_dominated_point_would_have_to_shed() -> None:
    # L2 (20 MB*s, 2.0 s) is dominated by B3 (18, 1.9) and B4 (19, 1.95): shedding more than 10% (below B3's 18)
    # lifts it; at exactly 18, B3 (faster) still dominates it.
    base = {"fixed": [pt("B3", 18, 1.9), pt("B4", 19, 1.95)], "hybrid-zygote": [pt("H", 50, 0.5)]}
    share = verdict.to_shed(LADDER[1], base["fixed"][0])
    assert share == pytest.approx(0.1)
    keys = verdict.PAIRS["latency"]
    for shed, lifted in ((share, False), (share * 0.99, False), (share + 1e-6, True)):
        point = {**LADDER[1], "idle_mb_s": 20 * (1 - shed)}
        assert (verdict.dominators(point, base["fixed"], keys) == []) is lifted, shed
    assert verdict.to_shed(pt("L", 18, 2.0), pt("B", 18, 1.9)) == 0.0     # as much memory: any saving lifts it
    assert verdict.to_shed(pt("L", 0, 2.0), pt("B", 0, 1.9)) == 1.0       # none held: no saving can
    v = judge({"ladder": LADDER, "ladder-cold": LADDER}, base)
    hits = v["dominated"]["latency"]
    assert [(d["ladder"], d["by"], d["to_shed"]) for d in hits] == [("L2", "B3", pytest.approx(0.1))]
    lines = verdict_lines("held", "tune", v)
    assert any(line.endswith("at 1 of 3 points (the most idle memory one would have to shed to be lifted: 10.00%):")
               for line in lines)
    assert "    L2 by B3 (shed 10.00%)" in lines
