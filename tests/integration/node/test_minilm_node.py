"""The real MiniLM embedder through LocalNode: template and zygote replicas agree, weights are shared."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

import numpy as np
import pytest

from ember.core.slices import Slice
from ember.core.states import Rung
from ember.node import procinfo
from ember.node.local_node import LocalNode
from ember.wire.contract import example_contracts_dir, load_contract

pytestmark = pytest.mark.slow


def sentences(*texts: str) -> dict[str, np.ndarray]:
    array = np.empty(len(texts), dtype=object)
    array[:] = [t.encode() for t in texts]
    return {"text": array}


def test_minilm_from_template_and_zygote() -> None:
    async def main() -> None:
        contract = load_contract(example_contracts_dir() / "minilm.yaml")
        cpu = sorted(os.sched_getaffinity(0))[0]
        slice_ = Slice(id=f"cpu-{cpu}", kind="cpu", memory_mb=1024, cpus=(cpu,), threads=1)
        state = tempfile.mkdtemp(prefix="ember-node-", dir="/tmp")
        node = LocalNode(state)
        try:
            await node.prepare(contract)
            template = node.pids()[f"template:{contract.key}"]
            zygote = node.pids()[f"zygote:{contract.runtime}"]
            assert procinfo.thread_count(template) == procinfo.thread_count(zygote) == 1
            replicas = [await node.start(contract, Rung.TEMPLATE, slice_) for _ in range(2)]
            loaded = await node.start(contract, Rung.ZYGOTE, slice_)
            request = sentences("A cat sits on the mat.", "Serverless inference with warm starts.")
            outputs = [await node.infer(s.instance_id, request) for s in (*replicas, loaded)]
            for out in outputs:
                assert out["embedding"].shape == (2, 384)
                assert np.allclose(np.linalg.norm(out["embedding"], axis=1), 1.0, atol=1e-4)
                assert np.allclose(out["embedding"], outputs[0]["embedding"], atol=1e-5)
                assert out["token_count"].tolist() == outputs[0]["token_count"].tolist()
            assert not np.allclose(outputs[0]["embedding"][0], outputs[0]["embedding"][1])
            template_memory = node.template_memory(contract.key)
            assert template_memory is not None
            for replica in replicas:   # the weights and the runtime are the template's pages
                assert node.memory(replica.instance_id).uss_bytes < 0.25 * template_memory.pss_bytes
        finally:
            await node.close()
            shutil.rmtree(state, ignore_errors=True)

    asyncio.run(main())
