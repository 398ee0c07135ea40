from __future__ import annotations

from ember.core.lifecycle import Pause, Prestart, Recycle, decide
from ember.core.pool import ModelInfo, Pool
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
