"""Placement across nodes by estimated time to ready: hand-computed costs per rung, the exclusions, ties,
the deploy-time fit check, power-of-two-choices routing, and the vectorised view held to the plain rule."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember.core.placement import (
    ClusterSnapshot,
    Holding,
    ModelSpec,
    NodeSnapshot,
    Placed,
    Unplaceable,
    WarmInstance,
    check_fits,
    estimate,
    pick_warm,
    place,
    place_slowly,
)
from ember.core.rung_costs import RungCost, RungCosts
from ember.core.states import Rung
from ember.errors import InvalidInput, ModelTooLarge

GB = 1_000_000_000
# Round figures, so every expected time below is worked out by hand.
COSTS = RungCosts(paused=RungCost(250, 0.5), template=RungCost(250, 0.25), zygote=RungCost(150, 0.25))
M = ModelSpec("m:1", bytes=GB, memory_mb=1000)


def node(node_id: str, *, held: Holding | None = None, free_mb: int = 8000, cpu: int = 2, queue: int = 0,
         disk: float = 1 * GB, net: float = 0.5 * GB, warm: tuple[WarmInstance, ...] = ()) -> NodeSnapshot:
    return NodeSnapshot(node_id, memory_mb=16000, free_memory_mb=free_mb, slices={"cpu": 4}, free_slices={"cpu": cpu},
                        queue=queue, disk_bps=disk, net_bps=net, holdings={M.key: held} if held else {}, warm=warm)


def cluster(*nodes: NodeSnapshot, **kw: Any) -> ClusterSnapshot:
    # The origin: 100 MB/s to any node; a queued request takes 0.25 s.
    args: dict[str, Any] = {"origin_bps": 0.1 * GB, "service_s": 0.25, "costs": COSTS, **kw}
    return ClusterSnapshot(nodes=tuple(nodes), models={M.key: M}, **args)


def placed(snapshot: ClusterSnapshot) -> Placed:
    got, slow = place(M.key, snapshot), place_slowly(M.key, snapshot)
    assert got == slow
    assert isinstance(got, Placed)
    return got


PAUSED = node("p", held=Holding(paused=1))
TEMPLATE = node("t", held=Holding(template=True))
ZYGOTE = node("z", held=Holding(local_bytes=GB))
PEER = node("f", held=Holding(local_bytes=GB // 2))      # half local; the other half from z, a peer
NOTHING = node("o")


@pytest.mark.parametrize(("n", "rung", "weights", "start_s"), [
    (PAUSED, Rung.PAUSED, None, 0.5),
    (TEMPLATE, Rung.TEMPLATE, None, 0.25),
    (ZYGOTE, Rung.ZYGOTE, "local", 0.25 + 1.0),               # 1 GB from disk at 1 GB/s
    (PEER, Rung.FETCH, "peer", 0.25 + 1.0 + 1.0),            # 0.5 GB from a peer at 0.5 GB/s, then 1 GB from disk
    (NOTHING, Rung.FETCH, "peer", 0.25 + 1.0 + 2.0),         # 1 GB from a peer, then from disk
])
def test_each_rung_costs_its_start_plus_its_bytes_over_bandwidth(
        n: NodeSnapshot, rung: Rung, weights: str | None, start_s: float) -> None:
    snap = cluster(PAUSED, TEMPLATE, ZYGOTE, PEER, NOTHING)
    assert estimate(M, n, snap) == Placed(M.key, n.id, rung, weights, start_s, 0.0)  # type: ignore[arg-type]


def test_without_a_peer_holding_every_chunk_the_bytes_come_from_the_origin() -> None:
    snap = cluster(PEER, NOTHING)      # nobody holds all of m's chunks
    assert estimate(M, PEER, snap) == Placed(M.key, "f", Rung.FETCH, "origin", 0.25 + 1.0 + 5.0, 0.0)
    assert estimate(M, NOTHING, snap) == Placed(M.key, "o", Rung.FETCH, "origin", 0.25 + 1.0 + 10.0, 0.0)
    slow_link = node("s", net=0.05 * GB)   # the node's own link is slower than the origin: it bounds the fetch
    assert estimate(M, slow_link, snap) == Placed(M.key, "s", Rung.FETCH, "origin", 0.25 + 1.0 + 20.0, 0.0)


def test_the_ladder_order_across_nodes() -> None:
    """With no queues: template (0.25) < paused (0.5) < zygote (1.25) < peer (1.75) < origin (10.25)."""
    assert placed(cluster(PAUSED, TEMPLATE, ZYGOTE, PEER, NOTHING)).node == "t"
    assert placed(cluster(PAUSED, ZYGOTE, PEER, NOTHING)).node == "p"
    assert placed(cluster(ZYGOTE, PEER, NOTHING)).node == "z"
    assert placed(cluster(replace(ZYGOTE, free_slices={}), PEER, NOTHING)).node == "f"
    assert (p := placed(cluster(NOTHING))).weights == "origin" and p.ready_s == 11.25


def test_a_nodes_queue_adds_its_length_times_the_service_time() -> None:
    busy_template = node("t", held=Holding(template=True), queue=3)     # 0.25 + 3 × 0.25 = 1.0
    assert placed(cluster(busy_template, ZYGOTE)) == Placed(M.key, "t", Rung.TEMPLATE, None, 0.25, 0.75)
    busier = node("t", held=Holding(template=True), queue=5)            # 0.25 + 1.25 = 1.5 > the zygote's 1.25
    assert placed(cluster(busier, ZYGOTE)).node == "z"


def test_a_queue_the_node_measured_in_seconds_counts_as_measured_not_by_its_length() -> None:
    # Five waiting requests of a fast model (the node measured 0.1 s to work through them): the template wins;
    # one waiting request of a slow one (2 s) sends the start to the zygote node (1.25).
    fast = replace(node("t", held=Holding(template=True), queue=5), queue_s=0.1)
    assert placed(cluster(fast, ZYGOTE)) == Placed(M.key, "t", Rung.TEMPLATE, None, 0.25, 0.1)
    slow = replace(node("t", held=Holding(template=True), queue=1), queue_s=2.0)
    assert placed(cluster(slow, ZYGOTE)).node == "z"
    with pytest.raises(InvalidInput, match="node t: queue_s"):
        replace(slow, queue_s=-1.0)


def test_never_a_node_without_the_memory_or_a_slice_of_the_kind() -> None:
    short = node("a", held=Holding(template=True), free_mb=999)
    no_slice = node("b", held=Holding(template=True), cpu=0)
    assert estimate(M, short, cluster(short)) is None and estimate(M, no_slice, cluster(no_slice)) is None
    assert placed(cluster(short, no_slice, NOTHING)).node == "o"     # 10.25 s from the origin, but it fits
    none = place(M.key, cluster(short, no_slice))
    assert isinstance(none, Unplaceable) and "1000 MB free" in none.reason and "'cpu' slice" in none.reason
    gpu = ModelSpec("g:1", bytes=GB, memory_mb=1000, slice_kind="gpu")
    snap = ClusterSnapshot(nodes=(NOTHING,), models={gpu.key: gpu}, origin_bps=GB, service_s=0.1)
    assert isinstance(place(gpu.key, snap), Unplaceable)


def test_a_paused_instance_needs_no_free_memory_or_slice() -> None:
    full = node("a", held=Holding(paused=1, template=True), free_mb=0, cpu=0)
    assert placed(cluster(full)) == Placed(M.key, "a", Rung.PAUSED, None, 0.5, 0.0)


def test_ties_go_to_the_cheaper_rung_then_the_asking_node_then_the_first_node_id() -> None:
    two = cluster(node("b", held=Holding(template=True)), node("a", held=Holding(template=True)))
    assert placed(two).node == "a"
    for here, want in (("b", "b"), ("a", "a"), ("elsewhere", "a")):   # asked at b: no forward to a
        got = place(M.key, two, here=here)
        assert got == place_slowly(M.key, two, here=here) and isinstance(got, Placed) and got.node == want
    # a: template 0.25 + queue 0.25 = 0.5; b: paused 0.5 + no queue = 0.5: the paused rung wins the tie, even
    # asked at a.
    tie = cluster(node("a", held=Holding(template=True), queue=1), node("b", held=Holding(paused=1)))
    assert placed(tie) == Placed(M.key, "b", Rung.PAUSED, None, 0.5, 0.0)
    assert place(M.key, tie, here="a") == place_slowly(M.key, tie, here="a") == placed(tie)


def test_a_model_too_large_for_every_node_is_an_error_naming_it_and_the_largest_node() -> None:
    small = NodeSnapshot("small", 8000, 8000, {"cpu": 2}, {"cpu": 2}, 0, GB, GB)
    big = NodeSnapshot("big", 32000, 1000, {"cpu": 2, "gpu": 1}, {"cpu": 0}, 0, GB, GB)
    check_fits(ModelSpec("ok:1", GB, 30000), [small, big])     # fits an empty `big`, though not now
    with pytest.raises(ModelTooLarge, match=r"model 'huge:1': needs 64000 MB .* the largest node with one, big, "
                                            r"has 32000 MB \(slices cpu×2, gpu×1\)"):
        check_fits(ModelSpec("huge:1", GB, 64000), [small, big])
    with pytest.raises(ModelTooLarge, match=r"model 't:1': needs a 'tpu' slice and no node has one; the largest "
                                            r"node, big"):
        check_fits(ModelSpec("t:1", GB, 10, slice_kind="tpu"), [small, big])
    with pytest.raises(ModelTooLarge, match="no node"):
        check_fits(M, [])
    assert issubclass(ModelTooLarge, InvalidInput)


def warm(i: str, n: str, in_flight: int, limit: int = 4) -> WarmInstance:
    return WarmInstance(i, n, M.key, in_flight, limit)


def test_p2c_picks_the_less_loaded_of_two() -> None:
    light, heavy = warm("a", "n1", 1), warm("b", "n2", 3)
    for seed in range(20):
        assert pick_warm([heavy, light], random.Random(seed)) == light
    # Load is the share of concurrency in use: 2 of 8 beats 1 of 2.
    assert pick_warm([warm("x", "n1", 1, 2), warm("y", "n2", 2, 8)], random.Random(0)).id == "y"  # type: ignore[union-attr]
    assert pick_warm([warm("x", "n1", 1), warm("y", "n1", 1)], random.Random(3)).id == "x"  # type: ignore[union-attr]


def test_p2c_skips_full_instances_prefers_local_and_is_reproducible() -> None:
    full, remote, local = warm("f", "n1", 4), warm("r", "n2", 0), warm("l", "n3", 3)
    assert pick_warm([full], random.Random(0)) is None and pick_warm([], random.Random(0)) is None
    assert pick_warm([full, remote], random.Random(0)) == remote
    assert pick_warm([full, remote, local], random.Random(0), local_node="n3") == local   # local first, though busier
    assert pick_warm([full, remote], random.Random(0), local_node="n3") == remote        # else anywhere
    many = [warm(f"i{k}", f"n{k % 3}", load) for k, load in enumerate([0, 1, 2, 1, 0, 2, 1, 3])]
    picks = [pick_warm(many, rng).id for rng in [random.Random(7)] for _ in range(50)]  # type: ignore[union-attr]
    again = [pick_warm(many, rng).id for rng in [random.Random(7)] for _ in range(50)]  # type: ignore[union-attr]
    assert picks == again
    assert "i7" not in picks and len(set(picks)) > 1   # the one most loaded never wins a pair; the rest share


def test_the_view_routes_among_every_nodes_warm_instances() -> None:
    snap = cluster(node("a", warm=(warm("a1", "a", 3),)), node("b", warm=(warm("b1", "b", 0),)))
    assert snap.view.route(M.key, random.Random(1)).id == "b1"  # type: ignore[union-attr]
    assert snap.view.route(M.key, random.Random(1), local_node="a").id == "a1"  # type: ignore[union-attr]
    assert snap.view.route("other:1", random.Random(1)) is None


def test_bad_figures_are_invalid_input_naming_the_field() -> None:
    with pytest.raises(InvalidInput, match="node n: disk_bps: must be > 0"):
        node("n", disk=0)
    with pytest.raises(InvalidInput, match="origin_bps"):
        cluster(NOTHING, origin_bps=-1.0)
    with pytest.raises(InvalidInput, match="node ids must be unique"):
        cluster(NOTHING, NOTHING)
    with pytest.raises(InvalidInput, match="model 'x:1': not in the cluster snapshot"):
        place("x:1", cluster(NOTHING))


_holding = st.builds(Holding, paused=st.integers(0, 1), template=st.booleans(),
                     local_bytes=st.sampled_from([0, GB // 4, GB // 2, GB, 2 * GB]))
_node = st.builds(lambda i, h, mb, cpu, q, d, n, qs: replace(node(f"n{i}", held=h, free_mb=mb, cpu=cpu, queue=q, disk=d,
                                                                   net=n), queue_s=qs),
                  st.integers(0, 9), st.one_of(st.none(), _holding), st.sampled_from([500, 1000, 4000]),
                  st.integers(0, 2), st.integers(0, 4), st.sampled_from([0.5 * GB, GB, 3 * GB]),
                  st.sampled_from([0.05 * GB, 0.25 * GB, GB]), st.sampled_from([None, 0.0, 0.3, 2.0]))


@settings(max_examples=300, deadline=None)
@given(st.lists(_node, min_size=1, max_size=8, unique_by=lambda n: n.id))
def test_the_vectorised_view_decides_as_the_plain_rule(nodes: list[NodeSnapshot]) -> None:
    snap = cluster(*nodes)
    assert place(M.key, snap) == place_slowly(M.key, snap)
    for n in nodes[:2]:
        assert place(M.key, snap, here=n.id) == place_slowly(M.key, snap, here=n.id)


def test_no_node_at_all_is_unplaceable_not_a_crash() -> None:
    empty = cluster()
    assert place(M.key, empty) == place_slowly(M.key, empty)
    assert isinstance(place(M.key, empty), Unplaceable)
