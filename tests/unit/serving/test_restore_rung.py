"""The restore rung through the controller, on a FakeNode: a model with nothing held in memory (no template, its
zygote let go) starts from its process image where the node has one, and a restore that fails goes down the ladder."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.core.states import Rung
from ember.testing.controller import CONTRACT, World

pytestmark = pytest.mark.anyio


async def world(tmp: Path) -> World:
    (tmp / "models").mkdir(exist_ok=True)
    (tmp / "models" / "m.yaml").write_text(CONTRACT.format(name="m", memory=600, max_scale=1, min_scale=0,
                                                           template="false", concurrency=1, extra=""))
    w = World(tmp, slots=1)
    await w.ctl.deploy_all()
    w.node.zygotes.clear()    # let go (a keep-alive plan that keeps nothing would)
    return w


async def test_nothing_held_in_memory_and_an_image_on_disk_starts_from_the_image(tmp_path: Path) -> None:
    w = await world(tmp_path)
    w.node.images.add("m:1")
    served = await w.infer()
    assert served.rung is Rung.RESTORE
    assert w.node.started[-1][:2] == ("m:1", Rung.RESTORE)
    assert not w.node.zygotes and not w.node.templates   # nothing was made again for it


async def test_no_image_is_a_start_further_down(tmp_path: Path) -> None:
    w = await world(tmp_path)
    assert (await w.infer()).rung is Rung.FETCH


async def test_a_restore_that_fails_goes_down_the_ladder_and_says_why(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    w = await world(tmp_path)
    w.node.images.add("m:1")
    w.node.fail_restore.add("m:1")
    served = await w.infer()
    assert served.rung is Rung.FETCH
    assert "m:1: no instance from its image (m:1: no image to restore); starting it further down" in caplog.text
