"""Store-backed MiniLM through LocalNode: the FETCH rung pulls from a real nginx origin, then forks from the zygote."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ember.core.slices import Slice
from ember.core.states import Rung
from ember.errors import ModelNotReady
from ember.node import procinfo
from ember.node.local_node import LocalNode
from ember.store import StoreConfig, WeightStore
from ember.testing.models import minilm_dir
from ember.testing.nginx import NginxOrigin, available
from ember.wire.contract import ModelContract, example_contracts_dir, load_contract, parse_contract

pytestmark = pytest.mark.slow

CPU = sorted(os.sched_getaffinity(0))[0]
SLICE = Slice(id=f"cpu-{CPU}", kind="cpu", memory_mb=1024, cpus=(CPU,), threads=1)


def bundled() -> ModelContract:
    return load_contract(example_contracts_dir() / "minilm.yaml")


def store_backed(name: str, keep_template: bool) -> ModelContract:
    data: dict[str, Any] = bundled().model_dump(exclude={"source"})
    data.update(name=name, weights="store:minilm:1")
    data["scaling"] = {**data["scaling"], "keep_template": keep_template}
    return parse_contract(data)


def private_bytes(pid: int, roots: list[Path]) -> tuple[int, int]:
    """(private, mapped) bytes of `pid`'s mappings of files under `roots`, from /proc/PID/smaps."""
    private = mapped = 0
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
            path = Path(fields[5]) if len(fields) > 5 else None
            inside = path is not None and any(root in path.parents for root in roots)
        elif inside and fields[0] == "Rss:":
            mapped += int(fields[1]) * 1024
        elif inside and fields[0] in ("Private_Clean:", "Private_Dirty:"):
            private += int(fields[1]) * 1024
    return private, mapped


def sentences(*texts: str) -> dict[str, np.ndarray]:
    array = np.empty(len(texts), dtype=object)
    array[:] = [t.encode() for t in texts]
    return {"text": array}


REQUEST = sentences("A cat sits on the mat.", "Serverless inference with warm starts.", "Weights from a store.")


@pytest.fixture
def dirs() -> Iterator[dict[str, Path]]:
    # Unix socket paths are short: the state dir sits directly under /tmp.
    base = Path(tempfile.mkdtemp(prefix="ember-store-node-", dir="/tmp"))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else base
    memory = shm / f"ember-test-{os.getpid()}-{base.name}"
    yield {"state": base / "state", "origin": base / "origin", "node": base / "node", "memory": memory}
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(memory, ignore_errors=True)


@pytest.fixture
def origin(dirs: dict[str, Path]) -> Iterator[NginxOrigin]:
    if not available():
        pytest.skip("nginx is not installed (make system)")
    with WeightStore(StoreConfig(root=dirs["origin"], memory_dir=None)) as publisher:
        publisher.push(minilm_dir(), "minilm:1")
    with NginxOrigin(dirs["origin"]) as served:
        yield served


def node_store(dirs: dict[str, Path], origin: NginxOrigin) -> StoreConfig:
    return StoreConfig(root=dirs["node"], memory_dir=dirs["memory"], origin=origin.url)


def _in_memory(dirs: dict[str, Path], origin: NginxOrigin) -> int:
    """How many of MiniLM's chunks the node's memory tier holds (its index, shared by every process)."""
    store = WeightStore(node_store(dirs, origin))
    try:
        assert store.memory is not None
        return len(store.memory.indexed(store.manifest("minilm:1").unique_chunks().values()))
    finally:
        store.close()


