from __future__ import annotations

import pytest

from ember.core.pool import ModelInfo, Pool, PoolError
from ember.core.scheduler import Evict, NoCapacity, Resume, Route, Start, Wait, place, startable_slices
from ember.core.slices import Slice, cpu_slices
from ember.core.states import InstanceState, Rung
from ember.testing.clock import FakeClock


def info(key: str = "m:1", **kw: object) -> ModelInfo:
    base: dict[str, object] = dict(key=key, slice_kind="cpu", memory_mb=512, min_scale=0, max_scale=2,
                                   target_concurrency=1.0, pause_after_s=2.0, max_idle_s=300.0, has_template=True)
    base.update(kw)
    return ModelInfo(**base)  # type: ignore[arg-type]


def pool(*models: ModelInfo, slices: int = 2) -> Pool:
    return Pool(slices=tuple(cpu_slices(slices, 1024)), models={m.key: m for m in models})


def ready(p: Pool, iid: str, model: str, slice_id: str, now: float) -> None:
    p.add_starting(iid, model, slice_id, Rung.TEMPLATE, now)
    p.transition(iid, InstanceState.IDLE, now)


def test_empty_pool_forks_the_template() -> None:
    assert place("m:1", pool(info()).snapshot()) == Start(Rung.TEMPLATE, "cpu-0")


def test_without_template_it_forks_the_zygote() -> None:
    assert place("m:1", pool(info(has_template=False)).snapshot()) == Start(Rung.ZYGOTE, "cpu-0")


def test_weights_missing_from_the_node_take_the_fetch_rung_unless_a_template_holds_them() -> None:
    assert place("m:1", pool(info(has_template=False, weights_local=False)).snapshot()) == Start(Rung.FETCH, "cpu-0")
    assert place("m:1", pool(info(weights_local=False)).snapshot()) == Start(Rung.TEMPLATE, "cpu-0")


def test_a_request_waits_for_a_slice_being_drained_instead_of_queueing() -> None:
    clock = FakeClock()
    p = pool(info(), info("other:1"), slices=1)
    ready(p, "a", "other:1", "cpu-0", clock.now())
    p.transition("a", InstanceState.DRAINING, clock.now())
    assert isinstance(place("m:1", p.snapshot()), Wait)


def test_hot_beats_paused_beats_fork() -> None:
    clock = FakeClock()
    p = pool(info())
    ready(p, "a", "m:1", "cpu-0", clock.now())
    p.transition("a", InstanceState.PAUSED, clock.now())
    assert place("m:1", p.snapshot()) == Resume("a")
    ready(p, "b", "m:1", "cpu-1", clock.now())
    assert place("m:1", p.snapshot()) == Route("b")


def test_busy_instances_at_max_scale_make_the_request_wait() -> None:
    clock = FakeClock()
    p = pool(info(max_scale=1))
    ready(p, "a", "m:1", "cpu-0", clock.now())
    p.acquire("a", clock.now())
    assert isinstance(place("m:1", p.snapshot()), Wait)


def test_target_concurrency_lets_an_instance_take_more() -> None:
    clock = FakeClock()
    p = pool(info(target_concurrency=2))
    ready(p, "a", "m:1", "cpu-0", clock.now())
    p.acquire("a", clock.now())
    assert place("m:1", p.snapshot()) == Route("a")
    p.acquire("a", clock.now())
    assert place("m:1", p.snapshot()) == Start(Rung.TEMPLATE, "cpu-1")


def test_an_idle_instance_of_another_model_is_evicted_paused_first() -> None:
    clock = FakeClock()
    p = pool(info("a:1"), info("b:1"))
    ready(p, "x", "a:1", "cpu-0", clock.now())
    clock.advance(5)
    ready(p, "y", "a:1", "cpu-1", clock.now())
    p.transition("y", InstanceState.PAUSED, clock.now())
    assert place("b:1", p.snapshot()) == Evict("y", Rung.TEMPLATE, "cpu-1")


def test_min_scale_protects_from_eviction_and_busy_slices_mean_no_capacity() -> None:
    clock = FakeClock()
    p = pool(info("a:1", min_scale=1), info("b:1"), slices=1)
    ready(p, "x", "a:1", "cpu-0", clock.now())
    decision = place("b:1", p.snapshot())
    assert isinstance(decision, NoCapacity) and "b:1" in decision.reason


def test_model_larger_than_every_slice_has_no_capacity() -> None:
    p = Pool(slices=(Slice("cpu-0", "cpu", 256),), models={"m:1": info(memory_mb=512)})
    assert isinstance(place("m:1", p.snapshot()), NoCapacity)


