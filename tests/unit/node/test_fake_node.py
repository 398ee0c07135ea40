"""FakeNode's weights: remote models are not local until a FETCH start or a template's prepare pulls them."""

from __future__ import annotations

import asyncio

import pytest

from ember.core.slices import Slice
from ember.core.states import Rung
from ember.errors import InvalidInput, ModelNotReady
from ember.testing.node import FakeNode
from ember.wire.contract import ModelContract, parse_contract

SLICE = Slice(id="cpu-0", kind="cpu", memory_mb=512, cpus=(0,), threads=1)


def contract(name: str, keep_template: bool) -> ModelContract:
    return parse_contract({
        "name": name, "runtime": "python", "entrypoint": "m:M", "weights": f"store:{name}:1",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
        "scaling": {"keep_template": keep_template},
    })


def test_a_fetch_start_pulls_a_remote_model_once_and_counts_the_pull_in_its_time_to_ready() -> None:
    async def main() -> None:
        c = contract("remote", keep_template=False)
        node = FakeNode(remote={c.key}, start_delay=0.01, fetch_delay=0.02)
        await node.prepare(c)
        assert not node.weights_local(c) and node.fetched == []   # no template: prepare pulls nothing
        first = await node.start(c, Rung.FETCH, SLICE)
        assert first.rung is Rung.FETCH and first.time_to_ready_s == pytest.approx(0.03)
        assert node.weights_local(c) and node.fetched == [c.key]
        second = await node.start(c, Rung.FETCH, SLICE)              # local by now: nothing to pull
        assert second.time_to_ready_s == pytest.approx(0.01) and node.fetched == [c.key]
        assert [rung for _, rung, _ in node.started] == [Rung.FETCH, Rung.FETCH]

    asyncio.run(main())


def test_a_template_pulls_its_weights_at_prepare() -> None:
    async def main() -> None:
        c = contract("templated", keep_template=True)
        node = FakeNode(remote={c.key})
        await node.prepare(c)
        assert node.weights_local(c) and node.has_template(c.key) and node.fetched == [c.key]

    asyncio.run(main())


def test_local_models_and_bad_rungs() -> None:
    async def main() -> None:
        c = contract("local", keep_template=False)
        node = FakeNode()
        assert node.weights_local(c)
        with pytest.raises(ModelNotReady):
            await node.start(c, Rung.FETCH, SLICE)                    # not prepared
        await node.prepare(c)
        assert (await node.start(c, Rung.FETCH, SLICE)).rung is Rung.FETCH and node.fetched == []
        with pytest.raises(InvalidInput, match="rung"):
            await node.start(c, Rung.HOT, SLICE)

    asyncio.run(main())