async def _until(ready: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, "not within the timeout"
        await asyncio.sleep(0.1)


async def reference_embeddings(state: Path) -> np.ndarray:
    node = LocalNode(state)
    try:
        contract = bundled().model_copy(update={"scaling": bundled().scaling.model_copy(
            update={"keep_template": False})})
        await node.prepare(contract)
        started = await node.start(contract, Rung.ZYGOTE, SLICE)
        return (await node.infer(started.instance_id, REQUEST))["embedding"]
    finally:
        await node.close()


def test_fetch_pulls_a_store_backed_model_from_the_origin_and_serves_the_same_embeddings(
        dirs: dict[str, Path], origin: NginxOrigin) -> None:
    async def main() -> None:
        expected = await reference_embeddings(dirs["state"] / "ref")
        contract = store_backed("minilm-remote", keep_template=False)
        node = LocalNode(dirs["state"] / "n", store=node_store(dirs, origin))
        try:
            assert node.weights_local(bundled())          # weights that are not in a store need no fetch
            assert not node.weights_local(contract)       # not even the manifest is local
            await node.prepare(contract)
            assert not node.has_template(contract.key)
            assert not node.weights_local(contract)       # no template: prepare fetched nothing
            assert origin.requests() == []                # weights_local and prepare never asked the origin
            started = await node.start(contract, Rung.FETCH, SLICE)
            assert started.rung is Rung.FETCH
            assert node.weights_local(contract)
            hello = node.startup(started.instance_id)
            assert started.time_to_ready_s > hello["load_s"] + hello["warmup_s"]  # counted from the start call
            got = (await node.infer(started.instance_id, REQUEST))["embedding"]
            np.testing.assert_array_equal(got, expected)
            fetched = [path for path in origin.requests() if "/chunks/" in path]
            manifest = WeightStore(StoreConfig(root=dirs["origin"], memory_dir=None))
            try:
                assert len(set(fetched)) == len(fetched)  # every chunk requested once
                assert len(fetched) == len(manifest.manifest("minilm:1").unique_chunks())
            finally:
                manifest.close()
            again = await node.start(contract, Rung.FETCH, SLICE)   # local by now: nothing more to pull
            assert [p for p in origin.requests() if "/chunks/" in p] == fetched
            np.testing.assert_array_equal((await node.infer(again.instance_id, REQUEST))["embedding"], expected)
            # The instances mapped the disk copies; the node fills the memory tier behind its starts.
            await _until(lambda: _in_memory(dirs, origin) == len(fetched), 30)
        finally:
            await node.close()

    asyncio.run(main())


def test_a_template_fetches_at_prepare_and_its_replicas_serve(dirs: dict[str, Path], origin: NginxOrigin) -> None:
    async def main() -> None:
        contract = store_backed("minilm-template", keep_template=True)
        node = LocalNode(dirs["state"], store=node_store(dirs, origin))
        try:
            await node.prepare(contract)
            assert node.has_template(contract.key)
            assert node.weights_local(contract)
            # The template loaded through a store of its own and closed it: no store thread is left to fork.
            assert procinfo.thread_count(node.pids()[f"template:{contract.key}"]) == 1
            replica = await node.start(contract, Rung.TEMPLATE, SLICE)
            out = await node.infer(replica.instance_id, REQUEST)
            assert out["embedding"].shape == (3, 384)
            assert np.allclose(np.linalg.norm(out["embedding"], axis=1), 1.0, atol=1e-4)
            assert node.template_memory(contract.key) is not None
            # Private (unshared) pages of the replica in the store's chunk files: the weights it does not share.
            # (Its whole USS also counts library code it is the first to run, which varies from run to run.)
            private, mapped = private_bytes(replica.pid, [dirs["node"] / "chunks", dirs["memory"] / "chunks"])
            # `mapped` is what the replica touched: every encoder layer, a few rows of the 47 MB token embedding.
            assert mapped > 30 * 2**20 and private < 0.05 * mapped
        finally:
            await node.close()

    asyncio.run(main())


def test_a_model_the_store_lacks_or_a_node_without_a_store_is_model_not_ready(
        dirs: dict[str, Path], origin: NginxOrigin) -> None:
    async def main() -> None:
        missing = store_backed("nothing", keep_template=False).model_copy(update={"weights": "store:absent:3"})
        node = LocalNode(dirs["state"] / "a", store=node_store(dirs, origin))
        try:
            await node.prepare(missing)
            with pytest.raises(ModelNotReady) as info:
                await node.start(missing, Rung.FETCH, SLICE)
            assert "nothing:1" in str(info.value) and "absent:3" in str(info.value)
            assert str(dirs["node"]) in str(info.value) and origin.url in str(info.value)
        finally:
            await node.close()
        bare = LocalNode(dirs["state"] / "b")
        try:
            with pytest.raises(ModelNotReady, match="--store-root"):
                await bare.prepare(store_backed("minilm-remote", keep_template=False))
            assert not bare.weights_local(store_backed("minilm-remote", keep_template=False))
        finally:
            await bare.close()

    asyncio.run(main())