def test_best_fit_prefers_the_smallest_slice_that_holds_the_model() -> None:
    slices = (Slice("big", "mig-7g", 80_000), Slice("small", "mig-7g", 20_000))
    p = Pool(slices=slices, models={"m:1": info(slice_kind="mig-7g", memory_mb=10_000)})
    assert place("m:1", p.snapshot()) == Start(Rung.TEMPLATE, "small")


def test_pool_refuses_impossible_transitions_and_double_booking() -> None:
    p = pool(info())
    p.add_starting("a", "m:1", "cpu-0", Rung.ZYGOTE, 0.0)
    with pytest.raises(PoolError):
        p.add_starting("b", "m:1", "cpu-0", Rung.ZYGOTE, 0.0)
    with pytest.raises(PoolError):
        p.transition("a", InstanceState.PAUSED, 0.0)
    p.stopped("a", 1.0)
    assert p.stopped("a", 2.0) is not None  # idempotent
    assert place("m:1", p.snapshot()) == Start(Rung.TEMPLATE, "cpu-0")


def test_release_returns_to_idle_only_when_nothing_is_in_flight() -> None:
    p = Pool(slices=tuple(cpu_slices(1, 1024)), models={"m:1": info(target_concurrency=2)})
    ready(p, "a", "m:1", "cpu-0", 0.0)
    p.acquire("a", 1.0)
    p.acquire("a", 1.0)
    assert p.release("a", 2.0).state is InstanceState.BUSY
    released = p.release("a", 3.0)
    assert released.state is InstanceState.IDLE and released.since == 3.0 and released.served == 2


def test_requests_spread_to_paused_and_new_instances_before_packing_up_to_max_concurrency() -> None:
    clock = FakeClock()
    p = pool(info(max_concurrency=3, max_scale=3), slices=3)
    ready(p, "a", "m:1", "cpu-0", clock.now())
    ready(p, "b", "m:1", "cpu-1", clock.now())
    p.transition("b", InstanceState.PAUSED, clock.now())
    p.acquire("a", clock.now())
    assert place("m:1", p.snapshot()) == Resume("b")          # over a's target (1): a paused one first
    p.acquire("b", clock.now())
    assert place("m:1", p.snapshot()) == Start(Rung.TEMPLATE, "cpu-2")   # then a new one on a free slice
    p.add_starting("c", "m:1", "cpu-2", Rung.TEMPLATE, clock.now())
    assert place("m:1", p.snapshot()) in (Route("a"), Route("b"))   # then pack into the least loaded
    for _ in range(2):
        p.acquire("a", clock.now())
        p.acquire("b", clock.now())
    assert isinstance(place("m:1", p.snapshot()), Wait)      # 3 each: full, c still starting


def test_packing_into_an_own_instance_comes_before_evicting_another_models() -> None:
    clock = FakeClock()
    p = pool(info("a:1", max_concurrency=4), info("b:1"), slices=2)
    ready(p, "x", "a:1", "cpu-0", clock.now())
    ready(p, "y", "b:1", "cpu-1", clock.now())
    p.acquire("x", clock.now())
    assert place("a:1", p.snapshot()) == Route("x")


def test_startable_slices_are_the_free_ones_and_those_eviction_may_take() -> None:
    clock = FakeClock()
    p = pool(info("a:1", min_scale=1), info("b:1"), slices=4)
    ready(p, "a1", "a:1", "cpu-0", clock.now())          # a's longest idle, above its min scale of 1: evictable
    clock.advance(5)
    ready(p, "a2", "a:1", "cpu-1", clock.now())          # the min scale's one
    ready(p, "b1", "b:1", "cpu-2", clock.now())
    p.transition("b1", InstanceState.BUSY, clock.now())   # busy: not evictable
    assert sorted(s.id for s in startable_slices(p.snapshot())) == ["cpu-0", "cpu-3"]
    # What it offers is what `place` takes: with no free slice, a start of c evicts a1.
    p2 = pool(info("a:1", min_scale=1), info("c:1"), slices=2)
    ready(p2, "a1", "a:1", "cpu-0", clock.now())
    clock.advance(5)
    ready(p2, "a2", "a:1", "cpu-1", clock.now())
    assert [s.id for s in startable_slices(p2.snapshot())] == ["cpu-0"]
    assert place("c:1", p2.snapshot()) == Evict("a1", Rung.TEMPLATE, "cpu-0")
