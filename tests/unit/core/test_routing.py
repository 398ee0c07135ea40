"""A gateway's decision for one request across nodes: local hot, then remote warm (p2c), then the controller;
and the controller's placement as serve here, forward there, or a job."""

from __future__ import annotations

import random
from dataclasses import replace

from ember.core.placement import (
    AskController,
    ClusterSnapshot,
    Enqueue,
    Forward,
    Holding,
    ModelSpec,
    NodeSnapshot,
    Placed,
    ServeHere,
    Unplaceable,
    WarmInstance,
    after_placement,
    route,
)
from ember.core.states import Rung

M = ModelSpec("m:1", bytes=1000, memory_mb=100)


def node(node_id: str, *warm: tuple[int, int], template: bool = False) -> NodeSnapshot:
    return NodeSnapshot(node_id, 1000, 1000, {"cpu": 2}, {"cpu": 2}, 0, 1e9, 1e9,
                        holdings={M.key: Holding(template=template)},
                        warm=tuple(WarmInstance(f"{node_id}-{i}", node_id, M.key, used, cap)
                                   for i, (used, cap) in enumerate(warm)))


def snap(*nodes: NodeSnapshot) -> ClusterSnapshot:
    return ClusterSnapshot(nodes, {M.key: M}, origin_bps=1e8, service_s=0.05)


def test_a_local_instance_with_room_wins_whatever_the_snapshot_says() -> None:
    s = snap(node("a"), node("b", (0, 4)))
    assert route(M.key, s, random.Random(1), "a", local_room=True) == ServeHere("local hot")


def test_without_local_room_a_remote_warm_instance_with_room_is_forwarded_to() -> None:
    s = snap(node("a", (4, 4)), node("b", (1, 4)))
    assert route(M.key, s, random.Random(1), "a", local_room=False) == Forward("b", "remote warm")


def test_a_warm_instance_on_this_node_that_the_live_pool_did_not_count_stays_here() -> None:
    s = snap(node("a", (1, 4)), node("b", (0, 4)))
    assert route(M.key, s, random.Random(1), "a", local_room=False) == ServeHere("local warm")


def test_of_several_remote_warm_instances_the_less_loaded_of_two_wins() -> None:
    s = snap(node("a"), node("b", (3, 4)), node("c", (1, 4)))
    picks = {route(M.key, s, random.Random(seed), "a", local_room=False) for seed in range(20)}
    assert picks == {Forward("c", "remote warm")}   # two of two drawn: always the less loaded


def test_no_warm_room_anywhere_asks_the_controller() -> None:
    s = snap(node("a", (4, 4)), node("b", (2, 2)))
    assert route(M.key, s, random.Random(1), "a", local_room=False) == AskController()


def test_a_model_the_snapshot_does_not_know_yet_asks_the_controller() -> None:
    assert route("other:1", snap(node("a")), random.Random(1), "a", local_room=False) == AskController()


def test_the_placement_becomes_serve_here_forward_or_a_job() -> None:
    here = Placed(M.key, "a", Rung.TEMPLATE, None, 0.25, 0.0)
    there = Placed(M.key, "b", Rung.ZYGOTE, "local", 1.0, 0.0)
    assert after_placement(here, "a") == ServeHere("placed here")
    assert after_placement(there, "a") == Forward("b", "placed there")
    assert after_placement(Unplaceable(M.key, "full"), "a") == Enqueue("full")
    assert after_placement(Unplaceable(M.key, "full"), "a", served_here=True) == ServeHere("served here")


def test_nowhere_to_start_one_but_deployed_on_other_nodes_goes_to_the_least_queued_of_them() -> None:
    """A view a report old shows the instance that just ran a job starting or busy: the node's own ladder, which
    knows its room now, decides (serve, or wait for room and make the job itself), not the stale view."""
    full = Unplaceable(M.key, "full", for_room=True)
    serving = frozenset({M.key})
    s = snap(node("a"), replace(node("b"), serving=serving, queue=3), replace(node("c"), serving=serving, queue=1))
    assert after_placement(full, "a", snapshot=s) == Forward("c", "served there")
    assert after_placement(full, "c", snapshot=s) == Forward("b", "served there")   # its own: `served_here` says
    assert after_placement(full, "c", served_here=True, snapshot=s) == ServeHere("served here")
    assert after_placement(full, "a", snapshot=snap(node("a"), node("b"))) == Enqueue("full")   # deployed nowhere
