"""The controller is told of a start a gateway placed on its own view only when the start is slow."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from ember.cluster.forward import Forwarder
from ember.cluster.service import ClusterService, ClusterSettings
from ember.core.placement import Placed, Placement
from ember.core.states import Rung
from ember.serving.controller import Controller
from ember.wire.cluster import ClusterView, NodeInventory

START = Placed("m:1", "b", Rung.TEMPLATE, None, 0.01, 0.0)


class RecordingLink:
    """A ClusterLink that records the starts it is told of (the controller's `placed`)."""

    def __init__(self) -> None:
        self.told: list[Placed] = []

    async def report(self, inventory: NodeInventory) -> ClusterView:
        raise NotImplementedError

    async def place(self, model: str, avoid: tuple[str, ...], here: str | None = None) -> Placement:
        raise NotImplementedError

    def placed(self, placement: Placed) -> None:
        self.told.append(placement)


def service(link: RecordingLink, tell_after_s: float) -> ClusterService:
    settings = ClusterSettings(node_id="a", url="http://a", tell_after_s=tell_after_s)
    return ClusterService(cast(Controller, None), link, Forwarder(1.0), settings)


async def _through(svc: ClusterService, placement: Placed | None, wait_s: float) -> None:
    with svc._told_if_slow(placement):
        await asyncio.sleep(wait_s)
    await asyncio.sleep(0.03)   # a timer left armed (tell_after_s 5 ms) would have fired by now


@pytest.mark.parametrize(("tell_after_s", "wait_s", "told"), [(0.005, 0.0, []), (0.0, 0.02, [START])])
def test_a_start_answered_in_time_is_never_told_a_slow_one_is_told_once(tell_after_s: float, wait_s: float,
                                                                       told: list[Placed]) -> None:
    link = RecordingLink()
    asyncio.run(_through(service(link, tell_after_s), START, wait_s))
    assert link.told == told


def test_a_start_the_controller_placed_itself_is_not_told_again() -> None:
    link = RecordingLink()
    asyncio.run(_through(service(link, 0.0), None, 0.02))
    assert link.told == []

