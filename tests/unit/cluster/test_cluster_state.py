"""The controller's state without Ray: membership from reports, expiry, the registry, placement with the
starts it has handed out, the peer-tier hook; and the tensor body gateways forward to each other."""

from __future__ import annotations

import pytest

from ember.cluster.state import TAKE_UP_S, ClusterState, to_snapshot
from ember.core.placement import Forward, Placed, Unplaceable, after_placement
from ember.core.states import Rung
from ember.errors import ModelNotReady, ModelTooLarge
from ember.testing.clock import FakeClock
from ember.wire.cluster import Held, NodeInventory
from ember.wire.contract import ModelContract

CONTRACT = ModelContract.model_validate({
    "name": "m", "version": "1", "runtime": "python", "entrypoint": "x:Y",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    "resources": {"slice": "cpu", "memory_mb": 100}})


def inv(node: str, *held: Held, free: int = 1, given: bool = False) -> NodeInventory:
    """A node's report; its queue measured in seconds, as every node reports it (nothing waiting: 0 s)."""
    return NodeInventory(node=node, url=f"http://{node}:8000", memory_mb=1000, free_memory_mb=1000,
                         slices={"cpu": 2}, free_slices={"cpu": free}, disk_bps=1e9, net_bps=1e9, held=held,
                         contracts=(CONTRACT,) if given else (), queue_s=0.0)


def test_nodes_join_by_reporting_and_leave_when_they_stop() -> None:
    clock = FakeClock()
    state = ClusterState(clock, ttl_s=3.0, token="t")
    state.report(inv("a", given=True))
    view = state.report(inv("b"))
    assert [n.node for n in view.nodes] == ["a", "b"] and view.token == "t"
    assert [c.key for c in view.contracts] == ["m:1"]        # the registry: what some node was given
    clock.advance(2.0)
    state.report(inv("a", given=True))
    clock.advance(1.5)                                       # b silent for 3.5 s, a for 1.5 s
    view = state.view()
    assert [n.node for n in view.nodes] == ["a"] and view.version == 3


def test_each_departure_is_recorded_with_its_cause_and_time() -> None:
    clock = FakeClock()
    state = ClusterState(clock, ttl_s=3.0, token="t")
    state.report(inv("a"))
    state.report(inv("b"))
    clock.advance(1.0)
    assert state.remove("a", "dead in Ray's GCS") and not state.remove("a", "again")   # once
    clock.advance(2.5)                                                            # b silent for 3.5 s
    state.view()
    assert [(d.node, d.cause, d.at) for d in state.departed] == [
        ("a", "dead in Ray's GCS", clock.now() - 2.5), ("b", "no report for 3 s", clock.now())]


def settled(ttl_s: float = 3.0) -> ClusterState:
    """A state past its first ttl (every live node has reported since it began)."""
    clock = FakeClock()
    state = ClusterState(clock, ttl_s=ttl_s, token="t")
    clock.advance(ttl_s)
    return state


def test_a_restarted_controller_says_it_is_rebuilding_until_every_node_has_reported() -> None:
    reports = [inv("a", Held(model="m:1", template=True), given=True), inv("b")]
    before = settled()
    for r in reports:
        before.report(r)
    clock = FakeClock()
    after = ClusterState(clock, ttl_s=3.0, token="t")        # empty, as after a restart
    after.report(reports[0])
    assert not after.view().complete and before.view().complete
    with pytest.raises(ModelNotReady, match="rebuilding"):   # the gateway places on its last view meanwhile
        after.place("m:1")
    clock.advance(1.0)
    after.report(reports[1])
    clock.advance(2.0)
    assert after.view().complete
    assert after.view().nodes == before.view().nodes and after.place("m:1") == before.place("m:1")


