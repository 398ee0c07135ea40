"""The controller on a node whose cores are shared (its default): models taken in turn keep their instances hot,
a request for a model whose instance is not working waits while every core works, and dedicated contracts get the
dedicated slots or a deploy error naming the key."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ember.core.slices import cpu_slices, node_cpu_slices
from ember.core.states import Rung
from ember.errors import ModelNotReady
from ember.serving.controller import Controller, ControllerSettings
from ember.serving.repository import Repository
from ember.serving.results import InferResult
from ember.testing.controller import World, X, write

pytestmark = pytest.mark.anyio


def shared_world(tmp: Path, slots: int = 2, dedicated: int = 0, **settings: Any) -> World:
    """A World whose node has `slots` CPU slots, `dedicated` of them dedicated, the others shared."""
    w = World(tmp)
    defaults: dict[str, Any] = {"queue_wait_s": 0.05, "request_timeout_s": 5}
    w.ctl = Controller(w.node, w.jobs, w.metrics, w.clock, node_cpu_slices(cpu_slices(slots, 1024), dedicated),
                       Repository([tmp / "models"]), ControllerSettings(**{**defaults, **settings}))
    return w


async def turns_until(condition: Callable[[], bool], turns: int = 1000) -> None:
    """Yield to the event loop until `condition` holds (loop turns, not time)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


async def test_three_models_in_turn_on_two_cores_stay_hot(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        write(tmp_path, name)
    w = shared_world(tmp_path)
    await w.ctl.deploy_all()
    first = {name: await w.infer(name) for name in ("a", "b", "c")}
    assert all(r.rung is Rung.TEMPLATE for r in first.values())
    for _ in range(5):
        for name in ("a", "b", "c"):
            result = await w.infer(name)
            assert (result.rung, result.instance_id) == (Rung.HOT, first[name].instance_id)
    assert len(w.node.started) == 3 and len(w.node.instances) == 3


async def test_a_request_waits_for_a_core_rather_than_a_third_instance_working(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        write(tmp_path, name)
    w = shared_world(tmp_path, queue_wait_s=2)
    await w.ctl.deploy_all()
    for name in ("a", "b", "c"):
        await w.infer(name)
    w.node.infer_delay = 1.0   # the steps below take a few loop turns: no real-time margin to keep on a loaded machine
    busy = [asyncio.ensure_future(w.infer(name)) for name in ("a", "b")]
    await turns_until(lambda: sum(1 for i in w.ctl.snapshot().instances if i.inflight) == 2)
    third = asyncio.ensure_future(w.infer("c"))
    await turns_until(lambda: w.ctl.waiting() == 1)
    assert not third.done()                   # both cores work: c's hot instance waits for one
    assert sum(1 for i in w.ctl.snapshot().instances if i.inflight) == 2
    w.node.infer_delay = 0.0
    await asyncio.gather(*busy)
    result = await third
    assert isinstance(result, InferResult) and result.rung is Rung.HOT


async def test_dedicated_contracts_take_the_dedicated_slots(tmp_path: Path) -> None:
    write(tmp_path, "a")
    (tmp_path / "models" / "d.yaml").write_text(
        (tmp_path / "models" / "a.yaml").read_text().replace("name: a", "name: d")
        .replace("resources: {memory_mb: 512}", "resources: {memory_mb: 512, dedicated_cores: true}"))
    w = shared_world(tmp_path, slots=3, dedicated=1)
    await w.ctl.deploy_all()
    await w.infer("a")
    await w.infer("d")
    assert sorted((m, s) for m, _, s in w.node.started) == [("a:1", "cpu"), ("d:1", "cpu-0")]


async def test_a_dedicated_contract_on_a_node_without_dedicated_slots_is_unavailable(tmp_path: Path) -> None:
    write(tmp_path, "a")
    (tmp_path / "models" / "a.yaml").write_text((tmp_path / "models" / "a.yaml").read_text().replace(
        "resources: {memory_mb: 512}", "resources: {memory_mb: 512, dedicated_cores: true}"))
    w = shared_world(tmp_path)
    await w.ctl.deploy_all()
    states = {e.name: (e.state, e.reason) for e in w.ctl.repository_index()}
    assert states["a"][0] == "UNAVAILABLE" and states["a"][1].startswith("resources.dedicated_cores: this node has no")
    with pytest.raises(ModelNotReady):
        await w.ctl.infer(w.ctl.contract("a"), X)
