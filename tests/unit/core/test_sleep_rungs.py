"""The sleep rungs in the pure core: an instance whose engine can sleep gives its slice's memory back while asleep,
another instance may start there meanwhile, and a request wakes it only where nothing awake holds the slice."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.core.lifecycle import Pause, Recycle, Sleep, decide
from ember.core.pool import ModelInfo, Pool, PoolError
from ember.core.scheduler import Evict, Resume, Start, Wake, place, startable_slices
from ember.core.slices import Slice
from ember.core.states import InstanceState, Rung


def info(key: str = "m:1", **kw: object) -> ModelInfo:
    base: dict[str, object] = dict(key=key, slice_kind="gpu", memory_mb=40_000, min_scale=0, max_scale=2,
                                   target_concurrency=1.0, pause_after_s=2.0, max_idle_s=300.0, has_template=False,
                                   sleep_after_s=30.0, sleep_level=1)
    base.update(kw)
    return ModelInfo(**base)  # type: ignore[arg-type]


def gpu_pool(*models: ModelInfo, slices: int = 1, memory_mb: int = 80_000) -> Pool:
    gpus = tuple(Slice(id=f"gpu{i}", kind="gpu", memory_mb=memory_mb) for i in range(slices))
    return Pool(slices=gpus, models={m.key: m for m in models})


def idle(p: Pool, iid: str, model: str, slice_id: str, now: float = 0.0, levels: tuple[int, ...] = (1, 2)) -> None:
    p.add_starting(iid, model, slice_id, Rung.ZYGOTE, now)
    p.rename(iid, iid, 100, levels)
    p.transition(iid, InstanceState.IDLE, now)


def asleep(p: Pool, iid: str, model: str, slice_id: str, held_mb: float, now: float = 0.0) -> None:
    idle(p, iid, model, slice_id, now)
    p.transition(iid, InstanceState.ASLEEP, now)
    p.slept(iid, held_mb)


def test_an_idle_instance_that_can_sleep_sleeps_at_sleep_after_s_and_is_still_recycled_at_max_idle_s() -> None:
    p = gpu_pool(info())
    idle(p, "a", "m:1", "gpu0")
    assert decide(p.snapshot(), 10.0) == [Pause("a")]
    assert decide(p.snapshot(), 30.0) == [Sleep("a", 1)]
    p.transition("a", InstanceState.PAUSED, 10.0)
    assert decide(p.snapshot(), 31.0) == [Sleep("a", 1)]   # paused first: it sleeps all the same
    p.transition("a", InstanceState.ASLEEP, 31.0)
    assert decide(p.snapshot(), 100.0) == []               # asleep: nothing more until its keep-alive
    assert p.get("a").idle_for(100.0) == 100.0              # the idle clock kept running since its last request
    [recycle] = decide(p.snapshot(), 300.0)
    assert isinstance(recycle, Recycle) and recycle.instance_id == "a"


def test_an_engine_that_cannot_sleep_at_the_level_is_paused_instead() -> None:
    p = gpu_pool(info(sleep_level=2))
    idle(p, "a", "m:1", "gpu0", levels=(1,))
    assert decide(p.snapshot(), 60.0) == [Pause("a")]
    p2 = gpu_pool(info(sleep_after_s=None))
    idle(p2, "a", "m:1", "gpu0")
    assert decide(p2.snapshot(), 60.0) == [Pause("a")]


def test_going_to_sleep_holds_the_whole_model_until_the_engine_says_what_it_kept() -> None:
    p = gpu_pool(info(min_scale=1), info("other:1", memory_mb=60_000))   # min scale 1: not evicted
    idle(p, "a", "m:1", "gpu0")
    p.transition("a", InstanceState.ASLEEP, 5.0)
    assert p.snapshot().free_slices()[0].memory_mb == 40_000    # 80 GB less all of m:1's 40 GB
    assert place("other:1", p.snapshot()).__class__.__name__ == "NoCapacity"
    p.slept("a", 1_500.0)
    [free] = p.snapshot().free_slices()
    assert free.memory_mb == 78_500
    assert place("other:1", p.snapshot()) == Start(Rung.ZYGOTE, "gpu0")


def test_another_model_starts_on_an_asleep_instances_slice_and_then_it_cannot_wake() -> None:
    p = gpu_pool(info(), info("other:1"))
    asleep(p, "a", "m:1", "gpu0", 1_000.0)
    assert place("m:1", p.snapshot()) == Wake("a", Rung.SLEEP_1)
    p.add_starting("b", "other:1", "gpu0", Rung.ZYGOTE, 1.0)
    with pytest.raises(PoolError):
        p.add_starting("c", "other:1", "gpu0", Rung.ZYGOTE, 1.0)    # one awake instance per slice
    with pytest.raises(PoolError):
        p.acquire("a", 2.0)                                          # cannot wake while b holds the slice
    # m:1 cannot wake: with no other slice and nothing to evict, it must wait for b.
    assert not isinstance(place("m:1", p.snapshot()), Wake)
    p.transition("b", InstanceState.IDLE, 2.0)
    p.transition("b", InstanceState.ASLEEP, 3.0)
    p.slept("b", 1_000.0)
    assert place("m:1", p.snapshot()) == Wake("a", Rung.SLEEP_1)
    p.acquire("a", 4.0)
    assert p.get("a").state is InstanceState.BUSY and p.get("a").held_mb == 0.0


def test_the_lightest_sleep_wakes_first_and_paused_beats_asleep() -> None:
    p = gpu_pool(info(max_scale=3), slices=3)
    asleep(p, "deep", "m:1", "gpu0", 500.0, now=10.0)
    p._instances["deep"] = replace(p._require("deep"), asleep_level=2)
    asleep(p, "light", "m:1", "gpu1", 500.0, now=0.0)
    assert place("m:1", p.snapshot()) == Wake("light", Rung.SLEEP_1)
    idle(p, "paused", "m:1", "gpu2")
    p.transition("paused", InstanceState.PAUSED, 1.0)
    assert place("m:1", p.snapshot()) == Resume("paused")


def test_an_asleep_instance_of_another_model_is_evicted_before_a_paused_one() -> None:
    p = gpu_pool(info(memory_mb=70_000), info("x:1"), info("y:1"), slices=2)
    asleep(p, "x", "x:1", "gpu0", 20_000.0)      # leaves 60 GB: too little to start beside it
    idle(p, "y", "y:1", "gpu1")
    p.transition("y", InstanceState.PAUSED, 1.0)
    assert place("m:1", p.snapshot()) == Evict("x", Rung.ZYGOTE, "gpu0")


def test_a_victim_whose_slice_other_sleepers_fill_is_not_taken() -> None:
    p = gpu_pool(info(memory_mb=70_000), info("x:1"), info("y:1"), slices=1)
    asleep(p, "x", "x:1", "gpu0", 20_000.0)
    asleep(p, "y", "y:1", "gpu0", 20_000.0)
    # Evicting either leaves the other's 20 GB: 60 GB, less than 70.
    assert place("m:1", p.snapshot()).__class__.__name__ == "NoCapacity"


def test_an_asleep_instance_is_recycled_beside_an_awake_one_and_holds_only_what_it_held_while_it_drains() -> None:
    p = gpu_pool(info(), info("other:1"))
    asleep(p, "a", "m:1", "gpu0", 1_000.0)
    idle(p, "b", "other:1", "gpu0")
    p.transition("a", InstanceState.DRAINING, 5.0)            # its keep-alive: recycled while b holds the slice
    assert p.snapshot().room_on("gpu0", without=("b",)) == 79_000
    p.stopped("a", 6.0)
    assert p.snapshot().room_on("gpu0", without=("b",)) == 80_000


def test_a_model_at_max_scale_whose_sleeper_is_blocked_evicts_the_blocker_then_wakes() -> None:
    p = gpu_pool(info(max_scale=1), info("other:1"))
    asleep(p, "a", "m:1", "gpu0", 1_000.0)
    idle(p, "b", "other:1", "gpu0")
    assert place("m:1", p.snapshot()) == Evict("b", Rung.SLEEP_1, "gpu0")
    p.transition("b", InstanceState.DRAINING, 1.0)
    p.stopped("b", 2.0)
    assert place("m:1", p.snapshot()) == Wake("a", Rung.SLEEP_1)


def test_the_cluster_is_offered_each_slice_once_with_the_room_it_has() -> None:
    p = gpu_pool(info(), info("other:1"), slices=2)
    asleep(p, "a", "m:1", "gpu0", 1_500.0)                   # gpu0: free beside a, or whole once a is evicted
    idle(p, "b", "other:1", "gpu1")
    p.acquire("b", 1.0)                                        # gpu1: busy, not offered
    assert {s.id: s.memory_mb for s in startable_slices(p.snapshot())} == {"gpu0": 80_000}
    p2 = gpu_pool(info(), info("other:1"))
    asleep(p2, "a", "m:1", "gpu0", 1_500.0)
    idle(p2, "b", "other:1", "gpu0")
    p2.acquire("b", 1.0)                                       # an awake busy instance holds the slice whole
    assert startable_slices(p2.snapshot()) == []


ops = st.lists(st.tuples(st.sampled_from(["start", "idle", "sleep", "slept", "wake", "drain", "stop"]),
                         st.integers(0, 5), st.integers(0, 1), st.floats(0, 50_000)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_any_sequence_keeps_one_awake_instance_per_slice_and_its_memory_within_the_slice(seq: list) -> None:
    models = (info("a:1", memory_mb=30_000), info("b:1", memory_mb=50_000))
    p = gpu_pool(*models, slices=2)
    now = 0.0
    for op, n, m, held in seq:
        now += 1.0
        iid, model = f"i{n}", models[m].key
        try:
            if op == "start":
                snap = p.snapshot()
                decision = place(model, snap)
                if isinstance(decision, Start):
                    p.add_starting(iid, model, decision.slice_id, Rung.ZYGOTE, now)
                    p.rename(iid, iid, 1, (1, 2))
                elif isinstance(decision, Wake):
                    p.acquire(decision.instance_id, now)
            elif op == "idle":
                p.transition(iid, InstanceState.IDLE, now)
            elif op == "sleep":
                p.transition(iid, InstanceState.ASLEEP, now)
            elif op == "slept":
                p.slept(iid, held)
            elif op == "wake":
                if p.snapshot().can_wake(p._require(iid)):
                    p.acquire(iid, now)
            elif op == "drain":
                p.transition(iid, InstanceState.DRAINING, now)
            elif op == "stop":
                p.stopped(iid, now)
        except PoolError:
            pass
        snap = p.snapshot()
        for s in snap.slices:
            on = [i for i in snap.instances if i.slice_id == s.id]
            assert sum(1 for i in on if i.holds_slice) <= 1
            for i in on:
                assert i.state is not InstanceState.ASLEEP or i.asleep_level > 0
                assert i.asleep_level == 0 or i.state in (InstanceState.ASLEEP, InstanceState.DRAINING)
            used = sum(p.models[i.model].memory_mb if i.holds_slice else i.held_mb for i in on)
            assert used <= s.memory_mb
