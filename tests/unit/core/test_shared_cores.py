"""The node's shared cores (one shared CPU slice): many instances within its memory, admission bounding the ones that
work at once, eviction only for memory, dedicated slots for the contracts that ask for them."""

from __future__ import annotations

import pytest

from ember.core.lifecycle import Prestart, decide
from ember.core.pool import ModelInfo, Pool, PoolError
from ember.core.scheduler import Evict, NoCapacity, Resume, Route, Start, Wait, place, startable_slices
from ember.core.slices import Slice, cpu_slices, node_cpu_slices, shared_cpu_slice
from ember.core.states import InstanceState, Rung
from ember.testing.clock import FakeClock


def info(key: str, memory_mb: int = 512, **kw: object) -> ModelInfo:
    base: dict[str, object] = dict(key=key, slice_kind="cpu", memory_mb=memory_mb, min_scale=0, max_scale=2,
                                   target_concurrency=1.0, pause_after_s=2.0, max_idle_s=300.0, has_template=True)
    base.update(kw)
    return ModelInfo(**base)  # type: ignore[arg-type]


def shared_pool(*models: ModelInfo, memory_mb: int = 4096, running: int = 2, dedicated: int = 0) -> Pool:
    slots = [Slice(f"s{c}", "cpu", memory_mb // (running + dedicated), (c,)) for c in range(running + dedicated)]
    return Pool(slices=tuple(node_cpu_slices(slots, dedicated)), models={m.key: m for m in models})


def ready(p: Pool, iid: str, model: str, now: float, slice_id: str = "cpu") -> None:
    p.add_starting(iid, model, slice_id, Rung.TEMPLATE, now)
    p.transition(iid, InstanceState.IDLE, now)


def test_node_slices_make_one_shared_slice_of_the_slots_and_keep_the_dedicated_ones() -> None:
    slots = cpu_slices(4, 1000)
    assert node_cpu_slices(slots, 0) == [shared_cpu_slice((0, 1, 2, 3), 4000, 4)]
    shared, *own = node_cpu_slices(slots, 1)
    assert shared == shared_cpu_slice((0, 1, 2), 3000, 3)
    assert own == [Slice("cpu-0", "cpu", 1000, (3,))]
    every = node_cpu_slices(slots, 4)
    assert [s.cpus for s in every] == [(0,), (1,), (2,), (3,)] and not any(s.shared for s in every)
    assert node_cpu_slices([], 0) == []


def test_three_models_live_on_two_cores_without_evicting_each_other() -> None:
    clock = FakeClock()
    p = shared_pool(info("a:1"), info("b:1"), info("c:1"))
    for key, iid in (("a:1", "x"), ("b:1", "y")):
        assert place(key, p.snapshot()) == Start(Rung.TEMPLATE, "cpu")
        ready(p, iid, key, clock.now())
    assert place("c:1", p.snapshot()) == Start(Rung.TEMPLATE, "cpu")   # no eviction: memory allows a third
    ready(p, "z", "c:1", clock.now())
    for key, iid in (("a:1", "x"), ("b:1", "y"), ("c:1", "z")):      # each in turn finds its own hot instance
        assert place(key, p.snapshot()) == Route(iid)
        p.acquire(iid, clock.now())
        p.release(iid, clock.now())


def test_paused_instances_hold_their_memory_and_memory_bounds_the_instances() -> None:
    clock = FakeClock()
    p = shared_pool(info("a:1", 1500), info("b:1", 1500), info("c:1", 1500), memory_mb=4000)
    ready(p, "x", "a:1", clock.now())
    ready(p, "y", "b:1", clock.now())
    p.transition("x", InstanceState.PAUSED, clock.now())
    assert p.snapshot().room_on("cpu") == 1000
    with pytest.raises(PoolError, match="1000 MB beside its other instances"):
        p.add_starting("z", "c:1", "cpu", Rung.TEMPLATE, clock.now())
    assert place("c:1", p.snapshot()) == Evict("x", Rung.TEMPLATE, "cpu")   # memory short: the paused one goes


def test_admission_bounds_the_instances_working_at_once_not_those_that_exist() -> None:
    clock = FakeClock()
    p = shared_pool(info("a:1"), info("b:1"), info("c:1"), running=2)
    for key, iid in (("a:1", "x"), ("b:1", "y"), ("c:1", "z")):
        ready(p, iid, key, clock.now())
    p.acquire("x", clock.now())
    p.acquire("y", clock.now())
    waiting = place("c:1", p.snapshot())   # its instance is hot, but two already work on two cores
    assert isinstance(waiting, Wait) and "2 instance(s) already work" in waiting.reason
    p.release("x", clock.now())
    assert place("c:1", p.snapshot()) == Route("z")


def test_a_working_instance_takes_more_of_its_own_requests_past_the_bound() -> None:
    clock = FakeClock()
    p = shared_pool(info("a:1", target_concurrency=4), info("b:1"), running=2)
    ready(p, "x", "a:1", clock.now())
    ready(p, "y", "b:1", clock.now())
    p.acquire("x", clock.now())
    p.acquire("y", clock.now())
    assert place("a:1", p.snapshot()) == Route("x")   # joins work that runs already (its batch)


def test_starting_counts_as_working_and_a_crowded_node_neither_starts_nor_resumes() -> None:
    clock = FakeClock()
    p = shared_pool(info("a:1"), info("b:1"), info("c:1"), running=1)
    p.add_starting("x", "a:1", "cpu", Rung.TEMPLATE, clock.now())
    ready(p, "y", "b:1", clock.now())
    p.transition("y", InstanceState.PAUSED, clock.now())
    assert isinstance(place("b:1", p.snapshot()), Wait)
    assert isinstance(place("c:1", p.snapshot()), Wait)
    assert p.snapshot().free_slices() == []
    assert startable_slices(p.snapshot()) == []            # the cluster is told this node cannot start one now
    p.transition("x", InstanceState.IDLE, clock.now())
    assert place("b:1", p.snapshot()) == Resume("y")
    assert place("c:1", p.snapshot()) == Start(Rung.TEMPLATE, "cpu")


def test_one_model_scales_out_on_shared_cores_up_to_the_bound() -> None:
    clock = FakeClock()
    p = shared_pool(info("a:1", max_scale=4), running=2)
    ready(p, "x", "a:1", clock.now())
    p.acquire("x", clock.now())
    assert place("a:1", p.snapshot()) == Start(Rung.TEMPLATE, "cpu")
    ready(p, "y", "a:1", clock.now())
    p.acquire("y", clock.now())
    assert isinstance(place("a:1", p.snapshot()), Wait)   # a third would only share the two cores


def test_eviction_frees_memory_one_instance_at_a_time_and_not_more_than_needed() -> None:
    clock = FakeClock()
    p = shared_pool(info("a:1", 1000), info("b:1", 1000), info("big:1", 2500), memory_mb=3000)
    ready(p, "x", "a:1", clock.now())
    clock.advance(1)
    ready(p, "y", "b:1", clock.now())
    assert place("big:1", p.snapshot()) == Evict("x", Rung.TEMPLATE, "cpu")   # the longest idle first
    p.transition("x", InstanceState.DRAINING, clock.now())
    assert place("big:1", p.snapshot()) == Evict("y", Rung.TEMPLATE, "cpu")   # one is not enough
    p.transition("y", InstanceState.DRAINING, clock.now())
    assert isinstance(place("big:1", p.snapshot()), Wait)                    # both draining free enough
    p.stopped("x", clock.now())
    p.stopped("y", clock.now())
    assert place("big:1", p.snapshot()) == Start(Rung.TEMPLATE, "cpu")


def test_no_eviction_when_what_drains_frees_enough() -> None:
    clock = FakeClock()
    p = shared_pool(info("a:1", 1000), info("b:1", 1000), info("c:1", 1000), memory_mb=2000)
    ready(p, "x", "a:1", clock.now())
    ready(p, "y", "b:1", clock.now())
    p.transition("x", InstanceState.DRAINING, clock.now())
    assert isinstance(place("c:1", p.snapshot()), Wait)


def test_a_model_bigger_than_the_node_gets_no_capacity() -> None:
    p = shared_pool(info("huge:1", 9000), memory_mb=4096)
    assert isinstance(place("huge:1", p.snapshot()), NoCapacity)


def test_dedicated_models_take_dedicated_slots_and_shared_ones_the_shared_cores() -> None:
    clock = FakeClock()
    p = shared_pool(info("a:1"), info("d:1", dedicated=True, max_scale=3), running=1, dedicated=2)
    assert place("a:1", p.snapshot()) == Start(Rung.TEMPLATE, "cpu")
    assert place("d:1", p.snapshot()) == Start(Rung.TEMPLATE, "cpu-0")
    ready(p, "x", "d:1", clock.now(), "cpu-0")
    p.acquire("x", clock.now())
    assert place("d:1", p.snapshot()) == Start(Rung.TEMPLATE, "cpu-1")
    ready(p, "y", "d:1", clock.now(), "cpu-1")
    p.acquire("y", clock.now())
    assert isinstance(place("d:1", p.snapshot()), Wait)   # never onto the shared cores
    ready(p, "z", "a:1", clock.now())
    with pytest.raises(PoolError, match="already in use"):
        p.add_starting("w", "a:1", "cpu-0", Rung.TEMPLATE, clock.now())
    snap = p.snapshot()
    assert [s.id for s in snap.slices_for("cpu", dedicated=True)] == ["cpu-0", "cpu-1"]
    assert [s.id for s in snap.slices_for("cpu")] == ["cpu"]


def test_every_slot_dedicated_puts_each_instance_on_one_as_before() -> None:
    p = Pool(slices=tuple(node_cpu_slices(cpu_slices(2, 1024), 2)), models={"a:1": info("a:1")})
    assert [s.id for s in p.snapshot().slices_for("cpu")] == ["cpu-0", "cpu-1"]
    assert place("a:1", p.snapshot()) == Start(Rung.TEMPLATE, "cpu-0")


def test_prestarts_respect_the_shared_slices_memory_and_bound() -> None:
    clock = FakeClock()
    p = shared_pool(info("a:1", min_scale=2), running=2)
    actions = decide(p.snapshot(), clock.now())
    assert [a for a in actions if isinstance(a, Prestart)] == [Prestart("a:1", Rung.TEMPLATE, "cpu")]
    p.add_starting("x", "a:1", "cpu", Rung.TEMPLATE, clock.now())
    p.add_starting("y", "b:1", "cpu", Rung.TEMPLATE, clock.now())   # two starting: both cores work
    assert not [a for a in decide(p.snapshot(), clock.now()) if isinstance(a, Prestart)]


def test_an_asleep_instance_waits_for_what_drains_to_free_room_and_no_second_instance_is_evicted_for_its_wake() -> None:
    """Two requests for an asleep model at once: the first evicts one idle instance for its wake; the second waits
    for that one to drain (it frees enough), as a start's would, not another model's instance evicted too."""
    clock = FakeClock()
    m, o1, o2 = info("m:1", 1024), info("o1:1", 768), info("o2:1", 768)
    p = shared_pool(m, o1, o2, memory_mb=2048)
    ready(p, "own", "m:1", clock.now())
    p.transition("own", InstanceState.ASLEEP, clock.now())
    p.slept("own", 0.0)
    ready(p, "a", "o1:1", clock.now())
    ready(p, "b", "o2:1", clock.now())
    first = place("m:1", p.snapshot())
    assert isinstance(first, Evict)
    p.transition(first.victim_id, InstanceState.DRAINING, clock.now())
    assert isinstance(place("m:1", p.snapshot()), Wait)
