"""Measured bandwidths from a node's report to the controller's placement: a node's own figures over the assumed
ones, a faster measured peer fetch preferred, the origin costed per node or at the best any node measured."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest

from ember.cluster.inventory import inventory
from ember.cluster.state import ClusterState, to_snapshot
from ember.core.bandwidth import Bandwidths
from ember.core.placement import Placed
from ember.core.states import Rung
from ember.testing.clock import FakeClock
from ember.testing.controller import World, write
from ember.wire.cluster import Held, NodeInventory
from ember.wire.contract import ModelContract

GB = 10**9
CONTRACT = ModelContract.model_validate({
    "name": "m", "version": "1", "runtime": "python", "entrypoint": "x:Y",
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
    "resources": {"slice": "cpu", "memory_mb": 100}})


def test_a_node_reports_what_its_store_measured_and_the_assumed_figures_until_then(tmp_path: Path) -> None:
    write(tmp_path, "m")
    w = World(tmp_path)
    assumed = inventory(w.ctl, "n", "http://n:8000", (), given=(), disk_bps=1e9, net_bps=1.25e9, service_s=0.05)
    assert (assumed.disk_bps, assumed.net_bps, assumed.origin_bps, assumed.measured) == (1e9, 1.25e9, None, ())
    w.node.measured = Bandwidths(disk_bps=7e8, peer_bps=3e8, origin_bps=1e8)
    measured = inventory(w.ctl, "n", "http://n:8000", (), given=(), disk_bps=1e9, net_bps=1.25e9, service_s=0.05)
    assert (measured.disk_bps, measured.net_bps, measured.origin_bps) == (7e8, 3e8, 1e8)
    assert measured.measured == ("disk", "net")
    w.node.measured = Bandwidths(origin_bps=1e8)     # only the origin measured: the rest stays assumed
    partly = inventory(w.ctl, "n", "http://n:8000", (), given=(), disk_bps=1e9, net_bps=1.25e9, service_s=0.05)
    assert (partly.disk_bps, partly.net_bps, partly.origin_bps, partly.measured) == (1e9, 1.25e9, 1e8, ())


def node(name: str, *held: Held, disk_bps: float | None = None, net_bps: float | None = None,
         origin_bps: float | None = None, given: bool = False) -> NodeInventory:
    """A node's report: the figures given are measured, the others the assumed 1 GB/s."""
    measured: list[Literal["disk", "net"]] = (["disk"] if disk_bps else []) + (["net"] if net_bps else [])
    return NodeInventory(node=name, url=f"http://{name}:8000", memory_mb=1000, free_memory_mb=1000,
                         slices={"cpu": 1}, free_slices={"cpu": 1}, disk_bps=disk_bps or 1e9,
                         net_bps=net_bps or 1e9, measured=tuple(measured),
                         origin_bps=origin_bps, held=held, contracts=(CONTRACT,) if given else ())


def settled() -> ClusterState:
    clock = FakeClock()
    state = ClusterState(clock, ttl_s=3.0, origin_bps=1e8, token="t")
    clock.advance(3.0)
    return state


def test_the_node_that_measured_the_faster_peer_fetch_is_preferred() -> None:
    """Neither a nor b holds the model, c holds it whole (busy: no free slice). With the same figures a wins the
    tie by its id; once b measured peer fetches 4x faster, b is ready sooner and is chosen."""
    missing = Held(model="m:1", bytes=GB, local_bytes=0)
    holder = node("c", Held(model="m:1", bytes=GB, local_bytes=GB), given=True).model_copy(
        update={"free_slices": {"cpu": 0}})
    same = settled()
    for inv in (node("a", missing, net_bps=2.5e8), node("b", missing, net_bps=2.5e8), holder):
        same.report(inv)
    tie = same.place("m:1")
    assert isinstance(tie, Placed) and (tie.node, tie.rung, tie.weights) == ("a", Rung.FETCH, "peer")
    faster = settled()
    for inv in (node("a", missing, net_bps=2.5e8), node("b", missing, net_bps=1e9), holder):
        faster.report(inv)
    chosen = faster.place("m:1")
    assert isinstance(chosen, Placed) and (chosen.node, chosen.rung, chosen.weights) == ("b", Rung.FETCH, "peer")
    assert chosen.ready_s == pytest.approx(tie.ready_s - GB / 2.5e8 + GB / 1e9)


def test_the_origin_is_costed_at_a_nodes_own_figure_else_at_the_best_any_node_measured() -> None:
    missing = Held(model="m:1", bytes=GB, local_bytes=0)
    state = settled()
    state.report(node("a", missing, origin_bps=2e7, given=True))   # measured a slow origin itself
    state.report(node("b", missing))                               # has not fetched from the origin yet
    state.report(node("c", missing, origin_bps=4e8))
    snapshot = to_snapshot(state.view())
    assert snapshot.origin_bps == 4e8      # not the assumed 1e8: the best a node measured
    placed = state.place("m:1")
    # b (no figure: the best, 4e8) ties c (its own 4e8) and wins by its id; a's own slow figure keeps it out.
    assert isinstance(placed, Placed) and (placed.node, placed.weights) == ("b", "origin")
    slow = state.place("m:1", avoid=("b", "c"))
    assert isinstance(slow, Placed) and (slow.node, slow.weights) == ("a", "origin")
    assert slow.start_s == pytest.approx(placed.start_s - GB / 4e8 + GB / 2e7)


def test_without_any_measured_origin_figure_the_assumed_one_stands() -> None:
    state = settled()
    state.report(node("a", given=True))
    assert to_snapshot(state.view()).origin_bps == 1e8


def test_a_node_without_a_figure_is_costed_at_the_measured_median_not_the_guess() -> None:
    """b holds the chunks and measured a slow disk; a would fetch them from b and has measured nothing. Against
    the assumed 1 GB/s, a would look faster than b's own disk; at the measured figures it never is."""
    state = settled()
    state.report(node("a", Held(model="m:1", bytes=GB, local_bytes=0), given=True))
    state.report(node("b", Held(model="m:1", bytes=GB, local_bytes=GB), disk_bps=1e8, net_bps=5e8))
    snapshot = to_snapshot(state.view())
    assert {n.id: (n.disk_bps, n.net_bps) for n in snapshot.nodes} == {"a": (1e8, 5e8), "b": (1e8, 5e8)}
    placed = state.place("m:1")
    assert isinstance(placed, Placed) and (placed.node, placed.rung, placed.weights) == ("b", Rung.ZYGOTE, "local")
    state.report(node("c", disk_bps=3e8))
    state.report(node("d", disk_bps=9e8))
    medians = {n.id: n.disk_bps for n in to_snapshot(state.view()).nodes}
    assert medians == {"a": 3e8, "b": 1e8, "c": 3e8, "d": 9e8}   # a: the median of b, c and d


def test_a_queue_a_node_measured_in_seconds_reaches_placement() -> None:
    """a and b hold the template; a has three requests waiting that it measured at 0.6 s to work through, b one
    at 2 s (a slow model): a start goes to a, where counting requests (0.05 s each) would have sent it to b."""
    template = Held(model="m:1", bytes=GB, local_bytes=GB, template=True)
    state = settled()
    state.report(node("a", template, given=True).model_copy(update={"queue": 3, "queue_s": 0.6}))
    state.report(node("b", template, given=True).model_copy(update={"queue": 1, "queue_s": 2.0}))
    chosen = state.place("m:1")
    assert isinstance(chosen, Placed) and (chosen.node, chosen.rung, chosen.queue_s) == ("a", Rung.TEMPLATE, 0.6)
