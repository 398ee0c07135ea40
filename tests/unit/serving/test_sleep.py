"""The sleep rungs through the controller, on a FakeNode whose engines can sleep: the tick puts an idle instance to
sleep at its contract's `sleep_after_s`, a request wakes it (rung sleep-1 or sleep-2), another model may start on its
slice meanwhile, and an instance whose engine fails to sleep is recycled."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from ember.core.states import InstanceState, Rung
from ember.testing.controller import CONTRACT, World

pytestmark = pytest.mark.anyio


def write_sleeper(tmp: Path, name: str, *, level: int = 1, memory: int = 600, after_s: float = 10) -> None:
    (tmp / "models").mkdir(exist_ok=True)
    text = CONTRACT.format(name=name, memory=memory, max_scale=1, min_scale=0, template="false", concurrency=1,
                           extra=f", sleep_after_s: {after_s}, sleep_level: {level}")
    (tmp / "models" / f"{name}.yaml").write_text(text)


async def world(tmp: Path, slots: int = 1, levels: tuple[int, ...] = (1, 2)) -> World:
    w = World(tmp, slots=slots)
    for path in (tmp / "models").glob("*.yaml"):
        w.node.sleep_levels[f"{path.stem}:1"] = levels
    await w.ctl.deploy_all()
    return w


async def test_an_idle_instance_sleeps_then_a_request_wakes_it_on_its_rung(tmp_path: Path) -> None:
    write_sleeper(tmp_path, "m", level=2)
    w = await world(tmp_path)
    w.node.held_mb = 300.0
    iid = (await w.infer()).instance_id
    await w.run_for(3)
    assert iid in w.node.paused and iid not in w.node.asleep
    await w.run_for(8)
    assert w.node.asleep == {iid: 2}
    [inst] = w.ctl.snapshot().instances
    assert inst.id == iid and inst.state is InstanceState.ASLEEP and inst.held_mb == 300.0
    woken = await w.infer()
    assert woken.rung is Rung.SLEEP_2 and woken.instance_id == iid and np.allclose(woken.outputs["y"], [2, 2, 2])
    assert w.node.wakes == [iid] and iid not in w.node.asleep
    text = w.metrics.text().decode()
    assert 'ember_ladder_time_to_first_response_seconds_count{model="m",rung="sleep-2",version="1"} 1.0' in text
    assert (await w.infer()).rung is Rung.HOT


async def test_an_asleep_instances_slice_hosts_another_model_and_it_wakes_once_that_one_sleeps(tmp_path: Path) -> None:
    write_sleeper(tmp_path, "m", memory=600)
    write_sleeper(tmp_path, "n", memory=600)
    w = await world(tmp_path, slots=1)     # one 1024 MB slice: two awake 600 MB models never fit together
    w.node.held_mb = 100.0
    a = (await w.infer("m")).instance_id
    await w.run_for(11)
    assert a in w.node.asleep
    b = await w.infer("n")
    assert b.rung is Rung.ZYGOTE and b.instance_id != a and a in w.node.instances   # beside the asleep one
    await w.run_for(11)
    assert set(w.node.asleep) == {a, b.instance_id}
    woken = await w.infer("m")
    assert woken.rung is Rung.SLEEP_1 and woken.instance_id == a


async def test_an_engine_that_cannot_sleep_is_paused_and_one_whose_sleep_fails_is_recycled(tmp_path: Path) -> None:
    write_sleeper(tmp_path, "m")
    w = await world(tmp_path, levels=())
    iid = (await w.infer()).instance_id
    await w.run_for(15)
    assert iid in w.node.paused and not w.node.asleep
    assert (await w.infer()).rung is Rung.PAUSED

    w2 = await world(tmp_path)
    w2.node.fail_sleep = True
    iid = (await w2.infer()).instance_id
    await w2.run_for(12)
    assert iid not in w2.node.instances
    assert (await w2.infer()).rung is Rung.ZYGOTE


async def test_an_engine_that_fails_to_wake_is_recycled_and_the_request_served_from_a_new_instance(
        tmp_path: Path) -> None:
    write_sleeper(tmp_path, "m")
    w = await world(tmp_path)
    iid = (await w.infer()).instance_id
    await w.run_for(11)
    assert iid in w.node.asleep
    w.node.fail_wake = True
    served = await w.infer()
    assert served.rung is Rung.ZYGOTE and served.instance_id != iid and iid not in w.node.instances


async def test_a_request_that_leaves_while_its_instance_wakes_leaves_it_awake_and_idle(tmp_path: Path) -> None:
    write_sleeper(tmp_path, "m")
    w = await world(tmp_path)
    w.node.sleep_delay = 0.2
    iid = (await w.infer()).instance_id
    await w.run_for(10)
    w.clock.advance(1)
    await w.ctl.tick()                     # the sleep task starts: it holds the instance for 0.2 s
    await asyncio.sleep(0.01)
    waiting = asyncio.ensure_future(w.infer())
    await asyncio.sleep(0.05)              # the request claimed the instance and waits for the sleep to end
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.sleep(0.3)
    [inst] = w.ctl.snapshot().instances
    assert inst.id == iid and inst.state is InstanceState.IDLE and inst.inflight == 0
    assert iid not in w.node.asleep and w.node.wakes == [iid]
    assert (await w.infer()).rung is Rung.HOT


async def test_a_failed_sleep_does_not_recycle_an_instance_a_request_already_claimed(tmp_path: Path) -> None:
    write_sleeper(tmp_path, "m")
    w = await world(tmp_path)
    w.node.sleep_delay, w.node.fail_sleep = 0.2, True
    iid = (await w.infer()).instance_id
    await w.run_for(10)
    w.clock.advance(1)
    await w.ctl.tick()
    await asyncio.sleep(0.01)
    served = await w.infer()               # claims it during the failing sleep, then serves from it
    assert served.instance_id == iid and iid in w.node.instances


async def test_requests_routed_to_a_waking_instance_are_served_by_it(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    text = CONTRACT.format(name="m", memory=600, max_scale=1, min_scale=0, template="false", concurrency=4,
                           extra=", sleep_after_s: 10, max_concurrency: 4")
    (tmp_path / "models" / "m.yaml").write_text(text)
    w = await world(tmp_path)
    w.node.sleep_delay = 0.2
    iid = (await w.infer()).instance_id
    await w.run_for(10)
    w.clock.advance(1)
    await w.ctl.tick()
    await asyncio.sleep(0.01)
    results = await asyncio.gather(*(w.infer() for _ in range(3)))
    assert {r.instance_id for r in results} == {iid} and set(w.node.instances) == {iid}


@pytest.mark.parametrize("failure", ["fail_wake", "crash"])
async def test_a_wake_that_fails_after_its_request_left_still_takes_the_instance_out(tmp_path: Path,
                                                                                     failure: str) -> None:
    write_sleeper(tmp_path, "m")
    w = await world(tmp_path)
    iid = (await w.infer()).instance_id
    await w.run_for(11)
    assert iid in w.node.asleep
    w.node.wake_delay = 0.2
    if failure == "fail_wake":
        w.node.fail_wake = True
    else:
        w.node.instances.pop(iid)          # it died while asleep: the wake finds it gone
    waiting = asyncio.ensure_future(w.infer())
    await asyncio.sleep(0.05)              # mid-wake, the client leaves
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.sleep(0.4)
    assert [i for i in w.ctl.snapshot().instances if i.id == iid] == []   # recycled or crashed, not idle


async def test_a_request_that_claims_an_instance_before_its_sleep_began_is_not_counted_on_a_sleep_rung(
        tmp_path: Path) -> None:
    write_sleeper(tmp_path, "m")
    w = await world(tmp_path)
    iid = (await w.infer()).instance_id
    await w.run_for(3)
    w.ctl._pool.transition(iid, InstanceState.ASLEEP, w.clock.now())   # the tick's decision; its task not run yet
    served = await w.infer()
    assert served.instance_id == iid and served.rung is Rung.PAUSED and not w.node.asleep
    w.node.sleep_delay = 0.2
    await w.run_for(11)
    w.node.sleep_delay = 0.0
    await asyncio.sleep(0.01)
    assert (await w.infer()).rung is Rung.SLEEP_1      # once its sleep began, a request wakes it from sleep-1
