"""The rung a new instance of a model starts from, from what the node keeps of it (`ModelInfo.start_rung`): the
template, else the zygote (with the weights local), else the process image, else a full start (FETCH)."""

from __future__ import annotations

import pytest

from ember.core.pool import ModelInfo
from ember.core.states import Rung


def info(**kept: bool) -> ModelInfo:
    return ModelInfo(key="m:1", slice_kind="cpu", memory_mb=512, min_scale=0, max_scale=2, target_concurrency=1,
                     pause_after_s=30, max_idle_s=300, **kept)


@pytest.mark.parametrize(("kept", "rung"), [
    ({"has_template": True, "image_ready": True}, Rung.TEMPLATE),
    ({"has_template": False, "image_ready": True}, Rung.ZYGOTE),
    ({"has_template": False, "runtime_ready": False, "image_ready": True}, Rung.RESTORE),
    ({"has_template": False, "weights_local": False, "image_ready": True}, Rung.RESTORE),
    ({"has_template": False, "runtime_ready": False}, Rung.FETCH),
])
def test_the_start_rung_is_the_fastest_thing_the_node_keeps(kept: dict[str, bool], rung: Rung) -> None:
    assert info(**kept).start_rung is rung
