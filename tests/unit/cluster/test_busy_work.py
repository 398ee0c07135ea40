"""What counts as a node's work for its Ray hold (`ember.cluster.busy.local_work`): the serving controller on a
FakeNode, a real SQLite job store and a FakeClock (`ember.testing.controller.World`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ember.cluster.busy import local_work
from ember.serving.results import JobAccepted
from ember.testing.controller import World, X, settle, write

pytestmark = pytest.mark.anyio


async def test_a_request_in_flight_and_a_queued_job_are_work_an_idle_node_has_none(tmp_path: Path) -> None:
    write(tmp_path, "m", max_scale=1)
    w = World(tmp_path, slots=1)
    w.node.infer_delay = 0.2
    await w.ctl.deploy_all()
    assert local_work(w.ctl) == 0                              # deployed, idle
    busy = asyncio.ensure_future(w.infer())
    await asyncio.sleep(0.05)
    assert local_work(w.ctl) >= 1                              # a request in flight
    accepted = await w.ctl.infer(w.ctl.contract("m"), X)
    assert isinstance(accepted, JobAccepted)
    assert local_work(w.ctl) >= 2                              # and a job queued for its model
    await busy
    await settle(w, accepted.job_id, "succeeded", tick=True)
    assert local_work(w.ctl) == 0                              # done: idle again


async def test_a_model_that_failed_to_deploy_is_no_work(tmp_path: Path) -> None:
    """Else a node with a broken model would hold its bundle, and its machine, for ever."""
    write(tmp_path, "broken")
    w = World(tmp_path)
    w.node.fail_prepare.add("broken:1")
    await w.ctl.deploy_all()
    assert w.ctl.deploying() == 0 and local_work(w.ctl) == 0


async def test_a_gateway_only_has_no_work(tmp_path: Path) -> None:
    write(tmp_path, "m")
    w = World(tmp_path, slots=0)
    await w.ctl.deploy_all()
    assert local_work(w.ctl) == 0
