from __future__ import annotations

from ember.core.node_queue import BEGIN_AHEAD, Queue, free_slots, place_queued, queues_at_node
from ember.core.pool import ModelInfo, Pool
from ember.core.scheduler import Placement, Resume, Route, Start, Wait, place
from ember.core.slices import cpu_slices, shared_cpu_slice
from ember.core.states import InstanceState, Rung
from ember.testing.clock import FakeClock


def llm(runtime: str = "llm", **kw: object) -> ModelInfo:
    """A model whose instances batch 4 sequences (its target) and hold up to 6 requests."""
    base: dict[str, object] = dict(key="m:1", slice_kind="cpu", memory_mb=512, min_scale=0, max_scale=2,
                                   target_concurrency=4.0, max_concurrency=6, pause_after_s=2.0, max_idle_s=300.0,
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


def decide(p: Pool, ahead: int = 0, **unbegun: int) -> Placement | Queue:
    return place_queued("m:1", p.snapshot(), ahead, unbegun)


def test_the_llm_runtimes_queue_at_the_node_and_the_others_do_not() -> None:
    assert queues_at_node(llm()) and queues_at_node(llm("vllm"))
    assert not queues_at_node(llm("python")) and not queues_at_node(llm("sentence-transformers"))


def test_an_instance_past_its_batch_is_not_packed_the_request_queues_at_the_node() -> None:
    clock = FakeClock()
    p = pool(llm(max_scale=1))
    ready(p, "a", "cpu-0", clock.now(), inflight=4)
    assert place("m:1", p.snapshot()) == Route("a")   # the ladder alone packs it up to max_concurrency
    assert isinstance(decide(p), Queue)


def test_a_model_that_does_not_queue_at_the_node_is_packed_as_before() -> None:
    clock = FakeClock()
    p = pool(llm("python", max_scale=1))
    ready(p, "a", "cpu-0", clock.now(), inflight=4)
    assert decide(p, ahead=3, a=4) == Route("a")


def test_an_instance_holding_requests_it_has_not_begun_takes_no_more_they_wait_at_the_node() -> None:
    clock = FakeClock()
    p = pool(llm(max_scale=1))
    ready(p, "a", "cpu-0", clock.now(), inflight=2)
    assert decide(p, a=BEGIN_AHEAD - 1) == Route("a")
    assert isinstance(decide(p, a=BEGIN_AHEAD), Queue)
    assert decide(p, a=0) == Route("a")   # both began (their first replies came): room in its batch again


def test_a_free_slot_goes_to_the_requests_queued_ahead_first() -> None:
    clock = FakeClock()
    p = pool(llm(max_scale=1))
    ready(p, "a", "cpu-0", clock.now(), inflight=3)   # one free slot in its batch
    assert free_slots(p.snapshot(), "m:1", {}) == 1
    assert decide(p, ahead=0) == Route("a")
    assert isinstance(decide(p, ahead=1), Queue)     # the one ahead takes it; this one keeps waiting


def test_the_request_goes_to_the_instance_that_can_begin_it_not_the_least_loaded() -> None:
    clock = FakeClock()
    p = pool(llm())
    ready(p, "a", "cpu-0", clock.now(), inflight=1)
    ready(p, "b", "cpu-1", clock.now(), inflight=3)
    assert decide(p) == Route("a")
    assert decide(p, a=BEGIN_AHEAD) == Route("b")   # a has its own prompts to feed; b fed all of its


def test_past_the_room_of_every_instance_it_is_what_the_ladder_says_of_a_full_model() -> None:
    clock = FakeClock()
    p = pool(llm(max_scale=1))
    ready(p, "a", "cpu-0", clock.now(), inflight=4)   # 2 more fit in it (max_concurrency 6)
    assert isinstance(decide(p, ahead=1), Queue)
    assert isinstance(decide(p, ahead=2), Wait)       # two queued already fill its room
    for _ in range(2):
        p.acquire("a", clock.now())
    assert isinstance(decide(p, ahead=0), Wait)


def test_a_starting_instance_has_room_a_request_queues_for_it() -> None:
    clock = FakeClock()
    p = pool(llm())
    ready(p, "a", "cpu-0", clock.now(), inflight=4)
    p.add_starting("b", "m:1", "cpu-1", Rung.TEMPLATE, clock.now())
    assert isinstance(decide(p, ahead=7), Queue)      # a's 2 and b's 6 hold the 7 ahead and this one
    assert isinstance(decide(p, ahead=8), Wait)


def test_new_capacity_comes_up_for_work_an_instance_cannot_begin_yet() -> None:
    clock = FakeClock()
    p = pool(llm())
    ready(p, "a", "cpu-0", clock.now(), inflight=2)
    assert place("m:1", p.snapshot()) == Route("a")   # under its target: the ladder alone sends it there
    assert decide(p, ahead=3, a=BEGIN_AHEAD) == Start(Rung.TEMPLATE, "cpu-1")
    ready(p, "b", "cpu-1", clock.now())
    p.transition("b", InstanceState.PAUSED, clock.now())
    assert decide(p, ahead=3, a=BEGIN_AHEAD) == Resume("b")


def test_a_burst_moves_to_whichever_instance_can_begin_the_next_request() -> None:
    """Two requests go to the warm instance a, the third starts b, the others wait at the node; each goes, in its
    order, to the first instance that began one of its requests, up to their batches (4); the rest wait for a
    stream to end."""
    clock = FakeClock()
    p = pool(llm())
    ready(p, "a", "cpu-0", clock.now())
    unbegun = {"a": 0, "b": 0}
    queue: list[int] = []
    served: dict[str, list[int]] = {"a": [], "b": []}

    def walk(request: int, ahead: int) -> Placement | Queue:
        decision = place_queued("m:1", p.snapshot(), ahead, unbegun)
        if isinstance(decision, Route):
            p.acquire(decision.instance_id, clock.now())
            served[decision.instance_id].append(request)
            unbegun[decision.instance_id] += 1
        return decision

    for request in range(10):
        decision = walk(request, len(queue))
        if isinstance(decision, Start):
            p.add_starting("b", "m:1", decision.slice_id, decision.rung, clock.now())
            served["b"].append(request)
            unbegun["b"] += 1
        elif isinstance(decision, Queue):
            queue.append(request)
    assert (served, queue) == ({"a": [0, 1], "b": [2]}, list(range(3, 10)))
    clock.advance(1.0)
    p.transition("b", InstanceState.IDLE, clock.now())   # up: the request that started it holds it
    p.acquire("b", clock.now())
    def began(instance: str) -> None:   # its first reply came: the queue walks the ladder again
        unbegun[instance] -= 1
        while queue and isinstance(walk(queue[0], 0), Route):
            queue.pop(0)

    for instance in ["b", "a", "a", "b"]:
        began(instance)
    assert (served, queue) == ({"a": [0, 1, 5, 6], "b": [2, 3, 4, 7]}, [8, 9])   # both batches full (4 each)
    for instance in ["a", "a", "b", "b"]:
        began(instance)
    assert queue == [8, 9]
    p.release("b", clock.now())   # a stream of b ended: its slot goes to the head of the queue
    assert walk(queue.pop(0), 0) == Route("b") and served["b"][-1] == 8
    assert isinstance(walk(queue[0], 0), Queue)


def test_an_idle_instance_the_shared_cores_cannot_run_now_gives_no_room_at_the_node() -> None:
    """Every shared core works for another model: the request waits for a core as any model's (queue_wait_s, then a
    job), not at the node until its deadline for an instance that may not begin it."""
    clock = FakeClock()
    other = llm("python", key="o:1")
    p = Pool(slices=(shared_cpu_slice((0,), 2048, max_running=1),), models={"m:1": llm(max_scale=1), "o:1": other})
    ready(p, "a", "cpu", clock.now())
    p.add_starting("o", "o:1", "cpu", Rung.TEMPLATE, clock.now())
    p.transition("o", InstanceState.IDLE, clock.now())
    p.acquire("o", clock.now())
    assert isinstance(decide(p), Wait)
