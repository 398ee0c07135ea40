from __future__ import annotations

from dataclasses import replace

from ember.core.lifecycle import (
    KEEPS,
    FillWeights,
    MakeTemplate,
    MakeZygote,
    Pause,
    Prestart,
    Recycle,
    ReleaseTemplate,
    ReleaseWeights,
    ReleaseZygote,
    decide,
    zygote_holders,
)
from ember.core.pool import ModelInfo, Pool
from ember.core.rung_plan import IdlePlan
from ember.core.slices import cpu_slices
from ember.core.states import InstanceState, Rung
from ember.testing.clock import FakeClock


def make(min_scale: int = 0, slices: int = 2) -> tuple[Pool, FakeClock]:
    m = ModelInfo(key="m:1", slice_kind="cpu", memory_mb=512, min_scale=min_scale, max_scale=2,
                  target_concurrency=1, pause_after_s=2, max_idle_s=300, has_template=True)
    return Pool(slices=tuple(cpu_slices(slices, 1024)), models={m.key: m}), FakeClock()


def test_idle_instance_is_paused_then_recycled() -> None:
    p, clock = make()
    p.add_starting("a", "m:1", "cpu-0", Rung.TEMPLATE, clock.now())
    p.transition("a", InstanceState.IDLE, clock.now())
    assert decide(p.snapshot(), clock.advance(1.9)) == []
    assert decide(p.snapshot(), clock.advance(0.1)) == [Pause("a")]
    p.transition("a", InstanceState.PAUSED, clock.now())
    assert decide(p.snapshot(), clock.advance(297)) == []  # idle clock counts from the last request
    actions = decide(p.snapshot(), clock.advance(1))
    assert len(actions) == 1 and isinstance(actions[0], Recycle) and actions[0].instance_id == "a"


def test_busy_instances_are_left_alone() -> None:
    p, clock = make()
    p.add_starting("a", "m:1", "cpu-0", Rung.TEMPLATE, clock.now())
    p.acquire("a", clock.now())
    assert decide(p.snapshot(), clock.advance(1000)) == []


def test_min_scale_prestarts_and_is_never_recycled() -> None:
    p, clock = make(min_scale=1)
    assert decide(p.snapshot(), clock.now()) == [Prestart("m:1", Rung.TEMPLATE, "cpu-0")]
    p.add_starting("a", "m:1", "cpu-0", Rung.TEMPLATE, clock.now())
    p.transition("a", InstanceState.IDLE, clock.now())
    assert decide(p.snapshot(), clock.advance(10_000)) == [Pause("a")]


def test_autoscaler_desire_prestarts_up_to_free_slices_and_max_scale() -> None:
    p, clock = make(slices=3)
    actions = decide(p.snapshot(), clock.now(), desired={"m:1": 5})
    assert actions == [Prestart("m:1", Rung.TEMPLATE, "cpu-0"), Prestart("m:1", Rung.TEMPLATE, "cpu-1")]


def test_autoscaler_desire_does_not_hold_instances_past_max_idle() -> None:
    p, clock = make()
    p.add_starting("a", "m:1", "cpu-0", Rung.TEMPLATE, clock.now())
    p.transition("a", InstanceState.IDLE, clock.now())
    actions = decide(p.snapshot(), clock.advance(301), desired={"m:1": 0})
    assert [type(a) for a in actions] == [Recycle]


def test_recycles_down_to_the_floor_oldest_first() -> None:
    p, clock = make(min_scale=1)
    p.add_starting("old", "m:1", "cpu-0", Rung.TEMPLATE, clock.now())
    p.transition("old", InstanceState.IDLE, clock.now())
    clock.advance(10)
    p.add_starting("new", "m:1", "cpu-1", Rung.TEMPLATE, clock.now())
    p.transition("new", InstanceState.IDLE, clock.now())
    actions = decide(p.snapshot(), clock.advance(400))
    assert next(a for a in actions if isinstance(a, Recycle)).instance_id == "old"
    assert Pause("new") in actions


# --- a plan's lower rungs carried out on the node (templates and zygotes) -------------------------

