"""Keep-alive plans carried out live agree with the simulator: 30 s of the Azure LLM 2023 `code` service replayed
against `ember serve --keepalive fixed --keepalive-knob 2` (hot for 2 s after each request, then nothing kept:
the template and the zygote are released, and the next request is a full start)."""

from __future__ import annotations

import pytest

from ember.keepalive.idle_plan import LEVELS
from ember.testing.replay import TRACES, run

TRACE = TRACES / "azure-llm-2023"

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not TRACE.is_dir(), reason=f"the Azure LLM 2023 trace is not at {TRACE}")
def test_a_trace_window_replayed_live_matches_the_simulator() -> None:
    """Starts per rung: exact for every arrival whose idle time is not within 0.5 s of a plan step (the tick is
    50 ms; a release, or a full start's zygote, takes a few hundred ms more on a loaded machine); the simulator's
    counts equal the per-arrival predictions exactly.

    Idle memory (node PSS integrated over the idle time) within 15% of the simulator's: the simulator is fed the
    mean PSS this run measured in each node state, so what can differ is how long each state is held. The
    plan's steps are carried out a tick plus a kill late (each hot -> nothing step holds the instance, template
    and zygote ~0.1-0.3 s longer), a full start's processes grow while they load, and PSS is sampled every 50 ms;
    the window's four drops to nothing against ~27 s of idle time put these at a few percent (the 3-minute
    replay in docs/policies.md: +1.3%), and 15% leaves room for a slow, shared machine without hiding a plan
    that is not carried out (the zygote and template left up through the window's 10 s gap alone would add
    more than 15%).

    30 s, not more: the window holds the four gaps (4 s, the 10 s, 3.3 s, 2.7 s), each a drop to nothing and a
    full start, and ends in a burst; the 40 s it was (2.3 s more of that burst, then a 7.7 s tail with a fifth
    drop and nothing kept, PSS 0) checked nothing more: the same 4 full starts, all determined arrivals on their
    rung, idle memory +3.8% there and +3.9% here (one run each, 6 December, this 2-core VM)."""
    r = run(TRACE, "code", 2100.0, 30.0, 1.0, "fixed", 2.0)   # its own short state dir: socket paths are limited
    undetermined = r["arrivals"] - 1 - r["determined"]["n"]
    assert r["determined"]["disagree"] == [] and r["determined"]["n"] >= 0.8 * (r["arrivals"] - 1)
    assert r["sim"]["starts"] == r["plan"]["starts"]
    for level in LEVELS:
        assert abs(r["live"]["starts"][level.value] - r["sim"]["starts"][level.value]) <= undetermined
    assert r["live"]["starts"]["fetch"] >= 1   # the plan's "nothing" was carried out: full starts happened
    live, sim = r["live"]["idle_pss_mb_s"], r["sim"]["idle_mb_s"]
    assert abs(live / sim - 1) <= 0.15, (live, sim)
