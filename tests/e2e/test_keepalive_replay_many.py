"""Keep-alive plans of two models sharing one zygote, carried out live, agree with the simulator: the first 250 s
of the Azure Functions 2021 sample's busiest app and its steadiest (one arrival every ~35 s), ten times faster
(25 s), against `ember serve --keepalive fixed --keepalive-knob 2` serving two iris models (hot for 2 s after
each request, then nothing kept: each drops its template, and the zygote goes once neither holds it)."""

from __future__ import annotations

import pytest

from ember.keepalive.idle_plan import LEVELS
from ember.testing.replay import TRACES
from ember.testing.replay_many import run_many

TRACE = TRACES / "azure-functions-2021-sample"
DEV_A = TRACES / "azure-functions-2019" / "dev-a"
# Ten applications of dev-a (issue 30, section 4): bursts at their first arrival, busy and rare ones.
DEV_A_APPS = ["ec8fbb21b22f", "3e3b8f87701b", "53431e1f5f1d", "24c2261d78b5", "b5df4af42370", "904723401f03",
              "a503a70be4b0", "ab82e5d51c8a", "f3f5a51a21ac", "c6627d48307d"]

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not TRACE.is_dir(), reason=f"the Azure Functions 2021 sample is not at {TRACE}")
def test_two_models_sharing_a_zygote_replayed_live_match_the_simulator() -> None:
    """Per model, every arrival not within 0.5 s of a plan step (nor of the zygote coming or going, for a start
    from nothing kept: the node forks it from a zygote the other model holds) lands on the predicted rung, but for
    at most one start from the zygote and one from nothing swapped (the other model's timing slipping), and
    the starts per rung differ from the simulator's (where a start from nothing that found the zygote up, held by
    the other model, is a zygote start too) by no more than the undetermined arrivals.

    The zygote's seconds up (from the moment both models have had a request) within 0.6 s per release of the
    simulator's union of the two models' holds: the live node releases it a tick (50 ms) plus a kill after the
    plan says so, 0.1-0.3 s here, and forks a new one ~0.1 s into a full start; the 0.6 s leave room for a
    slow, shared machine, while a zygote kept across one of the window's 3-6 s gaps when neither model holds
    it would pass it. Idle memory within 15% (as for one model: the simulator is fed the mean PSS measured per
    state, so what differs is how long each is held).

    250 s of the trace, not the 500 s it was: both halves repeat one pattern (replayed, the busy app's request
    every 6 s after its opening bursts, the steady one's every 3-4 s: a drop to nothing between any two, zygote
    starts where the other's instance was up, full starts where not), and the first half already has 4 zygote
    starts and 5 full ones (500 s: 7 and 12), 4 zygote releases (10) and the opening bursts. One run each (6
    December, this 2-core VM): every determined arrival on its rung at both lengths, zygote up +0.55 s (500 s:
    +1.2 s), idle memory +3.3% (500 s: +2.8%)."""
    r = run_many(TRACE, ["734272c01926", "7fa05b607ae8"], 0.0, 250.0, 10.0, "fixed", 2.0)
    for model, v in r["models"].items():
        arrivals = len(r["sent"][model])
        det = v["live"]["determined"]
        # A start from nothing kept forks the zygote the other model holds: whether it is there depends on that
        # model's own release or start, timed on the client. On a loaded machine one of them may slip past the
        # margin (CI: a zygote start predicted, a full one live); at most one such swap per model, nothing else.
        swaps = [d for d in det["disagree"] if set(d[0]) | set(d[1]) <= {"zygote", "fetch"}]
        assert det["disagree"] == swaps and len(swaps) <= 1 and det["n"] >= arrivals // 2, (model, det)
        for level in LEVELS:
            gap = abs(v["live"]["starts"][level.value] - v["sim"]["starts"][level.value])
            assert gap <= arrivals - 1 - det["n"] + len(swaps), (model, level, v["live"]["starts"],
                                                                   v["sim"]["starts"])
    assert sum(v["live"]["starts"]["fetch"] for v in r["models"].values()) >= 1   # the zygote was let go
    assert sum(v["sim"]["starts"]["zygote"] for v in r["models"].values()) >= 1   # ... and found held by the other
    z = r["zygote"]
    assert abs(z["live"]["up_s"] - z["sim"]["up_s"]) <= 0.6 * (z["live"]["releases"] + 1), z
    live, sim = r["total"]["live"], r["total"]["sim"]
    assert abs(live / sim - 1) <= 0.15, (live, sim)
    assert r["unattributed_mb_s"] == 0.0


@pytest.mark.skipif(not DEV_A.is_dir(), reason=f"the Azure Functions 2019 day dev-a is not at {DEV_A}")
def test_ten_applications_of_an_azure_day_under_the_served_ladder_land_on_their_predicted_rungs() -> None:
    """The first 15 minutes of dev-a's second hour, ten times faster (90 s), ten applications under what
    `ember serve --keepalive ladder` runs (the preset `azure-2019-dev`, the pooled prior and the zygote at its
    marginal price): every determined arrival on the rung its plan predicts, nothing swapped. It holds the live
    node to the simulator's rules: requests that come while a model's first one runs are idle periods of 0 and
    the plan after them is made from them (three apps here start with such a burst: before, their next arrival
    started from the zygote where the plan of their history kept them hot), and the pooled prior is renewed per
    epoch (the first pools none), not at whichever tick follows an arrival.

    Idle memory within 10% of the simulator's (the hour in docs/benchmarks.md: -0.0%; a shorter window
    weighs each step's tick-plus-kill lateness more), the zygote's seconds up as for the two-model test."""
    r = run_many(DEV_A, DEV_A_APPS, 3600.0, 900.0, 10.0, "ladder", None)
    determined = 0
    for model, v in r["models"].items():
        det = v["live"]["determined"]
        assert det["disagree"] == [], (model, det)
        determined += det["n"]
        for level in LEVELS:
            gap = abs(v["live"]["starts"][level.value] - v["sim"]["starts"][level.value])
            assert gap <= len(r["sent"][model]) - 1 - det["n"], (model, level, v["live"]["starts"],
                                                                 v["sim"]["starts"])
    assert determined >= 40, determined
    z = r["zygote"]
    assert abs(z["live"]["up_s"] - z["sim"]["up_s"]) <= 0.6 * (z["live"]["releases"] + 1), z
    live, sim = r["total"]["live"], r["total"]["sim"]
    assert abs(live / sim - 1) <= 0.10, (live, sim)
    assert r["unattributed_mb_s"] == 0.0
