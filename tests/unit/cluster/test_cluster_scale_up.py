"""The controller asking for machines when every node is full (`ClusterState` with a `NodeScaler`)."""

from __future__ import annotations

from ember.cluster.state import ClusterState, ScaleSettings
from ember.core.placement import Placed, Unplaceable
from ember.testing.clock import FakeClock
from ember.testing.scaler import FakeScaler
from ember.wire.cluster import NodeInventory
from ember.wire.contract import ModelContract

CONTRACT = ModelContract.model_validate({
    "name": "m", "version": "1", "runtime": "python", "entrypoint": "x:Y",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    "resources": {"slice": "cpu", "memory_mb": 100}})


def inv(node: str, free: int) -> NodeInventory:
    return NodeInventory(node=node, url=f"http://{node}:8000", memory_mb=1000, free_memory_mb=1000,
                         slices={"cpu": 1}, free_slices={"cpu": free}, disk_bps=1e9, net_bps=1e9,
                         contracts=(CONTRACT,))


def cluster(scaler: FakeScaler, *frees: int) -> tuple[ClusterState, FakeClock]:
    clock = FakeClock()
    state = ClusterState(clock, ttl_s=3.0, token="t", scaler=scaler, scale=ScaleSettings(hold_s=60, max_nodes=8))
    clock.advance(3.0)
    for i, free in enumerate(frees):
        state.report(inv(f"n{i}", free))
    return state, clock


def test_every_node_full_asks_for_one_more_node_once_and_withdraws_when_placed_again() -> None:
    scaler = FakeScaler()
    state, clock = cluster(scaler, 0, 0)
    for _ in range(3):                                   # three requests find no room: one ask, for 3 nodes
        placement = state.place("m:1")
        assert isinstance(placement, Unplaceable) and placement.for_room
    assert scaler.asks == [3] and state.asked.models == ("m:1",)
    clock.advance(1.0)
    state.report(inv("n2", 1))                           # the new node joined
    assert isinstance(state.place("m:1"), Placed)
    assert scaler.asks == [3, 0]                         # placed: the request withdrawn


def test_a_wait_past_hold_s_withdraws_the_request_at_the_next_report() -> None:
    scaler = FakeScaler()
    state, clock = cluster(scaler, 0)
    state.place("m:1")
    clock.advance(61.0)
    state.report(inv("n0", 0))
    assert scaler.asks == [2, 0]


def test_an_unknown_model_or_a_node_a_gateway_could_not_reach_asks_for_nothing() -> None:
    scaler = FakeScaler()
    state, _ = cluster(scaler, 0, 1)
    assert isinstance(state.place("nope:1"), Unplaceable)
    assert isinstance(state.place("m:1", avoid=("n1",)), Unplaceable)
    assert scaler.asks == []


def test_a_failing_autoscaler_is_asked_again_at_the_next_change() -> None:
    scaler = FakeScaler(fail=True)
    state, _ = cluster(scaler, 0)
    assert isinstance(state.place("m:1"), Unplaceable)   # the placement stands; the ask failed
    scaler.fail = False
    state.place("m:1")
    assert scaler.asks == [2]


def test_a_gateway_only_node_is_not_counted_as_a_machine_to_serve_on() -> None:
    """The head's gateway (no slices) with the worker group at zero: a request asks for one machine, not two."""
    scaler = FakeScaler()
    state, _ = cluster(scaler)
    state.report(inv("head", 0).model_copy(update={"slices": {}, "free_slices": {}}))
    placement = state.place("m:1")
    assert isinstance(placement, Unplaceable) and placement.for_room
    assert scaler.asks == [1]


def test_jobs_stranded_with_no_node_ask_for_a_machine_without_a_request_being_placed() -> None:
    """A job queued while the controller was rebuilding (its `place` refused, the gateway enqueued on its own
    view) still brings a machine: the queued jobs no node can run are the demand."""
    scaler = FakeScaler()
    state, clock = cluster(scaler)
    head = inv("head", 0).model_copy(update={"slices": {}, "free_slices": {}, "jobs": {"m:1": 1}})
    state.report(head)
    assert scaler.asks == [1] and state.asked.models == ("m:1",)
    clock.advance(1.0)
    state.report(head)
    assert scaler.asks == [1]                            # the same size: not asked again


def test_the_request_stands_until_a_node_serving_the_model_can_run_it() -> None:
    """The new node could start the model at its first report, but is only deploying it: withdrawing then would
    let Ray's autoscaler take it away (idle to Ray) before it holds its bundle. Withdrawn once it serves it."""
    scaler = FakeScaler()
    state, clock = cluster(scaler)
    head = inv("head", 0).model_copy(update={"slices": {}, "free_slices": {}, "jobs": {"m:1": 1}})
    state.report(head)
    clock.advance(1.0)
    state.report(inv("new", 1))                          # joined, deploying m:1 (given it to take up)
    assert scaler.asks == [1]
    state.report(inv("new", 1).model_copy(update={"serving": ("m:1",)}))
    assert scaler.asks == [1, 0]                         # it serves m:1 and can run it: withdrawn


def test_a_model_served_with_no_job_left_waits_no_more_even_while_its_node_is_busy() -> None:
    """The new node ran the job and is busy with a request (no room): nothing is queued, so nothing waits; the
    node keeps itself by holding its Ray bundle. A request that finds no room then asks again."""
    scaler = FakeScaler()
    state, clock = cluster(scaler)
    state.report(inv("head", 0).model_copy(update={"slices": {}, "free_slices": {}, "jobs": {"m:1": 1}}))
    clock.advance(1.0)
    state.report(inv("head", 0).model_copy(update={"slices": {}, "free_slices": {}}))
    state.report(inv("new", 0).model_copy(update={"serving": ("m:1",)}))
    assert scaler.asks == [1, 0]
    assert isinstance(state.place("m:1"), Unplaceable)
    assert scaler.asks == [1, 0, 2]