HOT_10_THEN_ZYGOTE_60_THEN_NOTHING = IdlePlan(((0.0, Rung.HOT), (10.0, Rung.ZYGOTE), (60.0, Rung.FETCH)))


def planned(*keys: str, runtime: str = "py", has_template: bool = True) -> Pool:
    models = {k: ModelInfo(key=k, slice_kind="cpu", memory_mb=512, min_scale=0, max_scale=2, target_concurrency=1,
                           pause_after_s=2, max_idle_s=300, has_template=has_template, runtime=runtime,
                           keep_template=True) for k in keys}
    return Pool(slices=tuple(cpu_slices(2, 1024)), models=models)


def rung_actions(p: Pool, idle: dict[str, float], plan: IdlePlan = HOT_10_THEN_ZYGOTE_60_THEN_NOTHING,
                 zygotes: frozenset[str] = frozenset({"py"})) -> list[object]:
    plans = {k: plan for k in p.models}
    kinds = ReleaseTemplate | MakeTemplate | ReleaseZygote | MakeZygote | ReleaseWeights | FillWeights
    return [a for a in decide(p.snapshot(), 0.0, plans=plans, model_idle_s=idle, zygotes=zygotes)
            if isinstance(a, kinds)]


def test_the_template_goes_when_the_plan_drops_below_it_and_once_the_instances_are_gone() -> None:
    p, clock = planned("m:1"), FakeClock()
    p.add_starting("a", "m:1", "cpu-0", Rung.TEMPLATE, clock.now())
    p.transition("a", InstanceState.IDLE, clock.now())
    assert rung_actions(p, {"m:1": 9.9}) == []
    assert rung_actions(p, {"m:1": 10.0}) == []           # its instance is recycled first: it would die with it
    p.transition("a", InstanceState.DRAINING, clock.now())
    assert rung_actions(p, {"m:1": 10.0}) == []           # ... and gone, not just on its way out
    p.stopped("a", clock.now())
    assert rung_actions(p, {"m:1": 10.0}) == [ReleaseTemplate("m:1")]


def test_nothing_kept_releases_the_zygote_only_when_no_model_of_its_runtime_wants_it() -> None:
    p = planned("a:1", "b:1", has_template=False)
    assert rung_actions(p, {"a:1": 61.0, "b:1": 30.0}) == []          # b is on the zygote rung
    assert rung_actions(p, {"a:1": 61.0, "b:1": 61.0}) == [ReleaseZygote("py")]
    # b never served: it wants what a deploy makes (its template, so the zygote too).
    assert rung_actions(p, {"a:1": 61.0}) == [MakeTemplate("b:1")]
    p.add_starting("x", "a:1", "cpu-0", Rung.ZYGOTE, 0.0)               # a request is starting one: a is hot
    assert rung_actions(p, {"a:1": 61.0, "b:1": 61.0}) == [MakeTemplate("a:1")]


def test_the_zygotes_holders_are_the_models_that_keep_it_up() -> None:
    p = planned("a:1", "b:1", "c:1", has_template=False)
    plans = {k: HOT_10_THEN_ZYGOTE_60_THEN_NOTHING for k in p.models}
    # a on the zygote rung, b on nothing, c never served (it keeps what a deploy makes).
    assert zygote_holders(p.snapshot(), plans, {"a:1": 30.0, "b:1": 61.0}) == {"a:1", "c:1"}
    p.add_starting("x", "b:1", "cpu-0", Rung.ZYGOTE, 0.0)              # an instance holds it whatever the plan
    assert zygote_holders(p.snapshot(), plans, {"a:1": 61.0, "b:1": 61.0, "c:1": 61.0}) == {"b:1"}
    p.transition("x", InstanceState.IDLE, 0.0)
    p.transition("x", InstanceState.DRAINING, 0.0)                      # ... until it is gone
    assert zygote_holders(p.snapshot(), plans, {"a:1": 61.0, "b:1": 61.0, "c:1": 61.0}) == {"b:1"}
    p.stopped("x", 0.0)
    assert zygote_holders(p.snapshot(), plans, {"a:1": 61.0, "b:1": 61.0, "c:1": 61.0}) == frozenset()
    assert rung_actions(p, {"a:1": 61.0, "b:1": 61.0, "c:1": 61.0}) == [ReleaseZygote("py")]   # the same rule


