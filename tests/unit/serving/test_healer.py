"""A lost template: requests start from the zygote meanwhile, the template is made again (with backoff while
that fails), and the model stays ready throughout, saying that it runs degraded."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.core.states import Rung
from ember.keepalive.policies import FixedZygote
from ember.testing.controller import World, write

pytestmark = pytest.mark.anyio


async def test_a_lost_template_falls_back_to_the_zygote_and_is_made_again(tmp_path: Path) -> None:
    write(tmp_path, "m")
    w = World(tmp_path, slots=4)
    await w.ctl.deploy_all()
    assert (await w.infer()).rung is Rung.TEMPLATE
    w.node.templates.discard("m:1")   # the template process died
    w.node.fail_prepare.add("m:1")    # and cannot be made again yet
    w.clock.advance(1)
    w.node.templates.discard("m:1")
    assert (await w.infer()).rung is Rung.HOT   # the running instance serves on
    await w.run_for(1)
    assert w.ctl.model_ready("m")
    (entry,) = w.ctl.repository_index()
    assert entry.state == "READY" and "cannot be made again" in entry.reason
    (status,) = w.ctl.status()
    assert status.state.startswith("READY: its template exited")
    w.node.fail_prepare.discard("m:1")
    await w.run_for(8)                 # the backoff passes; the repair succeeds
    assert w.node.has_template("m:1") and w.ctl.repository_index()[0].reason == ""
    assert w.ctl._pool.models["m:1"].has_template


async def test_a_start_between_ticks_takes_the_zygote_when_the_template_is_gone(tmp_path: Path) -> None:
    write(tmp_path, "m")
    w = World(tmp_path)
    await w.ctl.deploy_all()
    w.node.templates.discard("m:1")   # no tick yet: the pool still names the template rung
    assert (await w.infer()).rung is Rung.ZYGOTE
    assert [rung for _, rung, _ in w.node.started] == [Rung.ZYGOTE]


async def test_a_template_released_by_the_keepalive_plan_is_not_lost(tmp_path: Path) -> None:
    write(tmp_path, "m")
    w = World(tmp_path, keepalive=FixedZygote(keep_alive_s=1))
    await w.ctl.deploy_all()
    await w.infer()
    await w.run_for(5)                 # the plan drops to the zygote: instance, then template, released
    assert not w.node.templates and w.node.zygotes == {"python"}
    await w.run_for(5)
    assert not w.node.templates        # the healer did not make it again against the plan
    (entry,) = w.ctl.repository_index()
    assert entry.state == "READY" and entry.reason == ""   # not degraded: nothing was lost
