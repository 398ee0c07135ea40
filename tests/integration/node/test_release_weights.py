"""A keep-alive plan's release of a store-backed model's memory-tier copy, through LocalNode and a real store."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from ember.core.slices import Slice
from ember.core.states import Rung
from ember.node.local_node import LocalNode
from ember.node.weights import NodeWeights
from ember.store import StoreConfig, WeightStore
from ember.wire.contract import ModelContract, load_contract

WEIGHED = Path(__file__).resolve().parents[2] / "fixtures" / "models" / "weighed.yaml"   # answers its bytes
CPU = sorted(os.sched_getaffinity(0))[0]
SLICE = Slice(id=f"cpu-{CPU}", kind="cpu", memory_mb=1024, cpus=(CPU,), threads=1)
SHARED, OWN = 2 << 20, 1 << 20   # bytes of the file both models hold, and of each one's own


def weighed(name: str) -> ModelContract:
    return load_contract(WEIGHED).model_copy(update={"name": name, "weights": f"store:{name}:1"})


@pytest.fixture
def config() -> Iterator[StoreConfig]:
    # Unix socket paths are short: the state dir sits directly under /tmp.
    base = Path(tempfile.mkdtemp(prefix="ember-release-", dir="/tmp"))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else base
    config = StoreConfig(root=base / "store", memory_dir=shm / f"ember-test-{os.getpid()}-{base.name}")
    shared = os.urandom(SHARED)
    with WeightStore(config.model_copy(update={"keep_memory_tier": True})) as publisher:
        for name in ("a", "b"):
            (base / name).mkdir()
            (base / name / "shared.bin").write_bytes(shared)
            (base / name / "own.bin").write_bytes(os.urandom(OWN))
            publisher.push(base / name, f"{name}:1")
    yield config
    shutil.rmtree(base, ignore_errors=True)
    assert config.memory_dir is not None
    shutil.rmtree(config.memory_dir, ignore_errors=True)


def in_memory(config: StoreConfig) -> set[str]:
    assert config.memory_dir is not None
    return {p.name for p in (config.memory_dir / "chunks").glob("*/*")}


def chunks(config: StoreConfig, model: str) -> set[str]:
    with WeightStore(config.model_copy(update={"memory_dir": None})) as store:
        return set(store.manifest(model).unique_chunks())


async def until(ready: Callable[[], bool], timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if ready():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


def test_release_frees_the_models_own_chunks_keeps_the_shared_ones_and_a_later_start_loads(
        config: StoreConfig) -> None:
    a, b = weighed("a"), weighed("b")
    shared = chunks(config, "a:1") & chunks(config, "b:1")
    own_a, own_b = chunks(config, "a:1") - shared, chunks(config, "b:1") - shared
    assert len(shared) == len(own_a) == len(own_b) == 1

    async def main() -> None:
        assert config.root is not None
        node = LocalNode(config.root.parent / "state", store=config, sandbox=False)
        try:
            assert node.store_backed(a) and not node.store_backed(load_contract(WEIGHED).model_copy(
                update={"weights": None}))
            await node.fill_weights(a)
            await node.fill_weights(b)
            await until(lambda: shared | own_a | own_b <= in_memory(config))
            assert await node.release_weights(a, [b]) == OWN             # b keeps its weights: the shared file stays
            assert in_memory(config) == shared | own_b
            assert await node.release_weights(a, [b]) == 0
            await node.prepare(a)
            started = await node.start(a, Rung.ZYGOTE, SLICE)          # its weights come from the disk tier
            out = await node.infer(started.instance_id, {"x": np.zeros(1, np.float32)})
            assert out["bytes"].tolist() == [SHARED + OWN]
            await until(lambda: own_a <= in_memory(config))            # the fill behind the start copies it up
        finally:
            await node.close()

    asyncio.run(main())


def test_a_start_in_flight_keeps_its_chunks_and_those_it_shares(config: StoreConfig) -> None:
    a, b = weighed("a"), weighed("b")
    shared = chunks(config, "a:1") & chunks(config, "b:1")

    async def main() -> None:
        weights = NodeWeights(config)
        try:
            await weights.fill_memory(a)
            await weights.fill_memory(b)
            await until(lambda: chunks(config, "a:1") | chunks(config, "b:1") <= in_memory(config))
            async with weights.starting(b):   # b's start came after the plan released both
                assert await weights.release_memory(a, []) == OWN
                assert await weights.release_memory(b, []) == 0
            assert in_memory(config) == chunks(config, "b:1") and shared
        finally:
            await asyncio.to_thread(weights.close)

    asyncio.run(main())
