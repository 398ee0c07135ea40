"""A node Ray's GCS declares dead reaches every gateway at once: the controller's long poll (`Deaths`, answered on
its event loop as the GCS watcher thread reads the node table) and a gateway's `watch`, which drops the node."""

from __future__ import annotations

import asyncio
import threading
from typing import cast

import pytest

pytest.importorskip("ray")

from ember.cluster.actors import Deaths
from ember.cluster.forward import Forwarder
from ember.cluster.service import ClusterService, ClusterSettings
from ember.core.placement import Placed, Placement
from ember.serving.controller import Controller
from ember.wire.cluster import ClusterView, NodeInventory


def test_a_waiting_gateway_hears_of_a_death_the_watcher_thread_reads() -> None:
    forgotten: list[int] = []
    deaths = Deaths(lambda: forgotten.append(len(deaths.nodes)))

    async def scenario() -> list[tuple[int, tuple[str, ...]]]:
        first = await deaths.since(-1, 5.0)                 # the count, at once
        waiting = asyncio.ensure_future(deaths.since(first[0], 30.0))
        await asyncio.sleep(0)
        thread = threading.Thread(target=deaths.add, args=(frozenset({"n1"}),))
        thread.start()
        heard = await asyncio.wait_for(waiting, 10.0)     # woken by the thread, not at its 30 s
        thread.join()
        deaths.add(frozenset({"n1", "n2"}))                # n1 again: only n2 is new
        again = await deaths.since(heard[0], 5.0)
        return [first, heard, again, await deaths.since(9, 5.0)]

    first, heard, again, restarted = asyncio.run(scenario())
    assert first == (0, ())
    assert heard == (1, ("n1",))
    assert again == (2, ("n2",))
    assert restarted == (2, ("n1", "n2"))                 # the controller restarted below what the gateway saw
    assert forgotten == [1, 2]                              # the controller's state dropped each, on its loop


def test_a_gateway_waits_no_longer_than_asked() -> None:
    deaths = Deaths(lambda: None)
    assert asyncio.run(deaths.since(0, 0.01)) == (0, ())


class DeathsLink:
    """A ClusterLink whose `gone` answers each of `answers` in turn, then waits forever."""

    def __init__(self, answers: list[tuple[int, tuple[str, ...]]]) -> None:
        self.answers, self.asked = answers, []   # type: list[tuple[int, tuple[str, ...]]], list[int]

    async def report(self, inventory: NodeInventory) -> ClusterView:
        raise NotImplementedError

    async def place(self, model: str, avoid: tuple[str, ...], here: str | None = None) -> Placement:
        raise NotImplementedError

    def placed(self, placement: Placed) -> None:
        pass

    async def gone(self, seen: int) -> tuple[int, tuple[str, ...]]:
        self.asked.append(seen)
        if self.answers:
            return self.answers.pop(0)
        await asyncio.Event().wait()
        raise AssertionError


def _view(*nodes: str) -> ClusterView:
    return ClusterView(version=1, contracts=(), origin_bps=1e8, service_s=0.05, token="t", nodes=tuple(
        NodeInventory(node=n, url=f"http://{n}", memory_mb=1024, free_memory_mb=1024, slices={"cpu": 1},
                      free_slices={"cpu": 1}, disk_bps=1e9, net_bps=1e9, contracts=(), warm=())
        for n in nodes))


def test_a_gateway_drops_each_node_it_hears_is_dead() -> None:
    link = DeathsLink([(0, ()), (2, ("b", "d"))])
    svc = ClusterService(cast(Controller, None), link, Forwarder(1.0), ClusterSettings(node_id="a", url="http://a"))
    svc._set_view(_view("a", "b", "c"))

    async def scenario() -> None:
        task = asyncio.ensure_future(svc.watch())
        while len(link.asked) < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        await svc.close()

    asyncio.run(scenario())
    assert link.asked == [-1, 0, 2]
    assert svc._view is not None and [n.node for n in svc._view.nodes] == ["a", "c"]


def test_a_gateway_stops_watching_once_its_own_node_is_declared_dead() -> None:
    link = DeathsLink([(1, ("b",)), (2, ("a",))])
    svc = ClusterService(cast(Controller, None), link, Forwarder(1.0), ClusterSettings(node_id="a", url="http://a"))
    svc._set_view(_view("a", "b", "c"))

    async def scenario() -> None:
        await asyncio.wait_for(svc.watch(), 10)   # returns: the caller (join) ends the process
        await svc.close()

    asyncio.run(scenario())
    assert link.asked == [-1, 1] and svc._view is not None and [n.node for n in svc._view.nodes] == ["a", "c"]