def test_a_plan_that_climbs_back_makes_the_rungs_again() -> None:
    prewarm = IdlePlan(((0.0, Rung.FETCH), (30.0, Rung.ZYGOTE), (50.0, Rung.TEMPLATE), (70.0, Rung.HOT)))
    p = planned("m:1", has_template=False)
    assert rung_actions(p, {"m:1": 10.0}, prewarm, frozenset()) == []
    assert rung_actions(p, {"m:1": 30.0}, prewarm, frozenset()) == [MakeZygote("py")]
    assert rung_actions(p, {"m:1": 50.0}, prewarm, frozenset({"py"})) == [MakeTemplate("m:1")]
    # Both missing: making the template brings the zygote up on the way.
    assert rung_actions(p, {"m:1": 50.0}, prewarm, frozenset()) == [MakeTemplate("m:1")]


def test_the_transition_table_walks_the_ladder_down_with_the_clock() -> None:
    p, clock = planned("m:1"), FakeClock()
    zygotes, done = {"py"}, clock.now()   # the model's last request ended now
    seen = []
    for _ in range(80):
        for a in rung_actions(p, {"m:1": clock.now() - done}, zygotes=frozenset(zygotes)):
            seen.append((clock.now() - done, a))
            if isinstance(a, ReleaseTemplate):
                p.models["m:1"] = replace(p.models["m:1"], has_template=False)
            elif isinstance(a, ReleaseZygote):
                zygotes.discard(a.runtime)
        clock.advance(1.0)
    assert seen == [(10.0, ReleaseTemplate("m:1")), (60.0, ReleaseZygote("py"))]
    assert KEEPS[Rung.TEMPLATE] == (True, True, True) and KEEPS[Rung.ZYGOTE] == (False, True, True)


def backed(p: Pool, *keys: str, released: bool = False) -> Pool:
    for key in keys:
        p.models[key] = replace(p.models[key], store_backed=True, weights_released=released)
    return p


def weight_actions(p: Pool, idle: dict[str, float], plan: IdlePlan = HOT_10_THEN_ZYGOTE_60_THEN_NOTHING,
                   ) -> list[object]:
    return [a for a in rung_actions(p, idle, plan) if isinstance(a, ReleaseWeights | FillWeights)]


def test_nothing_kept_releases_a_store_backed_models_memory_copy_once_no_instance_maps_it() -> None:
    p, clock = backed(planned("m:1", has_template=False), "m:1"), FakeClock()
    assert weight_actions(p, {"m:1": 59.0}) == []                  # the zygote rung keeps the weights
    p.add_starting("a", "m:1", "cpu-0", Rung.ZYGOTE, clock.now())
    p.transition("a", InstanceState.IDLE, clock.now())
    p.transition("a", InstanceState.DRAINING, clock.now())
    assert weight_actions(p, {"m:1": 61.0}) == []                  # an instance on its way out still maps them
    p.stopped("a", clock.now())
    assert weight_actions(p, {"m:1": 61.0}) == [ReleaseWeights("m:1")]
    assert weight_actions(p, {}) == []                             # never served: it keeps what a deploy made


def test_the_chunks_of_the_store_backed_models_that_keep_their_weights_stay() -> None:
    p = backed(planned("a:1", "b:1", "c:1", "d:1", has_template=False), "a:1", "b:1", "c:1")
    p.add_starting("x", "c:1", "cpu-0", Rung.ZYGOTE, 0.0)           # c has an instance: it keeps them
    # b on the zygote rung keeps its weights; d is not store-backed (nothing of it in the tier).
    assert weight_actions(p, {"a:1": 61.0, "b:1": 30.0, "c:1": 61.0, "d:1": 61.0}) == [
        ReleaseWeights("a:1", frozenset({"b:1", "c:1"}))]
    assert weight_actions(p, {k: 61.0 for k in p.models}) == [ReleaseWeights("a:1", frozenset({"c:1"})),
                                                               ReleaseWeights("b:1", frozenset({"c:1"}))]


