from __future__ import annotations

from ember.core.node_queue import Queue, free_slots, hold, queues_at_node
from ember.core.pool import ModelInfo, Pool
from ember.core.scheduler import Placement, Resume, Route, Start, Wait, place
from ember.core.slices import cpu_slices
from ember.core.states import InstanceState, Rung
from ember.testing.clock import FakeClock


def llm(runtime: str = "llm", **kw: object) -> ModelInfo:
    """A model whose instances batch 2 sequences (its target) and hold up to 4 requests."""
    base: dict[str, object] = dict(key="m:1", slice_kind="cpu", memory_mb=512, min_scale=0, max_scale=2,
                                   target_concurrency=2.0, max_concurrency=4, pause_after_s=2.0, max_idle_s=300.0,
                                   has_template=True, runtime=runtime)
    base.update(kw)
    return ModelInfo(**base)  # type: ignore[arg-type]


def pool(info: ModelInfo, slices: int = 2) -> Pool:
    return Pool(slices=tuple(cpu_slices(slices, 1024)), models={info.key: info})


def ready(p: Pool, iid: str, slice_id: str, now: float, inflight: int = 0) -> None:
    p.add_starting(iid, "m:1", slice_id, Rung.TEMPLATE, now)
    p.transition(iid, InstanceState.IDLE, now)
    for _ in range(inflight):
        p.acquire(iid, now)


def decide(p: Pool, ahead: int = 0) -> Placement | Queue:
    snapshot = p.snapshot()
    return hold(place("m:1", snapshot), "m:1", snapshot, ahead)


def test_the_llm_runtimes_queue_at_the_node_and_the_others_do_not() -> None:
    assert queues_at_node(llm()) and queues_at_node(llm("vllm"))
    assert not queues_at_node(llm("python")) and not queues_at_node(llm("sentence-transformers"))


def test_an_instance_past_its_batch_is_not_packed_the_request_queues_at_the_node() -> None:
    clock = FakeClock()
    p = pool(llm(max_scale=1))
    ready(p, "a", "cpu-0", clock.now(), inflight=2)
    assert place("m:1", p.snapshot()) == Route("a")   # the ladder alone packs it up to max_concurrency
    assert isinstance(decide(p), Queue)


def test_a_model_that_does_not_queue_at_the_node_is_packed_as_before() -> None:
    clock = FakeClock()
    p = pool(llm("python", max_scale=1))
    ready(p, "a", "cpu-0", clock.now(), inflight=2)
    assert decide(p, ahead=3) == Route("a")


def test_a_free_slot_goes_to_the_requests_queued_ahead_first() -> None:
    clock = FakeClock()
    p = pool(llm(max_scale=1))
    ready(p, "a", "cpu-0", clock.now(), inflight=1)   # one free slot
    assert free_slots(p.snapshot(), "m:1") == 1
    assert decide(p, ahead=0) == Route("a")
    assert isinstance(decide(p, ahead=1), Queue)     # the one ahead takes it; this one keeps waiting


def test_past_the_room_of_every_instance_it_waits_as_before() -> None:
    clock = FakeClock()
    p = pool(llm(max_scale=1))
    ready(p, "a", "cpu-0", clock.now(), inflight=2)   # 2 more fit in it (max_concurrency 4)
    assert isinstance(decide(p, ahead=1), Queue)
    assert isinstance(decide(p, ahead=2), Wait)       # two queued already fill its room
    for _ in range(2):
        p.acquire("a", clock.now())
    assert isinstance(decide(p, ahead=0), Wait)


def test_a_starting_instance_has_room_a_request_queues_for_it() -> None:
    clock = FakeClock()
    p = pool(llm())
    ready(p, "a", "cpu-0", clock.now(), inflight=2)
    p.add_starting("b", "m:1", "cpu-1", Rung.TEMPLATE, clock.now())
    assert isinstance(place("m:1", p.snapshot()), Route)   # packed into a
    assert isinstance(decide(p, ahead=5), Queue)           # a's 2 and b's 4 hold the 5 ahead and this one
    assert isinstance(decide(p, ahead=6), Wait)


def test_new_capacity_stands_whatever_waits_ahead() -> None:
    clock = FakeClock()
    p = pool(llm())
    ready(p, "a", "cpu-0", clock.now(), inflight=2)
    assert decide(p, ahead=3) == Start(Rung.TEMPLATE, "cpu-1")
    ready(p, "b", "cpu-1", clock.now())
    p.transition("b", InstanceState.PAUSED, clock.now())
    assert decide(p, ahead=3) == Resume("b")


def test_a_burst_is_split_between_the_instance_it_found_and_the_one_it_started() -> None:
    """Eight requests fill instance a's batch of 8, the ninth starts b, the other seven wait at the node and go to b
    once it is up, in their order: 8 and 8, where packing put 15 into a."""
    clock = FakeClock()
    p = pool(llm(target_concurrency=8.0, max_concurrency=16))
    ready(p, "a", "cpu-0", clock.now())
    queue: list[int] = []
    served: dict[str, list[int]] = {"a": [], "b": []}
    for request in range(16):
        decision = decide(p, ahead=len(queue))
        if isinstance(decision, Route):
            p.acquire(decision.instance_id, clock.now())
            served[decision.instance_id].append(request)
        elif isinstance(decision, Start):
            p.add_starting("b", "m:1", decision.slice_id, decision.rung, clock.now())
            served["b"].append(request)
        else:
            assert isinstance(decision, Queue), decision
            queue.append(request)
    assert (len(served["a"]), served["b"], len(queue)) == (8, [8], 7)
    clock.advance(1.0)
    p.transition("b", InstanceState.IDLE, clock.now())   # up: the starting request holds it
    p.acquire("b", clock.now())
    while queue:   # woken in their order, each walks the ladder again with those still ahead of it
        decision = decide(p, ahead=0)
        assert decision == Route("b")
        p.acquire("b", clock.now())
        served["b"].append(queue.pop(0))
    assert served["b"] == list(range(8, 16))
    assert p.get("a").inflight == p.get("b").inflight == 8  # type: ignore[union-attr]
