"""Queued jobs no node would claim: which node takes up their model (`ember.core.backlog`)."""

from __future__ import annotations

from ember.core.backlog import runnable, stranded, take_up
from ember.core.placement import ClusterSnapshot, Holding, ModelSpec, NodeSnapshot, WarmInstance
from ember.core.rung_costs import RungCost, RungCosts
from ember.core.states import Rung

GB = 1_000_000_000
COSTS = RungCosts(paused=RungCost(250, 0.5), template=RungCost(250, 0.25), zygote=RungCost(150, 0.25))
A, B = ModelSpec("a:1", bytes=GB, memory_mb=1000), ModelSpec("b:1", bytes=GB, memory_mb=1000)


def node(node_id: str, *, free_mb: int = 8000, cpu: int = 1, holdings: dict[str, Holding] | None = None,
         warm: tuple[WarmInstance, ...] = ()) -> NodeSnapshot:
    return NodeSnapshot(node_id, memory_mb=16000, free_memory_mb=free_mb, slices={"cpu": 2}, free_slices={"cpu": cpu},
                        queue=0, disk_bps=GB, net_bps=GB, holdings=holdings or {}, warm=warm)


def cluster(*nodes: NodeSnapshot) -> ClusterSnapshot:
    return ClusterSnapshot(tuple(nodes), {A.key: A, B.key: B}, origin_bps=0.1 * GB, service_s=0.25, costs=COSTS)


FULL = node("full", free_mb=0, cpu=0)


def test_a_node_serving_the_model_with_room_claims_its_jobs_itself() -> None:
    snapshot = cluster(node("serves"), node("idle"))
    assert take_up(snapshot, {"a:1": 3}, {"serves": frozenset({"a:1"})}) == ()
    # A warm instance with room counts as room even on a node with no free slice.
    busy = node("serves", free_mb=0, cpu=0, warm=(WarmInstance("i", "serves", "a:1", 0, 1),))
    assert take_up(cluster(busy, node("idle")), {"a:1": 3}, {"serves": frozenset({"a:1"})}) == ()


def test_a_model_whose_only_node_is_full_is_taken_up_where_it_starts_soonest() -> None:
    snapshot = cluster(FULL, node("cold"), node("chunks", holdings={"a:1": Holding(local_bytes=GB)}))
    (decided,) = take_up(snapshot, {"a:1": 2}, {"full": frozenset({"a:1"})})
    assert (decided.model, decided.node, decided.jobs) == ("a:1", "chunks", 2)
    assert decided.placed is not None
    assert decided.placed.rung is Rung.ZYGOTE   # its chunks are local there: 0.25 + 1 s, not 1 s more from a peer


def test_a_model_no_live_node_serves_is_taken_up_and_one_model_per_node_per_round() -> None:
    snapshot = cluster(node("x"), node("y"))
    decided = take_up(snapshot, {"a:1": 1, "b:1": 4, "gone:1": 5}, {})
    assert [(t.model, t.node) for t in decided] == [("a:1", "x"), ("b:1", "y")]   # gone:1: no contract, left queued
    only_one = take_up(cluster(node("x")), {"a:1": 1, "b:1": 1}, {})
    assert [(t.model, t.node) for t in only_one] == [("a:1", "x")]                 # b:1 next round


def test_nothing_queued_or_nowhere_to_start_decides_nothing() -> None:
    assert take_up(cluster(node("x")), {"a:1": 0}, {}) == ()
    assert take_up(cluster(FULL), {"a:1": 2}, {}) == ()


def test_a_model_given_in_an_earlier_round_stays_with_its_node_while_it_deploys() -> None:
    # x was given a:1 and is deploying it: its room is spent, so a fresh placement would pick y as well.
    deploying = node("x", free_mb=0, cpu=0)
    snapshot = cluster(deploying, node("y"))
    (decided,) = take_up(snapshot, {"a:1": 2}, {}, {"a:1": "x"})
    assert (decided.model, decided.node, decided.placed) == ("a:1", "x", None)
    # One model per node still: b:1 goes elsewhere.
    both = take_up(snapshot, {"a:1": 1, "b:1": 1}, {}, {"a:1": "x", "b:1": "x"})
    assert [(t.model, t.node) for t in both] == [("a:1", "x"), ("b:1", "y")]
    # The node that was given it left: placed afresh.
    (moved,) = take_up(cluster(node("y")), {"a:1": 2}, {}, {"a:1": "x"})
    assert moved.node == "y" and moved.placed is not None
    # It serves it now but is full: another node takes it up too (more room for the jobs).
    (more,) = take_up(snapshot, {"a:1": 2}, {"x": frozenset({"a:1"})}, {"a:1": "x"})
    assert more.node == "y"


def test_a_node_deploying_a_given_model_is_not_taken_by_a_model_earlier_in_key_order() -> None:
    # x is deploying b:1 (given earlier) and has room for another; a:1 comes first in key order: it must go to y,
    # not take x and push b:1 onto y as well.
    snapshot = cluster(node("x", cpu=2), node("y"))
    decided = take_up(snapshot, {"a:1": 1, "b:1": 1}, {}, {"b:1": "x"})
    assert [(t.model, t.node) for t in decided] == [("a:1", "y"), ("b:1", "x")]


def test_jobs_no_node_can_run_or_take_up_are_stranded_and_want_a_machine() -> None:
    served = {"full": frozenset({"a:1"})}
    assert stranded(cluster(), {"a:1": 1}, {}, ()) == ("a:1",)                 # no node at all: a group at zero
    assert stranded(cluster(FULL), {"a:1": 2, "b:1": 0}, served, ()) == ("a:1",)   # its only node full
    decided = take_up(cluster(FULL, node("cold")), {"a:1": 2}, served)
    assert stranded(cluster(FULL, node("cold")), {"a:1": 2}, served, decided) == ()   # "cold" takes it up
    assert stranded(cluster(node("serves")), {"a:1": 2}, {"serves": frozenset({"a:1"})}, ()) == ()
    assert runnable("a:1", cluster(node("serves")), {"serves": frozenset({"a:1"})})
    assert not runnable("a:1", cluster(node("idle")), {})                      # could start it, does not serve it