def test_placement_prefers_the_template_then_the_chunks_and_counts_its_own_starts() -> None:
    state = settled()
    state.report(inv("a", Held(model="m:1", bytes=10**9, local_bytes=0), given=True))
    state.report(inv("b", Held(model="m:1", bytes=10**9, local_bytes=10**9)))
    state.report(inv("c", Held(model="m:1", template=True, bytes=10**9)))
    first = state.place("m:1")
    assert isinstance(first, Placed) and (first.node, first.rung) == ("c", Rung.TEMPLATE)
    second = state.place("m:1", avoid=("c",))
    assert isinstance(second, Placed) and (second.node, second.rung, second.weights) == ("b", Rung.ZYGOTE, "local")
    # c now has one start queued that it has not reported yet: the view says so.
    assert {n.node: n.queue for n in state.view().nodes} == {"a": 0, "b": 1, "c": 1}
    # A start a gateway placed on its own view counts the same; one on a node gone from the view, nowhere.
    state.note_start("a")
    state.note_start("gone")
    assert {n.node: n.queue for n in state.view().nodes} == {"a": 1, "b": 1, "c": 1}
    state.report(inv("a", Held(model="m:1", bytes=10**9, local_bytes=0), given=True))   # a reports: none queued
    assert {n.node: n.queue for n in state.view().nodes} == {"a": 0, "b": 1, "c": 1}


def test_starts_placed_in_a_row_spread_over_equal_nodes_and_a_tie_goes_to_the_asker() -> None:
    state = settled()
    template = Held(model="m:1", template=True, bytes=10**9)
    state.report(inv("a", template, given=True))
    state.report(inv("b", template))
    nodes = [p.node for p in (state.place("m:1"), state.place("m:1")) if isinstance(p, Placed)]
    assert nodes == ["a", "b"]                               # a's start counts in its measured queue too
    assert {n.node: (n.queue, n.queue_s) for n in state.view().nodes} == {"a": (1, 0.05), "b": (1, 0.05)}
    asked = state.place("m:1", here="b")
    assert isinstance(asked, Placed) and asked.node == "b"


def test_an_unknown_model_is_unplaceable_by_name() -> None:
    state = settled()
    state.report(inv("a"))
    placement = state.place("nope:1")
    assert isinstance(placement, Unplaceable) and "nope:1" in placement.reason


def test_the_peer_tier_hook_names_the_nodes_holding_every_chunk() -> None:
    state = ClusterState(FakeClock(), token="t")
    state.report(inv("a", Held(model="m:1", bytes=100, local_bytes=100), given=True))
    state.report(inv("b", Held(model="m:1", bytes=100, local_bytes=40)))
    assert [(h.node, h.url) for h in state.holders("m:1")] == [("a", "http://a:8000")]


def test_a_model_no_node_could_hold_is_refused_at_registration_naming_the_largest_node() -> None:
    huge = CONTRACT.model_copy(update={"name": "huge", "resources": CONTRACT.resources.model_copy(
        update={"memory_mb": 5000})})
    state = ClusterState(FakeClock(), ttl_s=0.0, token="t")
    state.report(inv("a", given=True))
    state.report(inv("b").model_copy(update={"memory_mb": 2000, "contracts": (huge,)}))
    view = state.view()
    assert set(view.refused) == {"huge:1"} and {c.key for c in view.contracts} == {"m:1", "huge:1"}
    with pytest.raises(ModelTooLarge, match=r"model 'huge:1': needs 5000 MB .* the largest node with one, b, has "
                                            r"2000 MB"):
        state.place("huge:1")
    assert isinstance(state.place("m:1"), Placed)
    state.report(inv("c").model_copy(update={"memory_mb": 8000}))   # a node that can: no longer refused
    assert state.view().refused == {}


def test_a_gateway_only_node_judges_nothing_and_alone_refuses_nothing() -> None:
    """A node with no slices (`--cpu-slots 0`) could hold no model: it is not the largest node of any error,
    and with no other node (the workers scaled to zero) no model is refused, since a node that joins may hold it."""
    gateway = inv("g", given=True).model_copy(update={"slices": {}, "free_slices": {}, "memory_mb": 0})
    state = ClusterState(FakeClock(), ttl_s=0.0, token="t")
    state.report(gateway)
    assert state.view().refused == {}
    placement = state.place("m:1")
    assert isinstance(placement, Unplaceable) and placement.for_room   # room wanted: ask for a machine
    state.report(inv("a"))
    assert state.view().refused == {} and isinstance(state.place("m:1"), Placed)


