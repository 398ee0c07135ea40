"""The multi-model replay's bookkeeping, on made-up samples: attribution of the node's processes to models, the
simulator's starts as the live node counts them (a fetch while another model holds the zygote forks from it),
and a whole comparison where the live node carried the plans out exactly."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest

from ember.core.rung_costs import RungCosts
from ember.core.rung_plan import IdlePlan
from ember.core.states import Rung
from ember.keepalive.forecast import IdleHistory
from ember.keepalive.policies import FixedKeepAlive, LadderPolicy
from ember.testing.replay import Sent, determined_groups, predicted
from ember.testing.replay_many import (
    Sample,
    attribute,
    compare_many,
    ident,
    model_state_s,
    owners_from_status,
    steady,
)

A, B = (101, 7), (102, 8)   # two templates' (pid, start time)


ZERO = {"hot": 0, "paused": 0, "template": 0, "zygote": 0, "fetch": 0}


def test_owners_come_from_the_status_page() -> None:
    status = {"models": [
        {"name": "iris-a", "template": {"pid": 101}, "instances": [{"pid": 201}, {"pid": None}]},
        {"name": "iris-b", "template": None, "instances": []}]}
    assert owners_from_status(status) == {101: ("iris-a", "template"), 201: ("iris-a", "instance")}


def test_a_process_is_known_by_its_pid_and_start_time() -> None:
    me = ident(os.getpid())
    assert me is not None and me[0] == os.getpid() and me == ident(os.getpid())
    assert ident(2**22 + 1) is None   # above any pid_max: no such process


def test_each_zygote_child_and_its_children_count_for_its_model() -> None:
    samples = [Sample(0.0, 1, 30.0, {A: (10.0, 4.0, 1), B: (9.0, 0.0, 0)}),
               Sample(0.1, 1, 31.0, {A: (10.0, 0.0, 0), (103, 9): (5.0, 1.0, 1)}),
               Sample(0.2, 0, 0.0, {})]
    owners = {A: ("iris-a", "template"), B: ("iris-b", "template")}
    live = attribute(samples, owners, ["iris-a", "iris-b"])
    assert live.model_mb["iris-a"].tolist() == [14.0, 10.0, 0.0]
    assert live.model_state["iris-a"].tolist() == ["instance", "template", "none"]
    assert live.model_state["iris-b"].tolist() == ["template", "none", "none"]
    assert live.unattributed_mb.tolist() == [0.0, 6.0, 0.0]     # (103, 9) was never listed
    assert live.zygote_up.tolist() == [True, True, False] and live.zygote_mb.tolist() == [30.0, 31.0, 0.0]
    # An instance forked from the zygote itself (a model that keeps no template) is its model's instance.
    alone = attribute([Sample(0.0, 1, 30.0, {A: (12.0, 0.0, 0)})], {A: ("iris-a", "instance")}, ["iris-a"])
    assert alone.model_state["iris-a"].tolist() == ["instance"]


def test_steady_is_the_value_held_through_an_interval() -> None:
    t, up = np.arange(10) * 0.1, np.array([0, 0, 0, 1, 1, 1, 1, 1, 0, 0], dtype=bool)
    assert steady(t, up, 0.35, 0.75) is True
    assert steady(t, up, 0.0, 0.25) is False
    assert steady(t, up, 0.25, 0.45) is None


def test_a_model_s_states_from_the_simulator_s_levels() -> None:
    assert model_state_s(np.array([1.0, 2.0, 3.0, 4.0, 5.0])) == {"instance": 3.0, "template": 3.0, "none": 9.0}


def test_a_ladder_s_arrival_is_determined_only_where_every_share_agrees() -> None:
    policy = LadderPolicy(latency_value=1000.0)
    sent = [Sent(0.0, 0.01, "template")]
    for _ in range(20):   # idle 5 s each: the zygote kept (any share)
        sent.append(Sent(sent[-1].done + 5.0, sent[-1].done + 5.01, "zygote"))
    sent.append(Sent(sent[-1].done + 20.0, sent[-1].done + 20.01, "fetch"))
    even, _ = predicted(policy, sent, 0.5, sent[-1].done + 1)
    shared, _ = predicted(policy, sent, 0.5, sent[-1].done + 1, shares=(0.0, 0.5, 1.0))
    # After 20 s the even split has dropped the zygote (nothing kept); with the zygote free (others hold it all
    # the time) it would still be kept: the live plan's share decides, and the replay does not see it.
    assert even[-1] == ("fetch", True) and shared[-1] == ("fetch", False)
    assert even[-2] == shared[-2] == ("zygote", True)
    # In the server's first whole minute it has no share: it plans at the even split alone.
    first, _ = predicted(policy, sent, 0.5, sent[-1].done + 1, shares=(0.0, 0.5, 1.0), shares_from=sent[-1].at + 1)
    assert first == even


def _timeline(sent: dict[str, list[Sent]], end: float, keep_s: float, step: float = 0.01) -> list[Sample]:
    """Samples of a node that carried `fixed` out exactly: a model's template and instance from each arrival to
    `keep_s` after its reply, its deployed template until its first arrival; the zygote while any is up."""
    owner = {"iris-a": A, "iris-b": B}
    out = []
    for t in np.arange(-0.5, end + step, step):
        kids = {}
        for m, v in sent.items():
            if t < v[0].at:
                kids[owner[m]] = (5.0, 0.0, 0)
            elif any(s.at <= t < s.done + keep_s for s in v):
                kids[owner[m]] = (5.0, 3.0, 1)
        out.append(Sample(float(t), 1 if kids else 0, 10.0 if kids else 0.0, kids))
    return out


def test_a_node_that_carries_the_plans_out_matches_the_simulator() -> None:
    sent = {"iris-a": [Sent(1.0, 1.1, "template"), Sent(5.0, 5.1, "fetch"), Sent(12.0, 12.1, "fetch")],
            "iris-b": [Sent(2.0, 2.1, "template"), Sent(6.0, 6.1, "zygote"), Sent(15.0, 15.1, "fetch")]}
    live = attribute(_timeline(sent, 20.0, 2.0), {A: ("iris-a", "template"), B: ("iris-b", "template")},
                     ["iris-a", "iris-b"])
    r = compare_many(FixedKeepAlive(2.0), sent, live, 0.0, 20.0, 0.5)
    assert r["since_s"] == 2.0
    for m, v in r["models"].items():
        assert v["live"]["starts"] == v["sim"]["starts"], m
        assert v["live"]["determined"] == {"n": 2, "agree": 2, "disagree": []}, m
        for state, s in v["live"]["state_s"].items():
            assert s == pytest.approx(v["sim"]["state_s"][state], abs=0.05), (m, state)
        assert v["live"]["idle_mb_s"] == pytest.approx(v["sim"]["idle_mb_s"], abs=0.5), m
    # b's start at 6 s found a's zygote up: a zygote start live and in the simulator (b's plan: nothing kept).
    assert r["models"]["iris-b"]["sim"]["starts"] | {"zygote": 0} == {**ZERO, "fetch": 1}
    assert r["models"]["iris-b"]["sim"]["starts"]["zygote"] == 1
    # From 2 s: [2, 4.1) + [5, 8.1) + [12, 14.1) + [15, 17.1), live and in the simulator's union.
    assert r["zygote"]["sim"]["up_s"] == pytest.approx(9.4)
    assert r["zygote"]["live"]["up_s"] == pytest.approx(9.4, abs=0.05)
    assert r["costs"]["hot"]["idle_mb"] == pytest.approx(8.0) and r["costs"]["zygote"]["idle_mb"] == 10.0
    assert r["total"]["live"] == pytest.approx(r["total"]["sim"], rel=0.01)
    assert r["unattributed_mb_s"] == 0.0
    assert r["zygote"]["live"]["releases"] == 4   # at 4.1, 8.1, 14.1 and 17.1


@dataclass(frozen=True)
class _Prewarm(FixedKeepAlive):
    """Hot for 5 s, then nothing, then the zygote again from 60 s (a pre-warm), whatever the history."""

    def plan(self, history: IdleHistory) -> IdlePlan:
        return IdlePlan(((0.0, Rung.HOT), (5.0, Rung.FETCH), (60.0, Rung.ZYGOTE)))


def test_an_arrival_while_the_plan_climbs_back_is_predicted_from_where_the_climb_began() -> None:
    # The climb from nothing to the zygote at 60 s takes 12.2 s (full start 12.5 s, zygote start 0.3 s).
    sent = [Sent(0.0, 0.01, "fetch")]
    for gap in (65.0, 72.0, 80.0):
        sent.append(Sent(sent[-1].done + gap, sent[-1].done + gap + 0.01, "zygote"))
    start_s = RungCosts().start_s()
    pred, _ = predicted(_Prewarm(), sent, 0.5, sent[-1].done + 1, start_s=start_s)
    assert pred == [("fetch", True), ("fetch", False), ("zygote", True)]   # 72 s: within 0.5 s of its end
    instant, _ = predicted(_Prewarm(), sent, 0.5, sent[-1].done + 1)
    assert instant == [("zygote", True)] * 3


@dataclass(frozen=True)
class _PrewarmHot(FixedKeepAlive):
    """Hot for 5 s, then nothing, then hot again from 60 s (a pre-warm from nothing), whatever the history."""

    def plan(self, history: IdleHistory) -> IdlePlan:
        return IdlePlan(((0.0, Rung.HOT), (5.0, Rung.FETCH), (60.0, Rung.HOT)))


def test_a_climb_from_nothing_begun_while_the_live_zygote_was_up_is_predicted_from_it() -> None:
    # Gaps of 61 s and 60.1 s: 1 s and 0.1 s into the climb back to hot at 60 s (12.5 s from nothing; 0.2997 s
    # from the zygote another model kept up).
    sent = [Sent(0.0, 0.01, "fetch")]
    for gap in (61.0, 60.1):
        sent.append(Sent(sent[-1].done + gap, sent[-1].done + gap + 0.01, "hot"))
    start_s = RungCosts().start_s()
    end = sent[-1].done + 1
    down, _ = predicted(_PrewarmHot(), sent, 0.05, end, start_s=start_s, zygote_up=lambda a, b: False)
    assert down == [("fetch", True), ("fetch", True)]
    up, _ = predicted(_PrewarmHot(), sent, 0.05, end, start_s=start_s, zygote_up=lambda a, b: True)
    assert up == [("hot", True), ("zygote", True)]
    near, _ = predicted(_PrewarmHot(), sent, 0.5, end, start_s=start_s, zygote_up=lambda a, b: True)
    assert near == [("hot", True), ("zygote", False)]        # 60.1 s: within 0.5 s of the climb's end (60.2997)
    unsure, _ = predicted(_PrewarmHot(), sent, 0.05, end, start_s=start_s, zygote_up=lambda a, b: None)
    assert unsure == [("fetch", False), ("fetch", False)]    # the zygote came or went as the climb began
    seen: list[tuple[float, float]] = []
    predicted(_PrewarmHot(), sent, 0.05, end, start_s=start_s, zygote_up=lambda a, b: seen.append((a, b)) or True)
    assert seen and seen[0] == pytest.approx((60.01 - 0.05, 60.01))   # the climb began 60 s after the first ended


def test_arrivals_before_the_first_reply_are_in_the_first_arrival_s_group() -> None:
    # Recorded at a server's start: the request sent 59 ms after the first overtook it and took the deployed
    # template's start; both waited for it. The first arrival is never determined, so neither is its group.
    sent = [Sent(0.1519, 0.3031, "hot"), Sent(0.2106, 0.2859, "template"), Sent(0.2110, 0.2860, "hot"),
            Sent(3.0729, 3.1525, "zygote"), Sent(3.0737, 3.18, "hot")]
    pred = [("", False), ("hot", True), ("hot", True), ("zygote", True), ("hot", True)]
    assert determined_groups(pred, sent) == [(["hot", "zygote"], ["hot", "zygote"])]
    # Later arrivals 50 ms apart or more are groups of their own.
    later = [Sent(0.0, 0.01, "template"), Sent(1.0, 1.1, "zygote"), Sent(1.06, 1.1, "hot")]
    assert determined_groups([("", False), ("zygote", True), ("hot", True)], later) == [(["zygote"], ["zygote"]),
                                                                                        (["hot"], ["hot"])]


def test_each_plan_s_climb_is_checked_against_the_live_zygote_when_it_began() -> None:
    from ember.testing.replay import _start
    start_s = RungCosts().start_s()
    at_60 = IdlePlan(((0.0, Rung.HOT), (5.0, Rung.FETCH), (60.0, Rung.HOT)))
    at_58 = IdlePlan(((0.0, Rung.HOT), (5.0, Rung.FETCH), (58.0, Rung.HOT)))
    asked: list[float] = []

    def up(a: float, b: float) -> bool:
        asked.append(b)
        return True

    # 61 s after a reply at 100: both plans' climbs (begun at 160 and 158) forked from the zygote up then.
    assert _start([at_60, at_58], 61.0, 100.0, 0.05, start_s, False, up) == ("hot", True)
    assert {158.0, 160.0} <= set(asked)
    # The zygote down when the other plan's climb began: that plan starts from nothing, so undetermined.
    assert _start([at_60, at_58], 61.0, 100.0, 0.05, start_s, False, lambda a, b: b > 159.0) == ("hot", False)


def test_the_replay_judges_the_policy_the_server_runs() -> None:
    """`ember serve --keepalive ladder` runs the default preset's ladder: the replay's predictions and simulator
    use that very policy, not the class defaults; other policies as named."""
    from ember.config import ServeConfig, keepalive_policy
    from ember.testing.replay import served_policy

    for name, knob in (("ladder", 3000.0), ("ladder-cold", None), ("fixed", 2.0)):
        assert served_policy(name, knob) == keepalive_policy(ServeConfig(keepalive=name, keepalive_knob=knob))
    ladder = served_policy("ladder", 3000.0)
    assert isinstance(ladder, LadderPolicy) and ladder.pooled_weight == 1.0 and ladder.latency_value == 3000.0


def test_the_pooled_prior_is_the_live_node_s_at_each_time() -> None:
    """At time t, its epoch's (`POOL_EPOCH_S` from the server's start; the first pools none), pooled at the
    epoch's start: every model's idle periods ended by then (a busy arrival an idle period of 0), each model's idle
    time so far censored, a model not yet called with an empty history (`LadderPolicy.pool`)."""
    from ember.keepalive.pooled_prior import POOL_EPOCH_S
    from ember.testing.replay import pooled_prior

    policy = LadderPolicy(pooled_weight=1.0)
    sent = {"a": [Sent(0.0, 0.1, "fetch"), Sent(2.1, 2.2, "hot"), Sent(2.15, 2.3, "hot")],
            "b": [Sent(10.0, 10.1, "fetch")]}
    first = pooled_prior(policy, sent, 0.0)
    assert first is not None and first(5.0) is None and first(POOL_EPOCH_S - 1.0) is None   # the first epoch
    at = pooled_prior(policy, sent, 5.0 - POOL_EPOCH_S)   # an epoch begins at 5 s
    assert at is not None and pooled_prior(FixedKeepAlive(2.0), sent, 0.0) is None
    assert pooled_prior(LadderPolicy(pooled_weight=0.0), sent, 0.0) is None
    later = at(9.0)   # the same epoch: pooled at its start, not at 9 s
    assert later is not None and np.array_equal(later.mass, at(5.0).mass)   # type: ignore[union-attr]
    h = policy.new_history()
    h.observe(2.0)
    h.observe(0.0)
    want = policy.pool([h.table(), policy.new_history().table()], [5.0 - 2.3, None])
    got = at(5.0)
    assert got is not None and want is not None
    np.testing.assert_allclose(got.mass, want.mass)
    np.testing.assert_allclose(got.head_sums, want.head_sums)
    assert got.apps.tolist() == want.apps.tolist()