def test_a_plan_that_climbs_back_above_nothing_fills_the_memory_tier_again() -> None:
    prewarm = IdlePlan(((0.0, Rung.FETCH), (30.0, Rung.ZYGOTE), (70.0, Rung.HOT)))
    p = backed(planned("m:1", has_template=False), "m:1", released=True)
    assert weight_actions(p, {"m:1": 10.0}, prewarm) == []          # released, and still planned to be
    assert weight_actions(p, {"m:1": 30.0}, prewarm) == [FillWeights("m:1")]
    p.add_starting("x", "m:1", "cpu-0", Rung.ZYGOTE, 0.0)           # a request starts one: it wants them
    assert weight_actions(p, {"m:1": 10.0}, prewarm) == [FillWeights("m:1")]
    assert weight_actions(backed(planned("n:1"), "n:1", released=False), {"n:1": 30.0}, prewarm) == []


def test_weights_not_in_the_store_are_never_released() -> None:
    p = planned("m:1", has_template=False)
    assert weight_actions(p, {"m:1": 61.0}) == []


def test_a_busy_model_keeps_its_rungs_whatever_its_idle_clock_says() -> None:
    p = planned("m:1")
    p.add_starting("a", "m:1", "cpu-0", Rung.TEMPLATE, 0.0)
    p.acquire("a", 0.0)
    assert rung_actions(p, {"m:1": 1000.0}) == []


def test_without_zygotes_no_rung_is_touched() -> None:
    p = planned("m:1")
    plans = {"m:1": HOT_10_THEN_ZYGOTE_60_THEN_NOTHING}
    assert decide(p.snapshot(), 0.0, plans=plans, model_idle_s={"m:1": 100.0}) == []


def _idle(p: Pool, clock: FakeClock, *ids: str) -> None:
    for n, iid in enumerate(ids):
        p.add_starting(iid, "m:1", f"cpu-{n}", Rung.TEMPLATE, clock.now())
        p.transition(iid, InstanceState.IDLE, clock.advance(1))


def test_idle_instances_beyond_the_autoscalers_desire_go_least_recently_used_first() -> None:
    p, clock = make(slices=3)
    _idle(p, clock, "a", "b", "c")          # a idle longest, c most recently used
    actions = decide(p.snapshot(), clock.now(), scale={"m:1": 1})
    assert [a.instance_id for a in actions if isinstance(a, Recycle)] == ["a", "b"]
    assert all(a.reason == "autoscaler wants 1" for a in actions if isinstance(a, Recycle))


def test_the_autoscaler_never_takes_the_last_instance_the_plan_does() -> None:
    p, clock = make(slices=3)
    _idle(p, clock, "a", "b")
    assert [a.instance_id for a in decide(p.snapshot(), clock.now(), scale={"m:1": 0})
            if isinstance(a, Recycle)] == ["a"]
    plan = IdlePlan(((0.0, Rung.HOT), (5.0, Rung.FETCH)))
    p.transition("a", InstanceState.DRAINING, clock.now())
    assert decide(p.snapshot(), clock.advance(1), plans={"m:1": plan}, scale={"m:1": 0}) == []
    actions = decide(p.snapshot(), clock.advance(4), plans={"m:1": plan}, scale={"m:1": 0})
    assert [a.instance_id for a in actions if isinstance(a, Recycle)] == ["b"]


def test_busy_instances_and_min_scale_hold_against_the_autoscaler() -> None:
    p, clock = make(min_scale=2, slices=3)
    _idle(p, clock, "a", "b", "c")
    p.acquire("a", clock.now())             # busy: never recycled, but counts
    actions = decide(p.snapshot(), clock.now(), scale={"m:1": 0})
    assert [a.instance_id for a in actions if isinstance(a, Recycle)] == ["b"]