def test_queued_jobs_no_serving_node_can_run_are_taken_up_by_a_node_with_room() -> None:
    state = settled()
    full = inv("a", free=0, given=True).model_copy(update={"free_memory_mb": 0, "serving": ("m:1",),
                                                            "jobs": {"m:1": 2}})
    state.report(full)
    view = state.report(inv("b").model_copy(update={"jobs": {"m:1": 2}}))
    assert view.take_up == {"b": ("m:1",)}
    # While b deploys it (its room spent on it), c joins with room: b keeps it, c is not given it too.
    deploying = inv("b", free=0).model_copy(update={"free_memory_mb": 0, "jobs": {"m:1": 2}})
    state.report(deploying)
    assert state.report(inv("c").model_copy(update={"jobs": {"m:1": 2}})).take_up == {"b": ("m:1",)}
    # b deployed it: it serves m now and has room, so it claims them; nothing more to take up.
    view = state.report(inv("b").model_copy(update={"serving": ("m:1",), "jobs": {"m:1": 2}}))
    assert view.take_up == {}
    # The jobs drained: nothing, whoever serves it.
    state.report(full.model_copy(update={"jobs": {}}))
    state.report(inv("c"))
    assert state.report(inv("b")).take_up == {}


def test_a_take_up_whose_deploy_never_lands_is_placed_afresh() -> None:
    clock = FakeClock()
    state = ClusterState(clock, ttl_s=2 * TAKE_UP_S, token="t")   # no node expires in this test
    clock.advance(2 * TAKE_UP_S)
    full = inv("a", free=0, given=True).model_copy(update={"free_memory_mb": 0, "serving": ("m:1",),
                                                            "jobs": {"m:1": 1}})
    state.report(full)
    assert state.report(inv("b").model_copy(update={"jobs": {"m:1": 1}})).take_up == {"b": ("m:1",)}
    stuck = inv("b", free=0).model_copy(update={"free_memory_mb": 0, "jobs": {"m:1": 1}})
    state.report(stuck)
    assert state.report(inv("c")).take_up == {"b": ("m:1",)}
    clock.advance(TAKE_UP_S)                                  # b's deploy never landed: c is given it
    assert state.report(inv("c")).take_up == {"c": ("m:1",)}


def test_a_model_whose_nodes_all_left_stays_registered_but_one_unloaded_does_not() -> None:
    clock = FakeClock()
    state = ClusterState(clock, ttl_s=3.0, token="t")
    state.report(inv("a", given=True))
    state.report(inv("b"))
    clock.advance(2.0)
    state.report(inv("b").model_copy(update={"jobs": {"m:1": 1}}))
    clock.advance(1.5)                                        # a silent past its ttl: gone
    view = state.view()
    assert [n.node for n in view.nodes] == ["b"] and [c.key for c in view.contracts] == ["m:1"]
    assert view.take_up == {"b": ("m:1",)}                    # its queued job: b deploys m and claims it
    assert isinstance(state.place("m:1"), Placed)
    # A live node that stops reporting a contract (unloaded) takes it out of the registry.
    state.report(inv("b", given=True))
    assert [c.key for c in state.view().contracts] == ["m:1"]
    state.report(inv("b"))
    assert state.view().contracts == ()


def test_a_models_min_scale_is_spread_over_the_nodes_serving_it() -> None:
    two = CONTRACT.model_copy(update={"scaling": CONTRACT.scaling.model_copy(update={"min_scale": 3})})
    state = settled()
    for node in ("a", "b"):
        state.report(inv(node).model_copy(update={"contracts": (two,), "serving": ("m:1",)}))
    view = state.report(inv("c"))                             # c does not serve m: no share
    assert view.min_scale == {"a": {"m:1": 2}, "b": {"m:1": 1}}
    state.report(inv("a").model_copy(update={"contracts": (two,), "serving": ()}))   # a unloaded it
    assert state.view().min_scale == {"b": {"m:1": 3}}


def test_a_full_cluster_sends_a_request_to_a_node_serving_the_model_not_to_a_job() -> None:
    """Its one slice held by the model's instance (starting, or busy in the view a gateway has), node b places no
    start; a gateway only (g) forwards to b, whose ladder knows its room now, rather than making a job."""
    state = settled()
    state.report(inv("g").model_copy(update={"slices": {}, "free_slices": {}}))
    state.report(inv("b", free=0, given=True).model_copy(update={"serving": ("m:1",)}))
    placement = state.place("m:1", here="g")
    assert isinstance(placement, Unplaceable) and placement.for_room
    assert after_placement(placement, "g", snapshot=to_snapshot(state.view())) == Forward("b", "served there")
