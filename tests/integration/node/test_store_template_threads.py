"""A template that loaded store weights forks with one thread: the copies up to the memory tier (hashing the
chunks: blake3's thread pool would outlive the store and make the fork unsafe) are the node's, made behind the
load (`NodeWeights.starting`), never the template's."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ember.node import procinfo
from ember.node.local_node import LocalNode
from ember.store import StoreConfig, WeightStore
from ember.testing.models import minilm_dir
from ember.wire.contract import example_contracts_dir, load_contract, parse_contract

pytestmark = pytest.mark.slow


@pytest.fixture
def base() -> Iterator[Path]:
    # Unix socket paths are short: the state dir sits directly under /tmp.
    path = Path(tempfile.mkdtemp(prefix="ember-store-threads-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_template_that_copied_chunks_up_to_memory_forks_with_one_thread(base: Path) -> None:
    # Pushed to disk only: the template's load finds every chunk on disk; the node copies them up behind it.
    with WeightStore(StoreConfig(root=base / "node", memory_dir=None)) as publisher:
        publisher.push(minilm_dir(), "minilm:1")
    data: dict[str, Any] = load_contract(example_contracts_dir() / "minilm.yaml").model_dump(exclude={"source"})
    data.update(name="minilm-stored", weights="store:minilm:1")
    contract = parse_contract(data)
    memory = base / "memory"

    async def main() -> None:
        node = LocalNode(base / "state", store=StoreConfig(root=base / "node", memory_dir=memory))
        try:
            await node.prepare(contract)
            assert node.has_template(contract.key)
            assert procinfo.thread_count(node.pids()[f"template:{contract.key}"]) == 1
            deadline = time.monotonic() + 30
            while not any((memory / "chunks").glob("*/*")):   # the node's fill, behind the load (hashing them)
                assert time.monotonic() < deadline, "the node never filled the memory tier"
                await asyncio.sleep(0.05)
            assert procinfo.thread_count(node.pids()[f"template:{contract.key}"]) == 1
        finally:
            await node.close()
        assert not memory.exists()   # the node's store made the memory tier: gone with the node

    asyncio.run(main())
