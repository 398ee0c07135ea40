"""A fuzzer over the policies' knobs as `ember sim --knob POLICY.NAME=VALUE` gives them: any of a policy's knobs,
or a name that is not one, set to any number (NaN, infinities, negatives, zero, fractions for whole-number knobs,
huge values, and the default scaled up or down). Either the policy is refused with `InvalidInput` naming the policy
and a knob, or it is built, plans for a model (the live driver's call) and simulates a small trace of three
applications on two runtimes with every invocation started once and finite memory and latency."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ember.core.rung_costs import RungCosts
from ember.errors import InvalidInput
from ember.keepalive.idle_plan import numeric_knobs
from ember.sim.greedy_dual import FaaSCache
from ember.sim.runner import SIM_POLICIES, build_policies, run_one
from ember.sim.traces import AppTrace, Trace

FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])
COSTS = RungCosts()


def _trace() -> Trace:
    """Two hours of three applications: a bursty one (sub-second gaps, then minutes), one called every ~40 s and a
    rare one, each arrival alone, on two runtimes (so the zygote is shared)."""
    rng = np.random.default_rng(7)
    bursts = np.sort(np.concatenate([t + np.cumsum(rng.exponential(0.3, 6)) for t in rng.uniform(0, 7000, 25)]))
    steady = np.cumsum(rng.exponential(40.0, 170))
    rare = np.sort(rng.uniform(0, 7200, 6))
    apps = []
    for i, starts in enumerate((bursts, steady[steady < 7200], rare)):
        n = len(starts)
        apps.append(AppTrace(f"app{i}", starts, np.ones(n, dtype=np.int64), np.zeros(n), np.full(n, 0.05),
                             runtime=f"rt{i % 2}"))
    return Trace("fuzz", "azure2021", 7200.0, apps)


TRACE = _trace()
_NASTY = [math.nan, math.inf, -math.inf, 0.0, -1.0, 1e-300, 0.5, 1.0, 2.0, 2.5, 3.0, 30.0, 1e6, 1e15, 1e16, 1e300]


@st.composite
def _knobs(draw: st.DrawFn) -> tuple[str, dict[str, float]]:
    name = draw(st.sampled_from(sorted(SIM_POLICIES)))
    cls = SIM_POLICIES[name]
    known = sorted(numeric_knobs(cls))
    others = draw(st.sampled_from([[], [], [], ["costs"], ["rungs"], ["spec"], ["nope"]]))
    keys = draw(st.lists(st.sampled_from([*known, *others]), max_size=3, unique=True))
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    knobs = {}
    for key in keys:
        default = defaults.get(key)
        scaled = (st.sampled_from([0.1, 0.5, 1.0, 2.0, 10.0]).map(lambda k, d=float(default): d * k)
                  if isinstance(default, int | float) else st.nothing())
        knobs[key] = draw(st.one_of(scaled, scaled, scaled, st.sampled_from(_NASTY), st.floats()))
    return name, knobs


@FUZZ
@given(case=_knobs())
def test_any_knob_is_refused_clearly_or_simulates(case: tuple[str, dict[str, float]]) -> None:
    name, knobs = case
    try:
        (policy,) = build_policies([name], {name: knobs}, COSTS, zygote_share=2.0)
    except InvalidInput as err:
        # "POLICY: 'name' is not a knob (...)", naming one given, or "POLICY: knob ...", naming one of the policy's
        # (a range may be another's: tail_pct's starts at head_pct).
        text = str(err)
        named = re.match(rf"{re.escape(name)}: '?([a-z_]*)'? ", text)
        assert named, text
        assert named[1] in knobs if " is not a knob " in text else named[1] in numeric_knobs(SIM_POLICIES[name]), text
        event("refused")
        return
    event("built")
    for value in policy.sweep():                  # every point the run will take was checked with the knobs
        policy.with_knob(value)
    if not isinstance(policy, FaaSCache):
        plan = policy.plan(policy.new_history())
        assert plan.steps[0][0] == 0.0
    result = run_one(TRACE, policy, COSTS, runtimes=2)
    assert result.invocations == TRACE.invocations == int(result.starts.sum())
    assert np.isfinite(result.total_idle_mb_s) and result.total_idle_mb_s >= 0
    assert np.isfinite(result.latency_mean(COSTS))


def test_knobs_that_cannot_be_taken_are_refused_naming_them() -> None:
    for name, knobs, message in (
            ("ladder", {"costs": 1.0}, "ladder: 'costs' is not a knob (knobs: bin_s, climb_lead, cold_per_app,"),
            ("ladder", {"marginal_zygote": 2.0}, "ladder: marginal_zygote is 0 or 1, got 2.0"),
            ("hybrid", {"min_samples": 2.5}, "hybrid: min_samples must be a whole number, got 2.5"),
            ("fixed", {"keep_alive_s": math.nan}, "fixed: keep_alive_s must lie in [0, inf], got nan"),
            ("ladder", {"bin_s": 1.0}, "ladder: range_s must lie in [1, 1440], got 14400.0"),
            ("faascache", {"spec": 1.0}, "faascache: 'spec' is not a knob (knobs: budget_gb)"),
            # valid alone, but not for every point of the sweep: refused before the first run, not at that point
            ("hybrid", {"bin_s": 0.2},
             "hybrid: range_s must lie in [0.2, 17280], got 21600.0 (its sweep's range_s 21600, with these knobs)")):
        try:
            build_policies([name], {name: knobs}, COSTS, zygote_share=1.0)
        except InvalidInput as err:
            assert str(err).startswith(message), err
        else:
            raise AssertionError(f"{name} {knobs} was built")
    try:     # a knob of a policy not run is checked too: a typo there is still a typo
        build_policies(["fixed"], {"hybrid": {"warp": 2.0}}, COSTS, zygote_share=1.0)
    except InvalidInput as err:
        assert str(err).startswith("hybrid: 'warp' is not a knob"), err
    else:
        raise AssertionError("hybrid.warp was taken")

