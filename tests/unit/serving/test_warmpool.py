"""The warm pool on the controller (FakeNode, FakeClock): idle instances within the node's idle-memory budget,
sized by the LP buffer planner from each model's forecast."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ember.config import load_serve_config, warm_pool_settings
from ember.core.states import InstanceState, Rung
from ember.core.warm_pool import WarmPoolSettings
from ember.errors import InvalidInput
from ember.testing.controller import World, write

pytestmark = pytest.mark.anyio

ONE = 150.0     # MB: one idle instance of 128 MB


def _idle(w: World, model: str) -> list[str]:
    return [i.id for i in w.ctl._pool.snapshot().of_model(f"{model}:1")
            if i.state in (InstanceState.IDLE, InstanceState.PAUSED)]


async def _world(tmp: Path, budget_mb: float, latency_value: float = 1e7, **b_scaling: int) -> World:
    write(tmp, "a", memory=128)
    write(tmp, "b", memory=128, **b_scaling)
    w = World(tmp, slots=3, warm_pool=WarmPoolSettings(budget_mb, latency_value=latency_value))
    await w.ctl.deploy_all()
    return w


async def _serve_b_once_then_a_every_second(w: World) -> None:
    await w.infer("b")
    for _ in range(8):
        await w.run_for(1)
        await w.infer("a")
    await w.run_for(2)


async def test_a_budget_for_one_keeps_the_model_more_likely_to_be_called(tmp_path: Path) -> None:
    # latency_value 1e7: any instance likely to be used within the minute pays for its memory, so the budget
    # decides. a, called every second, is near-certain to be called within the minute; b, called once, has
    # the prior's chance (about a third): a's instance stays, b's is recycled.
    w = await _world(tmp_path, ONE)
    await _serve_b_once_then_a_every_second(w)
    assert len(_idle(w, "a")) == 1 and _idle(w, "b") == []
    assert (await w.infer("a")).rung in (Rung.HOT, Rung.PAUSED)     # kept warm
    assert (await w.infer("b")).rung is Rung.TEMPLATE                # started again


async def test_room_for_both_keeps_both(tmp_path: Path) -> None:
    w = await _world(tmp_path, 2 * ONE)
    await _serve_b_once_then_a_every_second(w)
    assert len(_idle(w, "a")) == 1 and len(_idle(w, "b")) == 1


async def test_an_instance_not_worth_its_memory_goes_though_there_is_room(tmp_path: Path) -> None:
    # At 1e5 MB*s per second, a 128 MB idle minute pays only if a call is more likely than 7,680 / (1e5 * 0.0847
    # s saved over the template start) = 0.91: b's third is not, and neither is a's chance 2 s after its last call
    # (no gap it has seen was over a second: beyond that only the prior's share of its forecast is left).
    w = await _world(tmp_path, 10 * ONE, latency_value=1e5)
    await _serve_b_once_then_a_every_second(w)
    assert _idle(w, "b") == [] and _idle(w, "a") == []


async def test_min_scale_wins_over_the_plan(tmp_path: Path) -> None:
    w = await _world(tmp_path, ONE, min_scale=1)
    await _serve_b_once_then_a_every_second(w)
    assert len(_idle(w, "b")) == 1


def test_the_budget_is_validated_at_the_edge_naming_the_flag_and_its_range() -> None:
    with pytest.raises(InvalidInput, match=r"idle_memory_mb: .*--idle-memory-mb must lie in \[1, 1e\+09\] \(got 0\)"):
        load_serve_config(idle_memory_mb=0)
    with pytest.raises(InvalidInput, match=r"--idle-latency-value must lie in \[0.001, 1e\+15\] \(got 1e\+16\)"):
        load_serve_config(idle_memory_mb=100, idle_latency_value=1e16)
    assert warm_pool_settings(load_serve_config()) is None
    got = warm_pool_settings(load_serve_config(idle_memory_mb=512, idle_latency_value=1e6))
    assert got is not None and (got.budget_mb, got.latency_value) == (512.0, 1e6)


async def _serve_b_once_then_a_twice_at_once(w: World) -> None:
    w.node.infer_delay = 0.05
    await w.infer("b")
    for _ in range(4):
        calls = [asyncio.ensure_future(w.infer("a")) for _ in range(2)]
        await asyncio.sleep(0.02)
        await w.ctl.tick()                     # the pool sees two of a's instances in use
        await asyncio.gather(*calls)
        await w.run_for(1)


async def test_a_model_that_ran_two_instances_at_once_keeps_two_while_likely_to_again(tmp_path: Path) -> None:
    # a ran two instances at once: P(D > 1) = P(D > 0) = its chance of a call, so with room for three and
    # latency_value 1e7 both of a's idle instances stay, and b's.
    w = await _world(tmp_path, 3 * ONE)
    await _serve_b_once_then_a_twice_at_once(w)
    assert len(_idle(w, "a")) == 2 and len(_idle(w, "b")) == 1


async def test_with_room_for_two_the_likelier_models_two_go_first(tmp_path: Path) -> None:
    w = await _world(tmp_path, 2 * ONE)
    await _serve_b_once_then_a_twice_at_once(w)
    assert len(_idle(w, "a")) == 2 and _idle(w, "b") == []
