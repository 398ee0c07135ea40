"""Dynamic batching decisions: what runs now, what waits, and the learned batch target."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.core.batching import BatchPolicy, DemandEstimate, Hold, Take, Waiting, next_batch

DELAY = 0.01


def policy(max_batch_size: int = 8, preferred: tuple[int, ...] = ()) -> BatchPolicy:
    return BatchPolicy(max_batch_size=max_batch_size, max_queue_delay_s=DELAY, preferred=preferred)


def queue(*rows: int, group: Hashable = "g", start: float = 0.0) -> list[Waiting]:
    """Requests 1, 2, ... of `rows` rows each, arriving 1 ms apart from `start`."""
    return [Waiting(id=i + 1, rows=r, arrived=start + i * 0.001, group=group) for i, r in enumerate(rows)]


# --- the basics -------------------------------------------------------------------------------


def test_an_empty_queue_has_nothing_to_run() -> None:
    assert next_batch([], 0.0, policy()) is None
    assert next_batch([], 5.0, policy(preferred=(4,)), target_rows=8) is None


def test_a_lone_request_runs_at_once_with_the_default_target() -> None:
    assert next_batch(queue(1), 0.0, policy()) == Take((1,), 1)


def test_everything_queued_of_one_group_runs_together_once_the_target_is_reached() -> None:
    q = queue(1, 2, 1)
    assert next_batch(q, 0.002, policy(), target_rows=4) == Take((1, 2, 3), 4)
    # Past the target the batch still takes all that fits: the target is when to stop waiting.
    assert next_batch(q, 0.002, policy(), target_rows=2) == Take((1, 2, 3), 4)


def test_it_holds_for_the_target_until_the_oldest_request_waited_the_delay() -> None:
    q = queue(1, 1, start=10.0)
    assert next_batch(q, 10.001, policy(), target_rows=4) == Hold(10.0 + DELAY)
    assert next_batch(q, 10.0 + DELAY / 2, policy(), target_rows=4) == Hold(10.0 + DELAY)
    assert next_batch(q, 10.0 + DELAY, policy(), target_rows=4) == Take((1, 2), 2)
    assert next_batch(q, 11.0, policy(), target_rows=4) == Take((1, 2), 2)


def test_the_target_is_capped_by_the_max_batch_size() -> None:
    # A target above the batch size must not make a full batch wait.
    assert next_batch(queue(2, 2), 0.001, policy(max_batch_size=4), target_rows=100) == Take((1, 2), 4)
    # Nor a batch that fills the max exactly with one request.
    assert next_batch(queue(4), 0.0, policy(max_batch_size=4), target_rows=100) == Take((1,), 4)


def test_a_full_batch_runs_at_once_and_leaves_the_rest_queued() -> None:
    # 3 + 3 fit in 8, the next 3 does not: the batch is full although only 6 rows.
    q = queue(3, 3, 3)
    assert next_batch(q, 0.002, policy(max_batch_size=8), target_rows=8) == Take((1, 2), 6)
    # FIFO: a later request that would fit does not jump over the one that does not.
    q = queue(3, 3, 3, 1)
    assert next_batch(q, 0.003, policy(max_batch_size=8), target_rows=8) == Take((1, 2), 6)


def test_preferred_sizes_run_at_once_and_others_wait() -> None:
    p = policy(max_batch_size=16, preferred=(4, 8))
    assert next_batch(queue(2, 2), 0.001, p) == Take((1, 2), 4)
    assert next_batch(queue(2, 1), 0.001, p) == Hold(DELAY)              # 3 is not preferred
    assert next_batch(queue(2, 1), DELAY, p) == Take((1, 2), 3)
    assert next_batch(queue(2, 2, 2), 0.002, p) == Hold(DELAY)           # 6 is not preferred either
    assert next_batch(queue(5, 5), 0.001, p) == Take((1, 2), 10)         # past the largest preferred
    # With preferred sizes the learned target does not matter.
    assert next_batch(queue(1), 0.0, p, target_rows=1) == Hold(DELAY)


# --- groups -------------------------------------------------------------------------------------


def test_only_the_heads_group_joins_in_arrival_order() -> None:
    q = [
        Waiting(1, 1, 0.000, "a"),
        Waiting(2, 1, 0.001, "b"),
        Waiting(3, 2, 0.002, "a"),
        Waiting(4, 1, 0.003, "b"),
        Waiting(5, 1, 0.004, "a"),
    ]
    assert next_batch(q, 0.004, policy(), target_rows=4) == Take((1, 3, 5), 4)
    # Waiting on the target counts only the head's group.
    assert next_batch(q, 0.004, policy(), target_rows=5) == Hold(DELAY)
    # Once the head has gone, the other group is served, again in order.
    rest = [w for w in q if w.group == "b"]
    assert next_batch(rest, 0.004, policy(), target_rows=2) == Take((2, 4), 2)


def test_a_request_bigger_than_the_max_batch_size_runs_alone() -> None:
    assert next_batch(queue(20, 1, 1), 0.002, policy(max_batch_size=16), target_rows=16) == Take((1,), 20)
    assert next_batch(queue(20), 0.0, policy(max_batch_size=16), target_rows=16) == Take((1,), 20)
    # Behind a small head, it does not join: the small one runs alone, at once.
    assert next_batch(queue(1, 20), 0.001, policy(max_batch_size=16), target_rows=16) == Take((1,), 1)


def test_max_batch_size_1_never_batches_or_waits() -> None:
    p = policy(max_batch_size=1)
    assert not p.batches
    assert next_batch(queue(1, 1, 1), 0.002, p, target_rows=8) == Take((1,), 1)
    assert next_batch(queue(3, 1), 0.001, p, target_rows=8) == Take((1,), 3)
    assert next_batch(queue(1, 1, group=None), 0.0, p) == Take((1,), 1)


# --- the learned target ---------------------------------------------------------------------------


def test_demand_starts_at_one_and_is_capped_by_the_batch_size() -> None:
    demand = DemandEstimate()
    assert demand.target(32) == 1
    for _ in range(50):
        demand.observe(100, 50)
    assert demand.target(16) == 16
    assert demand.target(1) == 1
    assert demand.target(1000) == 150


def test_demand_follows_a_drop_back_to_one() -> None:
    demand = DemandEstimate()
    for _ in range(30):
        demand.observe(8, 0)
    assert demand.target(32) == 8
    for _ in range(30):
        demand.observe(1, 0)
    assert demand.target(32) == 1


def simulate_closed_loop(clients: int, cycles: int, max_batch_size: int = 32) -> tuple[DemandEstimate, list[int]]:
    """An instance serving `clients` closed-loop clients, on a fake clock, the way InstanceServer does.

    Each client sends a request, waits for its answer and sends the next one a little later: the k-th
    client answered in a batch arrives k * 0.1 ms after the others (network jitter), so without a learned
    target a batch would start with the first one alone. A batch takes 1 ms plus 0.1 ms per row.
    Returns the demand estimate and the rows of every batch run.
    """
    p = BatchPolicy(max_batch_size=max_batch_size, max_queue_delay_s=0.002)
    demand = DemandEstimate()
    serial = 0
    arrivals: list[tuple[float, int]] = []       # (time, serial) of requests not yet in the queue

    def send(at: float) -> None:
        nonlocal serial
        serial += 1
        arrivals.append((at, serial))

    for c in range(clients):
        send(c * 0.0001)
    waiting: list[Waiting] = []
    now = 0.0
    batches: list[int] = []

    def admit() -> None:
        for at, sid in sorted(arrivals):
            if at <= now:
                waiting.append(Waiting(sid, 1, at))
                arrivals.remove((at, sid))

    while len(batches) < cycles:
        admit()
        if not waiting:
            now = min(at for at, _ in arrivals)
            continue
        decision = next_batch(waiting, now, p, demand.target(p.max_batch_size))
        if isinstance(decision, Hold):
            assert decision.until > now
            now = min([decision.until, *(at for at, _ in arrivals)])
            continue
        assert isinstance(decision, Take)
        waiting = [w for w in waiting if w.id not in decision.ids]
        now += 0.001 + 0.0001 * decision.rows
        batches.append(decision.rows)
        admit()
        demand.observe(decision.rows, sum(w.rows for w in waiting))
        for k, _ in enumerate(decision.ids):
            send(now + 0.00001 + k * 0.0001)   # each answered client sends its next request
    return demand, batches


def test_one_closed_loop_client_keeps_the_target_at_one_and_never_waits() -> None:
    demand, batches = simulate_closed_loop(clients=1, cycles=50)
    assert demand.target(32) == 1
    assert batches == [1] * 50


@pytest.mark.parametrize("clients", [2, 4, 8])
def test_the_target_converges_to_the_closed_loop_concurrency(clients: int) -> None:
    demand, batches = simulate_closed_loop(clients=clients, cycles=60)
    assert demand.target(32) == clients
    assert batches[-10:] == [clients] * 10     # every client in one batch, no split batches


def test_the_learned_target_is_capped_by_a_small_batch_size() -> None:
    demand, batches = simulate_closed_loop(clients=8, cycles=60, max_batch_size=4)
    assert demand.target(4) == 4
    assert max(batches) == 4


# --- a property over arbitrary queues -----------------------------------------------------------


@st.composite
def situations(draw: st.DrawFn) -> tuple[list[Waiting], float, BatchPolicy, int]:
    size = draw(st.integers(1, 12))
    rows = draw(st.lists(st.integers(1, 20), min_size=size, max_size=size))
    groups = draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=size, max_size=size))
    gaps = draw(st.lists(st.floats(0, 0.01), min_size=size, max_size=size))
    ids = draw(st.permutations(range(100, 100 + size)))
    arrived, q = 0.0, []
    for i in range(size):
        arrived += gaps[i]
        q.append(Waiting(ids[i], rows[i], arrived, groups[i]))
    max_batch = draw(st.integers(1, 16))
    preferred = tuple(sorted(set(draw(st.lists(st.integers(1, max_batch), max_size=3)))))
    p = BatchPolicy(max_batch, draw(st.floats(0, 0.02)), preferred)
    now = arrived + draw(st.floats(0, 0.05))
    return q, now, p, draw(st.integers(1, 32))


@settings(max_examples=400, deadline=None)
@given(situations())
def test_every_take_is_a_fifo_run_of_the_heads_group_within_the_batch_size(
        situation: tuple[list[Waiting], float, BatchPolicy, int]) -> None:
    q, now, p, target = situation
    decision = next_batch(q, now, p, target)
    head = q[0]
    if isinstance(decision, Hold):
        assert p.batches
        assert decision.until == head.arrived + p.max_queue_delay_s > now
        return
    assert isinstance(decision, Take)
    by_id = {w.id: w for w in q}
    taken = [by_id[i] for i in decision.ids]
    assert decision.ids[0] == head.id
    assert len(set(decision.ids)) == len(decision.ids)
    assert all(w.group == head.group for w in taken)
    positions = [q.index(w) for w in taken]
    assert positions == sorted(positions)                # arrival order
    assert decision.rows == sum(w.rows for w in taken)
    assert decision.rows <= p.max_batch_size or len(taken) == 1
    if not p.batches:
        assert decision.ids == (head.id,)
    # Nothing of the head's group that would have fitted was skipped before the last one taken.
    skipped = [w for w in q[: positions[-1]] if w.group == head.group and w not in taken]
    assert skipped == []
